// The planner's cost model: per-rank memory and step time of one training layout on a cluster.
// Every formula, its source and its assumptions are in docs/planner.md.
//
// Memory sums the model spec table (runtime/model/model_spec.h) that runtime::Model allocates
// from, so for precision fp32 it is the arena's footprint exactly (tested in tests/cost); bf16
// is priced as an accelerator keeps it (ActivationStorage::kBf16). Time is compute at an
// efficiency of the peak, ring collectives over the node's links, and the pipeline bubble from
// the schedule simulator (parallel/simulator.h) run on the very schedule table the executor would
// run.
#pragma once

#include <cstdint>
#include <ostream>
#include <string>
#include <vector>

#include "parallel/schedule.h"
#include "parallel/simulator.h"
#include "runtime/cost/cluster.h"
#include "runtime/recipe/recipe.h"

namespace t3d::runtime {

// Bytes per element of each kind of training state.
struct Precision {
  double weight = 4, grad = 4, master = 0, moment = 4, activation = 4;
  // "fp32": everything fp32 (the arena today). "bf16": bf16 weights, gradients and activations;
  // fp32 master weights and AdamW moments: 2 + 2 + 4 + 4 + 4 = 16 bytes per parameter.
  static Precision from_recipe(TrainPrecision precision);
  double optimizer() const { return master + 2 * moment; }  // per parameter
};

// One point of the search space: a mesh and how a step runs on it.
struct Layout {
  int64_t dp = 1, tp = 1, pp = 1;
  int64_t micro_batches = 1;  // per dp rank and step
  parallel::ScheduleKind schedule = parallel::ScheduleKind::k1F1B;
  int64_t virtual_stages = 1;
  int64_t zero = 0;              // ZeRO stage 0..3
  int64_t checkpoint_every = 0;  // 0 none; 1 full; K: every K-th layer of a chunk recomputed
  // Expert-parallel ranks (a mixture of experts; parallel.ep): carved out of dp × cp, each
  // holding n_experts / ep of every MoE block's routed experts.
  int64_t ep = 1;
  // Context-parallel ranks (parallel.cp): the search keeps 1, and the cost model prices a layout
  // as if it were 1 (docs/planner.md); a recipe's own layout carries it for the rule and the
  // rank count.
  int64_t cp = 1;

