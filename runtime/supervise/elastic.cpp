#include "runtime/supervise/elastic.h"

#include <fmt/format.h>

namespace t3d::runtime {

Shrink plan_shrink(const Recipe& recipe, int capacity) {
  Shrink s;
  const auto& p = recipe.parallel;
  const int64_t rest = p.pp * p.cp * p.tp;  // what a shrink keeps: one replica's ranks
  for (int64_t dp = p.dp - 1; dp >= 1; --dp) {
    if (p.dp % dp != 0 || dp * rest > capacity) continue;
    s.dp = dp;
    s.micro_batches = recipe.train.micro_batches * (p.dp / dp);
    s.ranks = static_cast<int>(dp * rest);
    // Expert parallelism folds into dp × cp: the largest divisor of the old ep that still divides
    // it, each rank then holding more of the experts (the snapshot reshards them).
    s.ep = p.ep;
    while ((dp * p.cp) % s.ep != 0 || p.ep % s.ep != 0) --s.ep;
    return s;
  }
  s.why_not = fmt::format(
      "one data-parallel replica needs pp·cp·tp = {} ranks and dp = {} has no smaller divisor "
      "whose world fits the {} rank(s) the remaining hosts can take",
      rest, p.dp, capacity);
  return s;
}

int remaining_capacity(const std::vector<HostEntry>& all, const std::vector<HostEntry>& remaining,
                       int world) {
  if (total_slots(all) > 0) return total_slots(remaining);
  return static_cast<int>(static_cast<int64_t>(world) * static_cast<int64_t>(remaining.size()) /
                          static_cast<int64_t>(all.size()));
}

std::string describe_layout(const Recipe& r) {
  const auto& p = r.parallel;
  return fmt::format("pp{} dp{}{} tp{}{} ({} ranks, {} micro-batch{} per replica)", p.pp, p.dp,
                     p.cp > 1 ? fmt::format(" cp{}", p.cp) : "", p.tp,
                     p.ep > 1 ? fmt::format(" ep{}", p.ep) : "", r.world_size(),
                     r.train.micro_batches, r.train.micro_batches == 1 ? "" : "es");
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
