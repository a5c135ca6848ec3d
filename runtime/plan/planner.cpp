#include "runtime/plan/planner.h"

#include <spdlog/fmt/fmt.h>

#include <algorithm>
#include <thread>
#include <cstdio>
#include <filesystem>
#include <fstream>
#include <map>
#include <memory>
#include <sstream>
#include <tuple>

#include "kernels/blas.h"
#include "kernels/check.h"
#include "parallel/schedule.h"
#include "parallel/simulator.h"
#include "runtime/plan/calibrate.h"
#include "runtime/launch/job.h"
#include "runtime/machine/gemm_choice.h"

namespace t3d::runtime {
namespace {

using parallel::ScheduleKind;

constexpr double kGiB = 1024.0 * 1024.0 * 1024.0;

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

std::string schedule_label(const Layout& l) {
  if (l.pp == 1) return "-";
  std::string s(parallel::to_string(l.schedule));
  if (l.virtual_stages > 1 && l.schedule != parallel::ScheduleKind::kZBV)  // zb_v: always 2
    s += "×" + std::to_string(l.virtual_stages);
  return s;
}

}  // namespace

PlanProblem make_problem(const Recipe& r, const Cluster& c) {
  PlanProblem p;
  p.model = r.model;
  p.global_batch = r.train.global_batch;
  p.bucket_mb = r.parallel.bucket_mb;
  p.precision = Precision::from_recipe(r.train.precision);
  p.cluster = c;
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
            for (int64_t ck : space.checkpoint) {
              Layout l{dp, tp, pp, mb, kind, v, zero, ck};
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
  for (int64_t i = 0; i < top && i < static_cast<int64_t>(plan.ranked.size()); ++i) {
    const Candidate& c = plan.ranked[static_cast<size_t>(i)];
    const Layout& l = c.layout;
    const StepTime& t = c.time;
    out += fmt::format(
        "{:>4}  {:>4}  {:>2}  {:>2}  {:<20} {:>5}  {:>4}  {:<6} {:>6.1f}  {:<8} {:>6} {:>5} {:>5} "
        "{:>5} {:>6}  {:>15}\n",
        i + 1, l.dp, l.tp, l.pp, schedule_label(l), l.micro_batches, l.zero, l.checkpoint_name(),
        c.memory.total() / kGiB, fmt::format("{:.3g} s", t.total), pct(t.compute, t.total),
        pct(t.tp, t.total), pct(t.dp, t.total), pct(t.pp, t.total), pct(t.bubble, t.total),
        thousands(t.tokens_per_s_per_device));
  }
  out +=
      "memory in GiB per device (the stage needing most); compute .. bubble: shares of the "
      "step; micro: micro-batches per dp rank.\n";
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

Layout layout_of_recipe(const Recipe& r, const Cluster& c) {
  Layout l;
  l.tp = r.parallel.tp;
  l.pp = r.parallel.pp;
  l.dp = r.parallel.dp;
  if (l.dp == -1) {
    T3D_USER_CHECK(c.world() % (l.tp * l.pp) == 0, "plan: the cluster's ", c.world(),
                   " devices are not divisible by the recipe's pp·tp = ", l.pp * l.tp);
    l.dp = c.world() / (l.tp * l.pp);
  }
  l.micro_batches = r.train.micro_batches;
  l.schedule = r.parallel.schedule;
  l.virtual_stages = r.parallel.virtual_stages;
  l.zero = r.parallel.zero;
  l.checkpoint_every = r.train.activation_checkpoint.every;
  return l;
}

Recipe recipe_with_layout(const Recipe& recipe, const Layout& l, const Cluster& c) {
  Recipe r = recipe;
  r.parallel.dp = l.dp;
  r.parallel.tp = l.tp;
  r.parallel.pp = l.pp;
  r.parallel.schedule = l.schedule;
  r.parallel.virtual_stages = l.virtual_stages;
  r.parallel.pipeline_split.clear();
  r.parallel.zero = l.zero;
  r.train.micro_batches = l.micro_batches;
  r.train.activation_checkpoint = {l.checkpoint_every};
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
  // GFLOP/s per core on a 2-vCPU AVX-512 Xeon; one core per rank. Shared-memory MPI bandwidth is a guess. Both are far
  // from what training reaches at small shapes (docs/planner.md, "Calibration").
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

int run_plan(const PlanOptions& o) {
  const Recipe recipe = load_recipe(o.recipe, o.overrides);
  if (!o.calibrate_probe.empty()) {  // a rank of `plan --calibrate`'s probe (calibrate.h)
    MpiRuntime mpi;
    Job job = join_world(recipe, "", /*needs_data=*/false);
    job.set_precision(recorded_precision(job.recipe));  // the probe measures no GEMM choice
    run_calibration_probe(job, o.calibrate_probe);
    return 0;
  }
  if (o.calibrate && o.cluster.empty()) {
    const Cluster before = local_cluster(recipe);
    const Cluster after = calibrate_local(recipe, o.argv);
    std::printf(
        "calibrate: %lld rank(s) here: %.4g GFLOP/s per rank (one block fwd+bwd, all ranks at "
        "once; was %.4g), MPI %.4g GB/s and %.4g us per message (was %.4g, %.4g); cached in %s\n",
        (long long)after.devices_per_node, after.peak_tflops * after.compute_efficiency * 1e3,
        before.peak_tflops * before.compute_efficiency * 1e3, after.intra_node_gbps,
        after.intra_node_latency_us, before.intra_node_gbps, before.intra_node_latency_us,
        calibration_cache_path(recipe).c_str());
  }
  bool calibrated = false;
  // --cluster, else the recipe's hardware.cluster, else this machine.
  const std::string cluster_file = !o.cluster.empty() ? o.cluster : recipe.hardware.cluster;
  const Cluster cluster =
      cluster_file.empty() ? local_cluster(recipe, &calibrated) : load_cluster(cluster_file);
  const double cores = std::max(1u, std::thread::hardware_concurrency());
  if (cluster_file.empty() && recipe.world_size() > 4 * cores)
    std::printf("plan: the recipe's %lld ranks on this machine's %.0f cores (each a share of a "
                "core): is it meant for a cluster? Give --cluster FILE or set hardware.cluster "
                "(recipes/clusters/)\n",
                static_cast<long long>(recipe.world_size()), cores);
  const PlanProblem p = make_problem(recipe, cluster);
  const auto& m = p.model;
  std::printf(
      "model: dim %lld, %lld layers, %lld heads (%lld kv), ffn %lld, vocab %lld, seq %lld; "
      "global batch %lld; precision %s\n"
      "cluster: %s: %lld nodes × %lld devices, %.0f GiB, %.4g TFLOP/s × %.2f, "
      "%.4g GB/s inside a node, %.4g GB/s per node between nodes\n",
      (long long)m.dim, (long long)m.n_layers, (long long)m.n_heads, (long long)m.n_kv_heads,
      (long long)m.ffn_dim, (long long)m.vocab_size, (long long)m.seq_len,
      (long long)p.global_batch, std::string(choice_name(recipe.train.precision)).c_str(), cluster.name.c_str(),
      (long long)cluster.nodes, (long long)cluster.devices_per_node, cluster.hbm_gib,
      cluster.peak_tflops, cluster.compute_efficiency, cluster.intra_node_gbps,
      cluster.inter_node_gbps);
  if (calibrated)
    std::printf("calibration: %s (measured for the recipe's own layout; `--calibrate` "
                "re-measures)\n",
                calibration_cache_path(recipe).c_str());
  if (o.calibrate && !o.cluster.empty()) {
    const int threads = recipe.hardware.threads_per_rank > 0
                            ? static_cast<int>(recipe.hardware.threads_per_rank)
                            : 1;
    std::printf("calibrate: sgemm 1024³ here: %.1f GFLOP/s with %d thread(s); the cluster "
                "file's figures are used as given\n",
                kernels::measure_sgemm_gflops(1024, 1024, 1024, threads), threads);
  }

  if (o.schedule) {
    const Layout l = layout_of_recipe(recipe, cluster);
    const std::string why = invalid_reason(p, l);
    T3D_USER_CHECK(why.empty(), "plan --schedule: the recipe's layout ", l.label(),
                   " cannot run on this cluster: ", why);
    const parallel::Schedule s = make_layout_schedule(l);
    const parallel::Costs costs = stage_costs(p, l);
    const parallel::Timeline t = parallel::simulate(s, costs);
    std::printf("\n%s: per micro-batch f %.4g s, b %.4g s, w %.4g s, transfer %.4g s\n%s\n%s",
                l.label().c_str(), costs.f, costs.b, costs.w, costs.comm,
                parallel::render_text(t).c_str(),
                parallel::format_summary(parallel::summarize(s, costs)).c_str());
    if (!o.svg.empty()) {
      parallel::write_svg(t, o.svg);
      std::printf("timeline drawn in %s\n", o.svg.c_str());
    }
    return 0;
  }

  PlanSpace space;
  if (!o.zero.empty()) {
    for (int64_t z : o.zero)
      T3D_USER_CHECK(z >= 0 && z <= 3, "plan: --zero ", z, " is not a ZeRO stage (0..3)");
    space.zero = o.zero;
  }
  const Plan plan = make_plan(p, space);
  std::printf("\n%s%s", format_ranked(p, plan, o.top).c_str(), format_meshes(p, plan).c_str());

  const Layout own = layout_of_recipe(recipe, cluster);
  if (recipe.parallel.cp > 1)
    std::printf("\nThe recipe has parallel.cp = %lld: the planner does not model context "
                "parallelism yet and plans, and compares with, cp = 1.\n",
                static_cast<long long>(recipe.parallel.cp));
  const std::string own_invalid = invalid_reason(p, own);
  if (own_invalid.empty()) {
    const Candidate c = evaluate(p, own);
    auto it = std::find_if(plan.ranked.begin(), plan.ranked.end(),
                           [&](const Candidate& x) { return x.layout.label() == own.label(); });
    std::printf("\nThe recipe's own layout %s: %s\n", own.label().c_str(),
                !c.fits ? fmt::format("OOM ({:.1f} GiB)", c.memory.total() / kGiB).c_str()
                : it != plan.ranked.end()
                    ? fmt::format("rank {} of {}, {} tokens/s/device", it - plan.ranked.begin() + 1,
                                  plan.ranked.size(), thousands(c.time.tokens_per_s_per_device))
                          .c_str()
                    : fmt::format("{} tokens/s/device (outside the searched space)",
                                  thousands(c.time.tokens_per_s_per_device))
                          .c_str());
  } else {
    std::printf("\nThe recipe's own layout %s cannot run here: %s\n", own.label().c_str(),
                own_invalid.c_str());
  }

  if (o.explain >= 0) {
    T3D_USER_CHECK(o.explain <= static_cast<int64_t>(plan.ranked.size()), "plan: --explain ",
                   o.explain, ": the table has ", plan.ranked.size(),
                   " fitting layouts (0 explains the recipe's own)");
    const Layout l = o.explain == 0 ? own : plan.ranked[static_cast<size_t>(o.explain - 1)].layout;
    std::printf("\n%s", explain(p, l).c_str());
  }

  if (!o.write_recipe.empty()) {
    T3D_USER_CHECK(!plan.ranked.empty(), "plan: no layout fits in ", cluster.hbm_gib,
                   " GiB per device; nothing to write to ", o.write_recipe);
    const Recipe best = recipe_with_layout(recipe, plan.ranked.front().layout, cluster);
    std::ofstream f(o.write_recipe);
    T3D_USER_CHECK(f.good(), "plan: cannot write ", o.write_recipe);
    f << "# Written by `titan3d plan` for " << cluster.name << ": "
      << plan.ranked.front().layout.label() << "\n"
      << best.to_toml();
    T3D_USER_CHECK(f.good(), "plan: writing ", o.write_recipe, " failed");
    std::printf("\nwrote the best layout as a recipe: %s\n", o.write_recipe.c_str());
  }
  return 0;
}

}  // namespace t3d::runtime
