#include "runtime/supervise/elastic.h"

#include <fmt/format.h>

#include <cmath>
#include <numeric>

namespace t3d::runtime {

namespace {

// `bytes` in GiB to three significant digits, rounded up with `up` (a budget that suffices).
std::string gib(double bytes, bool up = false) {
  const double g = bytes / kGiB;
  if (!up || g <= 0) return fmt::format("{:.3g}", g);
  const double step = std::pow(10.0, std::floor(std::log10(g)) - 2);
  return fmt::format("{:.3g}", std::ceil(g / step) * step);
}

// Why the largest shrunk layout, `s` needing `need` bytes per rank, does not fit, in numbers.
std::string memory_why_not(const Recipe& recipe, const Shrink& s, double need, double now) {
  const auto& p = recipe.parallel;
  const int64_t e = recipe.model.n_experts;
  const std::string holds =
      !recipe.model.moe()
          ? fmt::format(
                "dp would fall from {} to {}, and ZeRO's shards and the micro-batches per step "
                "grow with it",
                p.dp, s.dp)
      : s.ep < p.ep
          ? fmt::format(
                "ep would fall from {} to {}, each rank holding {} of the {} routed experts "
                "of every MoE block ({} now)",
                p.ep, s.ep, e / s.ep, e, e / p.ep)
          : fmt::format(
                "ep stays {} (each rank keeps its {} of the {} routed experts of every MoE "
                "block), but dp would fall from {} to {}, and ZeRO's shards and the "
                "micro-batches per step grow with it",
                p.ep, e / p.ep, e, p.dp, s.dp);
  return fmt::format(
      "{}: {} needs about {} GiB per rank ({} in the present layout, as "
      "`titan3d plan` prices both) against hardware.hbm_gib = {:g}",
      holds, describe_layout(shrunk_recipe(recipe, s)), gib(need), gib(now),
      recipe.hardware.hbm_gib);
}

}  // namespace

Shrink plan_shrink(const Recipe& recipe, int capacity, const RankBytes& rank_bytes) {
  const auto& p = recipe.parallel;
  const int64_t rest = p.pp * p.cp * p.tp;  // what a shrink keeps: one replica's ranks
  const double hbm = recipe.hardware.hbm_gib * kGiB;
  // Every layout is priced, the present one first. Where even that is above hardware.hbm_gib,
  // the estimate overprices this recipe (sequence parallelism, say, is priced as without:
  // docs/planner.md) and tells nothing: the shrink goes ahead unpriced and the arena's own check
  // at the relaunch has the last word.
  std::optional<double> now;
  if (rank_bytes) now = rank_bytes(recipe);
  if (now && *now > hbm) now.reset();
  // Every dp that fits the ranks is tried, largest first, not only the largest: memory is not
  // monotone in dp. ZeRO's shards and the micro-batches per step only grow as dp falls, but the
  // ep a dp keeps, gcd(old ep, dp·cp), can grow as dp falls (dp 12, ep 4 -> dp 6 keeps ep 2,
  // dp 4 keeps ep 4), holding fewer experts per rank (though sizing their rows for ep·N·K).
  Shrink refused;
  double refused_need = 0;
  int others = 0;  // smaller layouts that did not fit either
  for (int64_t dp = p.dp - 1; dp >= 1; --dp) {
    if (p.dp % dp != 0 || dp * rest > capacity) continue;
    Shrink s;
    s.dp = dp;
    s.micro_batches = recipe.train.micro_batches * (p.dp / dp);
    s.ranks = static_cast<int>(dp * rest);
    // Expert parallelism folds into dp × cp: the largest divisor of the old ep that still divides
    // it, each rank then holding more of the experts (the snapshot reshards them).
    s.ep = std::gcd(p.ep, dp * p.cp);
    const std::optional<double> need = now ? rank_bytes(shrunk_recipe(recipe, s)) : std::nullopt;
    if (!need || *need <= hbm) {
      if (refused.dp > 0)
        s.note = fmt::format("dp {} passed over: {}", refused.dp,
                             memory_why_not(recipe, refused, refused_need, *now));
      return s;
    }
    if (refused.dp == 0)
      refused = s, refused_need = *need;
    else
      ++others;
  }
  Shrink s;
  if (refused.dp > 0) {
    s.why_not = fmt::format(
        "{}; {}. Raise hardware.hbm_gib to at least {} if the devices have that much, or "
        "bring back the lost hosts (or start on more ranks)",
        memory_why_not(recipe, refused, refused_need, *now),
        others > 0 ? fmt::format("no smaller dp fits either ({} tried)", others)
                   : "it is the only smaller layout the remaining hosts can take",
        gib(refused_need, /*up=*/true));
    return s;
  }
  s.why_not = fmt::format(
      "one data-parallel replica needs pp·cp·tp = {} ranks and dp = {} has no smaller divisor "
      "whose world fits the {} rank(s) the remaining hosts can take: mend the lost hosts or "
      "give the job more slots",
      rest, p.dp, capacity);
  return s;
}

Recipe shrunk_recipe(const Recipe& recipe, const Shrink& shrink) {
  Recipe r = recipe;
  r.parallel.dp = shrink.dp;
  r.train.micro_batches = shrink.micro_batches;
  r.parallel.ep = shrink.ep;
  return r;
}

int remaining_capacity(const std::vector<HostEntry>& all, const std::vector<HostEntry>& remaining,
                       int world) {
  if (total_slots(all) > 0) return total_slots(remaining);
  return static_cast<int>(static_cast<int64_t>(world) * static_cast<int64_t>(remaining.size()) /
                          static_cast<int64_t>(all.size()));
}

std::string describe_layout(const Recipe& r) {
  const auto& p = r.parallel;
  return fmt::format("pp{} dp{}{} tp{}{} ({} rank{}, {} micro-batch{} per replica)", p.pp, p.dp,
                     p.cp > 1 ? fmt::format(" cp{}", p.cp) : "", p.tp,
                     p.ep > 1 ? fmt::format(" ep{}", p.ep) : "", r.world_size(),
                     r.world_size() == 1 ? "" : "s", r.train.micro_batches,
                     r.train.micro_batches == 1 ? "" : "es");
}

std::vector<LostHost> unreachable_hosts(const std::vector<HostEntry>& hosts, bool as_root,
                                        double timeout_s) {
  std::vector<LostHost> lost;
  for (const auto& h : hosts) {
    std::string why;
    if (!probe_host(h.host, as_root, timeout_s, &why)) lost.push_back({h, why});
  }
  return lost;
}

}  // namespace t3d::runtime
