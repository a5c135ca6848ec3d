#include "runtime/cost/planner.h"

#include <spdlog/fmt/fmt.h>

#include <algorithm>
#include <cstdio>
#include <filesystem>
#include <fstream>
#include <map>
#include <memory>
#include <sstream>
#include <thread>
#include <tuple>

#include "kernels/blas.h"
#include "kernels/check.h"
#include "parallel/schedule.h"
#include "parallel/simulator.h"
#include "runtime/launch/job.h"
#include "runtime/machine/machine.h"
#include "runtime/model/model_spec.h"

namespace t3d::runtime {
namespace {

using parallel::ScheduleKind;

std::vector<int64_t> divisors(int64_t n) {
  std::vector<int64_t> out;
  for (int64_t d = 1; d <= n; ++d)
    if (n % d == 0) out.push_back(d);
  return out;
}

// Schedules depend only on (kind, pp, micro-batches, v); many layouts share one.
class ScheduleCache {
 public:
  const parallel::Schedule& get(const Layout& l) {
    const auto key =
        std::make_tuple(static_cast<int>(l.schedule), l.pp, l.micro_batches, l.virtual_stages);
    auto it = cache_.find(key);
    if (it == cache_.end())
      it = cache_.emplace(key, std::make_unique<parallel::Schedule>(make_layout_schedule(l))).first;
    return *it->second;
  }

