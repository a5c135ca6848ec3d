#include "runtime/plan/plan_verb.h"

#include <spdlog/fmt/fmt.h>

#include <algorithm>
#include <cstdio>
#include <fstream>
#include <thread>

#include "kernels/blas.h"
#include "kernels/check.h"
#include "parallel/simulator.h"
#include "runtime/cost/planner.h"
#include "runtime/launch/job.h"
#include "runtime/machine/gemm_choice.h"
#include "runtime/plan/calibrate.h"

namespace t3d::runtime {

namespace {

// `--calibrate` without --cluster: measure this machine with the recipe's ranks (cached), and say
// what changed.
void calibrate_here(const Recipe& recipe, const PlanOptions& o) {
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

// The model and the cluster the plan is for, and where the cluster's figures come from.
void print_problem(const Recipe& recipe, const PlanProblem& p, const Cluster& cluster,
                   bool calibrated, const PlanOptions& o) {
  const auto& m = p.model;
  std::printf(
      "model: dim %lld, %lld layers, %lld heads (%lld kv), ffn %lld, vocab %lld, seq %lld; "
      "global batch %lld; precision %s\n"
      "cluster: %s: %lld nodes × %lld devices, %.0f GiB, %.4g TFLOP/s × %.2f, "
      "%.4g GB/s inside a node, %.4g GB/s per node between nodes\n",
      (long long)m.dim, (long long)m.n_layers, (long long)m.n_heads, (long long)m.n_kv_heads,
      (long long)m.ffn_dim, (long long)m.vocab_size, (long long)m.seq_len,
      (long long)p.global_batch, std::string(choice_name(recipe.train.precision)).c_str(),
      cluster.name.c_str(), (long long)cluster.nodes, (long long)cluster.devices_per_node,
      cluster.hbm_gib, cluster.peak_tflops, cluster.compute_efficiency, cluster.intra_node_gbps,
      cluster.inter_node_gbps);
  if (calibrated)
    std::printf(
        "calibration: %s (measured for the recipe's own layout; `--calibrate` "
        "re-measures)\n",
        calibration_cache_path(recipe).c_str());
  if (o.calibrate && !o.cluster.empty()) {
    const int threads = recipe.hardware.threads_per_rank > 0
                            ? static_cast<int>(recipe.hardware.threads_per_rank)
                            : 1;
    std::printf(
        "calibrate: sgemm 1024³ here: %.1f GFLOP/s with %d thread(s); the cluster "
        "file's figures are used as given\n",
        kernels::measure_sgemm_gflops(1024, 1024, 1024, threads), threads);
  }
}

void say_cp_not_modelled(const Recipe& recipe) {
  if (recipe.parallel.cp > 1)
    std::printf(
        "\nThe recipe has parallel.cp = %lld: the planner does not model context "
        "parallelism yet; it searches cp = 1 and prices the recipe's own layout as if cp were "
        "1.\n",
        static_cast<long long>(recipe.parallel.cp));
}

// `--schedule`: the recipe's own layout simulated, as a timeline and a summary (and an SVG).
void print_own_schedule(const Recipe& recipe, const PlanProblem& p, const Cluster& cluster,
                        const std::string& svg) {
  const Layout l = layout_of_recipe(recipe, cluster);
  const std::string why = invalid_reason(p, l);
  T3D_USER_CHECK(why.empty(), "plan --schedule: the recipe's layout ", l.label(),
                 " cannot run on this cluster: ", why);
  say_cp_not_modelled(recipe);
  const parallel::Schedule s = make_layout_schedule(l);
  const parallel::Costs costs = stage_costs(p, l);
  const parallel::Timeline t = parallel::simulate(s, costs);
  std::printf("\n%s: per micro-batch f %.4g s, b %.4g s, w %.4g s, transfer %.4g s\n%s\n%s",
              l.label().c_str(), costs.f, costs.b, costs.w, costs.comm,
              parallel::render_text(t).c_str(),
              parallel::format_summary(parallel::summarize(s, costs)).c_str());
  if (!svg.empty()) {
    parallel::write_svg(t, svg);
    std::printf("timeline drawn in %s\n", svg.c_str());
  }
}

// Where the recipe's own layout stands in the ranked plan: its rank, OOM, outside the searched
// space, or why it cannot run here.
void print_own_layout(const Recipe& recipe, const PlanProblem& p, const Plan& plan,
                      const Layout& own) {
  say_cp_not_modelled(recipe);
  const std::string own_invalid = invalid_reason(p, own);
  if (!own_invalid.empty()) {
    std::printf("\nThe recipe's own layout %s cannot run here: %s\n", own.label().c_str(),
                own_invalid.c_str());
    return;
  }
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
}

// `--write-recipe`: the recipe with the best layout.
void write_best_recipe(const Recipe& recipe, const Plan& plan, const Cluster& cluster,
                       const std::string& path) {
  T3D_USER_CHECK(!plan.ranked.empty(), "plan: no layout fits in ", cluster.hbm_gib,
                 " GiB per device; nothing to write to ", path);
  const Recipe best = recipe_with_layout(recipe, plan.ranked.front().layout, cluster);
  std::ofstream f(path);
  T3D_USER_CHECK(f.good(), "plan: cannot write ", path);
  f << "# Written by `titan3d plan` for " << cluster.name << ": "
    << plan.ranked.front().layout.label() << "\n"
    << best.to_toml();
  T3D_USER_CHECK(f.good(), "plan: writing ", path, " failed");
  std::printf("\nwrote the best layout as a recipe: %s\n", path.c_str());
}

}  // namespace

int run_plan(const PlanOptions& o) {
  const Recipe recipe = load_recipe(o.recipe, o.overrides);
  if (!o.calibrate_probe.empty()) {  // a rank of `plan --calibrate`'s probe (calibrate.h)
    MpiRuntime mpi;
    Job job = join_world(recipe, "", /*needs_data=*/false);
    job.set_precision(recorded_precision(job.recipe));  // the probe measures no GEMM choice
    run_calibration_probe(job, o.calibrate_probe);
    return 0;
  }
  if (o.calibrate && o.cluster.empty()) calibrate_here(recipe, o);
  bool calibrated = false;
  // --cluster, else the recipe's hardware.cluster, else this machine.
  const std::string cluster_file = !o.cluster.empty() ? o.cluster : recipe.hardware.cluster;
  const Cluster cluster =
      cluster_file.empty() ? local_cluster(recipe, &calibrated) : load_cluster(cluster_file);
  const double cores = std::max(1u, std::thread::hardware_concurrency());
  if (cluster_file.empty() && recipe.world_size() > 4 * cores)
    std::printf(
        "plan: the recipe's %lld ranks on this machine's %.0f cores (each a share of a "
        "core): is it meant for a cluster? Give --cluster FILE or set hardware.cluster "
        "(recipes/clusters/)\n",
        static_cast<long long>(recipe.world_size()), cores);
  const PlanProblem p = make_problem(recipe, cluster);
  print_problem(recipe, p, cluster, calibrated, o);
  if (o.schedule) {
    print_own_schedule(recipe, p, cluster, o.svg);
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
  print_own_layout(recipe, p, plan, own);
  if (o.explain >= 0) {
    T3D_USER_CHECK(o.explain <= static_cast<int64_t>(plan.ranked.size()), "plan: --explain ",
                   o.explain, ": the table has ", plan.ranked.size(),
                   " fitting layouts (0 explains the recipe's own)");
    const Layout l = o.explain == 0 ? own : plan.ranked[static_cast<size_t>(o.explain - 1)].layout;
    std::printf("\n%s", explain(p, l).c_str());
  }
  if (!o.write_recipe.empty()) write_best_recipe(recipe, plan, cluster, o.write_recipe);
  return 0;
}

}  // namespace t3d::runtime