  std::string checkpoint_name() const;  // the recipe's spelling: none | full | every:K
  // "dp8 tp4 pp2 1f1b m8 z0 ckpt:full" (" ep2" with EP, " cp2" with CP)
  std::string label() const;
  int64_t world() const { return dp * cp * tp * pp; }
  // The recipe keys the layout sets: parallel's pp, dp, cp, tp, ep, schedule, virtual_stages,
  // zero (pipeline_split cleared: balanced), train's micro_batches and activation_checkpoint.
  void write_into(ParallelConfig& parallel, TrainConfig& train) const;
};

// What stays fixed while layouts vary.
struct PlanProblem {
  ModelConfig model;
  int64_t global_batch = 1;  // sequences per optimizer step
  double bucket_mb = 4.0;    // parallel.bucket_mb: ZeRO-2's staging buffers hold the largest bucket
  Precision precision;
  Cluster cluster;
  bool snapshots = false;    // snapshot.every > 0
  double staging_gib = 0;    // snapshot.staging_gib
  int64_t replay_every = 0;  // run.replay_every: every N-th step replays the pipeline's pass
};

// "" when `layout` can run `problem`, else why not (for --explain of a recipe's own layout):
// the cluster's facts (its device count, a node holding a tp group), then the one rule of
// recipe validation, layout_problem (runtime/recipe/recipe.h), as "key: reason".
std::string invalid_reason(const PlanProblem& problem, const Layout& layout);

// Sequences per micro-batch: global_batch / (dp · micro_batches).
int64_t micro_rows(const PlanProblem& problem, const Layout& layout);

// The schedule table for the layout (pp = 1 gives the plain gradient-accumulation loop).
parallel::Schedule make_layout_schedule(const Layout& layout);

// Per-rank memory of one pipeline stage, in bytes.
struct Memory {
  int64_t stage = 0;
  int64_t slots = 0;  // micro-batches whose activations are alive at once, per chunk (largest)
  std::vector<int64_t> chunk_slots;  // the same per chunk of the stage, in model order
  double params = 0, grads = 0, optimizer = 0, activations = 0, workspace = 0;
  double total() const { return params + grads + optimizer + activations + workspace; }
  // Host memory (not the device's) a rank stages its snapshot in: checkpoint::staging_bytes.
  double snapshot_staging = 0;
};

// `schedule` must be make_layout_schedule(layout). `why`, when given, receives the arithmetic.
Memory stage_memory(const PlanProblem& problem, const Layout& layout,
                    const parallel::Schedule& schedule, int64_t stage, std::ostream* why = nullptr);
// The stage needing the most memory (every rank of a stage needs the same).
Memory peak_memory(const PlanProblem& problem, const Layout& layout,
                   const parallel::Schedule& schedule, std::ostream* why = nullptr);

// Micro-batches in flight per chunk of `stage`, the largest over its chunks: the `slots` the
// model allocates for every chunk it holds (runtime::ModelOptions::slots).
int64_t activation_slots(const parallel::Schedule& schedule, int64_t stage);
// Per chunk of `stage`, in model order (runtime::ModelOptions::chunk_slots): the model allocates
// exactly these, so ZB-V's unequal chunks cost their sum, not twice the larger.
std::vector<int64_t> chunk_activation_slots(const parallel::Schedule& schedule, int64_t stage);

// Seconds per optimizer step, split into parts that add up to `total`.
struct StepTime {
  parallel::Costs costs;  // per micro-batch on the slowest stage, as fed to the simulator
  double compute = 0;     // FLOPs at peak · efficiency, recomputation included
  double tp = 0;          // tensor-parallel all-reduces (on the critical path: not overlapped)
  double ep = 0;          // expert parallelism's all-to-alls (on the critical path too)
  double dp = 0;          // data-parallel gradient sync not hidden behind backward
  double pp = 0;          // point-to-point transfers: makespan with them minus without
  double bubble = 0;      // pipeline idle time: makespan without transfers minus busy time
  // run.replay_every = N: a replica replays a peer's pass every N steps (runtime/train/replay.h),
  // one more makespan (its reduction is local), per step; its hashing is not priced.
  double replay = 0;
  double total = 0;
  double bubble_fraction = 0;  // the simulator's, with transfers
  double tokens_per_s_per_device = 0;
};

// The data-parallel sync of one step's gradients (reduce-scatter) and weights (all-gather) per
// state group, as TrainingState runs them: the dense parameters over dp (stride tp), a mixture of
// experts' routed experts over the dp/ep ranks holding the same ones (stride tp·ep); for the
// stage whose sync takes longest. Seconds of one ring pass each, before ZeRO's repetitions.
struct DpSync {
  double elems = 0;  // that stage's parameter elements, both groups
  double reduce_scatter_s = 0, all_gather_s = 0;
};
DpSync dp_sync(const PlanProblem& problem, const Layout& layout);

StepTime step_time(const PlanProblem& problem, const Layout& layout,
                   const parallel::Schedule& schedule, std::ostream* why = nullptr);

// The per-micro-batch stage costs the simulator is fed, also for `plan --schedule`.
parallel::Costs stage_costs(const PlanProblem& problem, const Layout& layout);

// Ring collectives over a group of `size` ranks at stride `stride` (ranks r, r + stride, ...),
// with the link the group's placement on the cluster gives (docs/planner.md, "Links").
struct Link {
  double bytes_per_s = 0, latency_s = 0;
  bool inter_node = false;
};
Link group_link(const Cluster& cluster, int64_t stride, int64_t size);
double ring_all_reduce_s(double bytes, int64_t size, const Link& link);
double ring_reduce_scatter_s(double bytes, int64_t size, const Link& link);  // = all-gather
double p2p_s(double bytes, const Link& link);

}  // namespace t3d::runtime