 private:
  std::map<std::tuple<int, int64_t, int64_t, int64_t>, std::unique_ptr<parallel::Schedule>> cache_;
};

Candidate evaluate_with(const PlanProblem& p, const Layout& l, const parallel::Schedule& s) {
  Candidate c;
  c.layout = l;
  c.memory = peak_memory(p, l, s);
  c.fits = c.memory.total() <= p.cluster.hbm_gib * kGiB;
  if (c.fits) c.time = step_time(p, l, s);
  return c;
}

std::string pct(double part, double whole) {
  return fmt::format("{:.0f}%", whole > 0 ? 100 * part / whole : 0.0);
}

// The schedule column: the pipeline schedule, and expert parallelism when the layout has it.
std::string schedule_label(const Layout& l) {
  std::string s = l.pp == 1 ? "-" : std::string(parallel::to_string(l.schedule));
  if (l.pp > 1 && l.virtual_stages > 1 && l.schedule != parallel::ScheduleKind::kZBV)
    s += "×" + std::to_string(l.virtual_stages);  // zb_v: always 2
  if (l.ep > 1) s += " ep" + std::to_string(l.ep);
  return s;
}

}  // namespace

std::string thousands(double x) {
  if (x > 0 && x < 100) return fmt::format("{:.3g}", x);  // a slow device is not "0"
  const std::string digits = fmt::format("{:.0f}", x);
  std::string out;
  for (size_t i = 0; i < digits.size(); ++i) {
    if (i > 0 && (digits.size() - i) % 3 == 0) out += ',';
    out += digits[i];
  }
  return out;
}

std::string calibration_cache_path(const Recipe& r) {
  const auto& m = r.model;
  const std::string key = fmt::format(
      "{}|w{} pp{} dp{} tp{} sp{}|rows{} seq{}|dim{} h{} kv{} hd{} ffn{} V{}|{}|threads{}",
      host_name(), r.world_size(), r.parallel.pp, r.parallel.dp, r.parallel.tp,
      r.parallel.sequence_parallel, r.micro_batch_rows(), m.seq_len, m.dim, m.n_heads, m.n_kv_heads,
      m.head_dim(), m.ffn_dim, m.vocab_size, choice_name(r.train.precision),
      r.hardware.threads_per_rank);
  return fmt::format("{}/calibration-{:016x}.toml", cache_dir(), std::hash<std::string>{}(key));
}

PlanProblem make_problem(const Recipe& r, const Cluster& c) {
  PlanProblem p;
  p.model = r.model;
  p.global_batch = r.train.global_batch;
  p.bucket_mb = r.parallel.bucket_mb;
  p.precision = Precision::from_recipe(r.train.precision);
  p.cluster = c;
  p.snapshots = r.snapshot.every > 0;
  p.staging_gib = r.snapshot.staging_gib;
  p.replay_every = r.run.replay_every;
  return p;
}

std::vector<Layout> enumerate_layouts(const PlanProblem& p, const PlanSpace& space) {
  std::vector<Layout> out;
  const auto& m = p.model;
  const int64_t world = p.cluster.world();
  for (int64_t tp : divisors(p.cluster.devices_per_node)) {
    for (int64_t pp : divisors(m.n_layers)) {
      if (world % (tp * pp)) continue;
      const int64_t dp = world / (tp * pp);
      if (p.global_batch % dp) continue;
      for (int64_t mb : divisors(p.global_batch / dp)) {
        std::vector<std::pair<ScheduleKind, int64_t>> schedules = {{ScheduleKind::k1F1B, 1}};
        if (pp > 1) {
          schedules.push_back({ScheduleKind::kGPipe, 1});
          schedules.push_back({ScheduleKind::kZBH1, 1});
          schedules.push_back({ScheduleKind::kZBV, 2});
          for (int64_t v = 2; v <= space.max_virtual_stages; ++v)
            schedules.push_back({ScheduleKind::kInterleaved1F1B, v});
        }
        for (auto [kind, v] : schedules)
          for (int64_t zero : space.zero) {
            if (dp == 1 && zero > 0) continue;  // nothing to shard over
            for (int64_t ck : space.checkpoint)
              for (int64_t ep : m.moe() ? divisors(dp) : std::vector<int64_t>{1}) {
                Layout l{dp, tp, pp, mb, kind, v, zero, ck, ep};
                if (invalid_reason(p, l).empty()) out.push_back(l);
              }
          }
      }
    }
  }
  return out;
}

Candidate evaluate(const PlanProblem& p, const Layout& l) {
  const std::string why = invalid_reason(p, l);
  T3D_USER_CHECK(why.empty(), "plan: layout ", l.label(), " cannot run: ", why);
  return evaluate_with(p, l, make_layout_schedule(l));
}

Plan make_plan(const PlanProblem& p, const PlanSpace& space) {
  Plan plan;
  ScheduleCache schedules;
  std::map<std::tuple<int64_t, int64_t, int64_t>, Candidate> best;  // per mesh
  for (const Layout& l : enumerate_layouts(p, space)) {
    Candidate c = evaluate_with(p, l, schedules.get(l));
    ++plan.evaluated;
    auto key = std::make_tuple(-l.dp, l.tp, l.pp);
    auto it = best.find(key);
    const bool better =
        it == best.end() || (c.fits && !it->second.fits) ||
        (c.fits && it->second.fits &&
         c.time.tokens_per_s_per_device > it->second.time.tokens_per_s_per_device) ||
        (!c.fits && !it->second.fits && c.memory.total() < it->second.memory.total());
    if (better) best[key] = c;
    if (c.fits) plan.ranked.push_back(std::move(c));
  }
  std::stable_sort(plan.ranked.begin(), plan.ranked.end(), [](const auto& a, const auto& b) {
    if (a.time.tokens_per_s_per_device != b.time.tokens_per_s_per_device)
      return a.time.tokens_per_s_per_device > b.time.tokens_per_s_per_device;
    return a.memory.total() < b.memory.total();
  });
  for (auto& [key, c] : best) plan.meshes.push_back(c);
  return plan;
}

std::string format_ranked(const PlanProblem& p, const Plan& plan, int64_t top) {
  std::string out = fmt::format(
      "{} layouts evaluated, {} fit in {} GiB. Best {}:\n"
      "   #    dp  tp  pp  schedule             micro  zero  ckpt    memory  step     compute  tp  "
      "  "
      "dp    pp    bubble  tokens/s/device\n",
      plan.evaluated, plan.ranked.size(), p.cluster.hbm_gib,
      std::min<int64_t>(top, static_cast<int64_t>(plan.ranked.size())));
  out = moe_summary(p.model) + out;  // a mixture of experts' total and active parameters first
  for (int64_t i = 0; i < top && i < static_cast<int64_t>(plan.ranked.size()); ++i) {
    const Candidate& c = plan.ranked[static_cast<size_t>(i)];
    const Layout& l = c.layout;
    const StepTime& t = c.time;
    out += fmt::format(
        "{:>4}  {:>4}  {:>2}  {:>2}  {:<20} {:>5}  {:>4}  {:<6} {:>6.1f}  {:<8} {:>6} {:>5} {:>5} "
        "{:>5} {:>6}  {:>15}\n",
        i + 1, l.dp, l.tp, l.pp, schedule_label(l), l.micro_batches, l.zero, l.checkpoint_name(),
        c.memory.total() / kGiB, fmt::format("{:.3g} s", t.total), pct(t.compute, t.total),
        pct(t.tp + t.ep, t.total), pct(t.dp, t.total), pct(t.pp, t.total), pct(t.bubble, t.total),
        thousands(t.tokens_per_s_per_device));
  }
  out +=
      "memory in GiB per device (the stage needing most); compute .. bubble: shares of the "
      "step (tp: with expert parallelism's all-to-alls); micro: micro-batches per dp rank.\n";
  return out;
}

std::string format_meshes(const PlanProblem& p, const Plan& plan) {
  std::string out = fmt::format(
      "\nBy mesh (best layout of each dp × tp × pp; OOM: nothing fits in {} GiB):\n"
      "    dp  tp  pp  verdict  memory  tokens/s/device  layout\n",
      p.cluster.hbm_gib);
  for (const Candidate& c : plan.meshes) {
    const Layout& l = c.layout;
    out += fmt::format("  {:>4}  {:>2}  {:>2}  {:<7} {:>7.1f}  {:>15}  {}{}\n", l.dp, l.tp, l.pp,
                       c.fits ? "fits" : "OOM", c.memory.total() / kGiB,
                       c.fits ? thousands(c.time.tokens_per_s_per_device) : "-", l.label(),
                       c.fits ? "" : "  (least memory of any choice)");
  }
  return out;
}

std::string explain(const PlanProblem& p, const Layout& l) {
  const std::string why = invalid_reason(p, l);
  T3D_USER_CHECK(why.empty(), "plan: layout ", l.label(), " cannot run: ", why);
  const parallel::Schedule s = make_layout_schedule(l);
  std::ostringstream os;
  os << moe_summary(p.model);
  os << "Layout " << l.label() << ": " << micro_rows(p, l) << " sequence(s) of " << p.model.seq_len
     << " tokens per micro-batch\n";
  const Memory m = peak_memory(p, l, s, &os);
  os << (m.total() <= p.cluster.hbm_gib * kGiB ? "  fits\n" : "  OUT OF MEMORY\n");
  step_time(p, l, s, &os);
  return os.str();
}

RecipePlan plan_of_recipe(const Recipe& recipe) {
  RecipePlan p;
  p.cluster = local_cluster(recipe);
  p.problem = make_problem(recipe, p.cluster);
  p.layout = layout_of_recipe(recipe, p.cluster);
  p.schedule = make_layout_schedule(p.layout);
  return p;
}

std::optional<double> planned_rank_bytes(const Recipe& recipe) {
  if (recipe.parallel.cp > 1) return std::nullopt;
  const RecipePlan plan = plan_of_recipe(recipe);
  return peak_memory(plan.problem, plan.layout, plan.schedule).total();
}

Layout layout_of_recipe(const Recipe& r, const Cluster& c) {
  Layout l;
  l.tp = r.parallel.tp;
  l.pp = r.parallel.pp;
  l.cp = r.parallel.cp;
  l.dp = r.parallel.dp;
  if (l.dp == -1) {
    T3D_USER_CHECK(c.world() % (l.tp * l.pp * l.cp) == 0, "plan: the cluster's ", c.world(),
                   " devices are not divisible by the recipe's pp·cp·tp = ", l.pp * l.cp * l.tp);
    l.dp = c.world() / (l.tp * l.pp * l.cp);
  }
  l.micro_batches = r.train.micro_batches;
  l.schedule = r.parallel.schedule;
  l.virtual_stages = r.parallel.virtual_stages;
  l.zero = r.parallel.zero;
  l.checkpoint_every = r.train.activation_checkpoint.every;
  l.ep = r.parallel.ep;
  return l;
}

Recipe recipe_with_layout(const Recipe& recipe, const Layout& l, const Cluster& c) {
  Recipe r = recipe;
  l.write_into(r.parallel, r.train);
  r.hardware.hbm_gib = c.hbm_gib;
  return parse_recipe(r.to_toml(), "<plan>");  // validates the combination
}

Cluster local_cluster(const Recipe& r, bool* calibrated) {
  const std::string cached = calibration_cache_path(r);
  const bool have = std::filesystem::is_regular_file(cached);
  if (calibrated) *calibrated = have;
  if (have) {
    Cluster c = load_cluster(cached);
    c.hbm_gib = r.hardware.hbm_gib;  // the recipe's budget, not the one calibrated under
    return c;
  }
  Cluster c;
  c.name = "this machine (one node)";
  c.source = "<local>";
  c.nodes = 1;
  c.devices_per_node = r.world_size();
  c.hbm_gib = r.hardware.hbm_gib;
  // Guesses: OpenBLAS with the SkylakeX kernels reached about 160 of an FMA peak of about 180
  // GFLOP/s per core on a 2-vCPU AVX-512 Xeon; one core per rank. Shared-memory MPI bandwidth is a
  // guess. Both are far from what training reaches at small shapes (docs/planner.md,
  // "Calibration").
  c.peak_tflops = 0.18;
  c.compute_efficiency = 160.0 / 180.0;
  // More ranks than cores share them: each "device" gets its share of a core.
  const double cores = std::max(1u, std::thread::hardware_concurrency());
  c.peak_tflops *= std::min(1.0, cores / static_cast<double>(c.devices_per_node));
  c.intra_node_gbps = 5.0;
  c.inter_node_gbps = 5.0;
  c.intra_node_latency_us = c.inter_node_latency_us = 2.0;
  return c;
}

std::string moe_summary(const ModelConfig& m) {
  if (!m.moe()) return "";
  double total = 0, experts = 0, routers = 0;
  for (const ParamInfo& p : param_table(m)) {
    double n = 1;
    for (const int64_t d : p.global_shape) n *= static_cast<double>(d);
    total += n;
    if (p.expert >= 0) experts += n;
    if (p.name.find("mlp.router.weight") != std::string::npos) routers += n;
  }
  const double active_share =
      static_cast<double>(m.experts_per_token) / static_cast<double>(m.n_experts);
  const double active = total - experts * (1 - active_share);
  return fmt::format(
      "Mixture of experts: {} parameters in all, {} active per token ({} of {} routed experts, "
      "{} shared); the routed experts hold {} ({:.0f}%), in memory on every rank of their "
      "stage (tp splits them); training FLOPs per token {} (the active path), {} of them the "
      "routers'\n",
      thousands(total), thousands(active), m.experts_per_token, m.n_experts, m.n_shared_experts,
      thousands(experts), 100 * experts / total, thousands(model_train_flops_per_token(m)),
      thousands(6 * routers));
}

}  // namespace t3d::runtime
