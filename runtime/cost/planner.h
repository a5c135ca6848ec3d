// The planner as a pure library (no MPI; the `plan` verb and its calibration probe are in
// runtime/plan/): enumerate every valid (dp, tp, pp, micro-batches, schedule, ZeRO stage,
// activation checkpointing) for a model on a cluster, price each with the cost model
// (runtime/cost/planner_cost.h), and rank them. The table, the per-mesh verdicts, the arithmetic of
// one layout (--explain), its simulated timeline (--schedule) and a ready recipe for the best
// (--write-recipe) all come from here; the end-of-run table and selfcheck read the recipe's own
// plan.
#pragma once

#include <cstdint>
#include <optional>
#include <string>
#include <vector>

#include "runtime/cost/cluster.h"
#include "runtime/cost/planner_cost.h"
#include "runtime/recipe/recipe.h"

namespace t3d::runtime {

// Which values the search tries beyond the mesh and micro-batch count.
struct PlanSpace {
  // ZeRO-3 only on request (--zero 0,1,2,3): its blocking gathers trade step time for memory,
  // so it is worth searching when nothing else fits.
  std::vector<int64_t> zero = {0, 1, 2};
  std::vector<int64_t> checkpoint = {0, 1};  // 0 none, 1 full, K every:K
  int64_t max_virtual_stages = 4;            // interleaved_1f1b tries v = 2 .. this
};

struct Candidate {
  Layout layout;
  Memory memory;
  bool fits = false;
  StepTime time;  // filled only when it fits
};

struct Plan {
  std::vector<Candidate> ranked;  // every layout that fits, highest tokens/s/device first
  // One row per mesh (dp, tp, pp), largest dp first: its best fitting layout, or when none fits
  // the one needing the least memory (fits = false).
  std::vector<Candidate> meshes;
  int64_t evaluated = 0;
};

PlanProblem make_problem(const Recipe& recipe, const Cluster& cluster);

// Every valid layout: tp divides a node and the heads, pp divides the layers, dp = world/(tp·pp)
// divides the global batch, micro-batches divide each dp rank's share; per pp > 1 every schedule
// (interleaved with v dividing the layers per stage); every ZeRO stage and checkpointing choice;
// for a mixture of experts every ep dividing dp and n_experts.
std::vector<Layout> enumerate_layouts(const PlanProblem& problem, const PlanSpace& space);

// Memory first; the simulator runs only for layouts that fit.
Candidate evaluate(const PlanProblem& problem, const Layout& layout);
Plan make_plan(const PlanProblem& problem, const PlanSpace& space);

std::string format_ranked(const PlanProblem& problem, const Plan& plan, int64_t top);
std::string format_meshes(const PlanProblem& problem, const Plan& plan);
// The memory and time arithmetic of one layout, line by line.
std::string explain(const PlanProblem& problem, const Layout& layout);

// The recipe's own layout on the cluster (dp = -1 is the rest of the cluster).
Layout layout_of_recipe(const Recipe& recipe, const Cluster& cluster);
// The recipe with its parallel / train / hardware keys set to `layout`, validated.
Recipe recipe_with_layout(const Recipe& recipe, const Layout& layout, const Cluster& cluster);

// A one-node cluster of the recipe's world on this machine, for `plan` without --cluster: the
// cached calibration of the recipe's shape (calibrate.h) when there is one, else guesses
// (160 GFLOP/s per core shared among the ranks, 5 GB/s and 2 µs for MPI).
// `calibrated` says which.
Cluster local_cluster(const Recipe& recipe, bool* calibrated = nullptr);

// The planner's view of the recipe as it runs here (local_cluster, its own layout and schedule):
// what the end-of-run table and selfcheck compare measurements with.
struct RecipePlan {
  Cluster cluster;
  PlanProblem problem;
  Layout layout;
  parallel::Schedule schedule;
};
RecipePlan plan_of_recipe(const Recipe& recipe);

// The device bytes one rank of `recipe`'s own layout needs: peak_memory (its largest pipeline
// stage) of plan_of_recipe, the figure selfcheck's memory check holds against hardware.hbm_gib.
// nullopt with cp > 1, which the cost model would price as cp = 1 (docs/planner.md). The elastic
// shrink asks it through apps/ (runtime/supervise/elastic.h).
std::optional<double> planned_rank_bytes(const Recipe& recipe);

// Where the calibration of `recipe`'s shape on this machine is cached:
// <cache_dir()>/calibration-<hash>.toml (runtime/machine/machine.h). The hash covers the host,
// the world and its mesh, the micro-batch shape, the model's sizes, precision and BLAS threads:
// everything the measured numbers depend on.
std::string calibration_cache_path(const Recipe& recipe);

// A mixture of experts as the planner prices it (docs/planner.md): its parameters in all and
// those one token uses (the K of E routed experts), the experts' share, the training FLOPs per
// token of that active path and the routers' part of them. Empty for a dense model.
std::string moe_summary(const ModelConfig& model);

// 1234567 as "1,234,567": the tables' numbers.
std::string thousands(double x);

}  // namespace t3d::runtime
