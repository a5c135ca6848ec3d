// The planner's memory model is the arena's: for fp32, with or without checkpointing, every
// region the real runtime::Model takes from its arena (parameters, gradients, AdamW moments,
// activation slots, scratch) has exactly the bytes the planner predicts. Two ranks: tp = 1 (each
// rank alone) and tp = 2 (both), for first, middle and last pipeline stages.
#include <gtest/gtest.h>
#include <mpi.h>

#include "kernels/arena.h"
#include "parallel/comm.h"
#include "parallel/pipeline_split.h"
#include "parallel/zero.h"
#include "runtime/cost/planner_cost.h"
#include "runtime/model/model.h"
#include "runtime/stage/stage.h"
#include "runtime/train/sharded_state.h"

namespace t3d::runtime {
namespace {

ModelConfig small_model() {
  return ModelConfig{.vocab_size = 96,
                     .dim = 64,
                     .n_layers = 6,
                     .n_heads = 4,
                     .n_kv_heads = 2,
                     .ffn_dim = 176,
                     .seq_len = 32};
}

// The slots the planner predicts for a stage, as the executor would give them to the Model.
ModelOptions predicted_options(const PlanProblem& p, const Layout& l, const Memory& predicted) {
  ModelOptions options;
  options.micro_rows = micro_rows(p, l);
  options.slots = predicted.slots;
  options.chunk_slots = predicted.chunk_slots;
  return options;
}

void expect_arena_matches(const parallel::Comm& tp, int64_t pp, int64_t v,
                          parallel::ScheduleKind kind, int64_t micro_batches,
                          int64_t checkpoint_every = 0) {
  PlanProblem p;
  p.model = small_model();
  p.global_batch = 2 * micro_batches * 3;  // dp 3, two sequences per micro-batch
  p.precision = Precision::from_recipe(TrainPrecision::kFp32);
  p.cluster.nodes = 3 * pp;
  p.cluster.devices_per_node = tp.size();
  Layout l{3, tp.size(), pp, micro_batches, kind, v, 0, checkpoint_every};
  ASSERT_EQ(invalid_reason(p, l), "");
  const auto schedule = make_layout_schedule(l);
  for (int64_t stage = 0; stage < pp; ++stage) {
    SCOPED_TRACE(l.label() + " stage " + std::to_string(stage) + " tp rank " +
                 std::to_string(tp.rank()));
    const Memory predicted = stage_memory(p, l, schedule, stage);
    const auto chunks = stage_layers(p.model, {}, schedule, static_cast<int>(stage));
    kernels::Arena arena(size_t{256} << 20);
    ModelOptions options = predicted_options(p, l, predicted);
    options.split_backward =
        kind == parallel::ScheduleKind::kZBH1 || kind == parallel::ScheduleKind::kZBV;
    options.checkpoint_every = checkpoint_every;
    Model model(p.model, chunks, tp, arena, options);
    const auto& f = model.footprint();
    EXPECT_EQ(static_cast<double>(f.params), predicted.params);
    EXPECT_EQ(static_cast<double>(f.grads), predicted.grads);
    EXPECT_EQ(static_cast<double>(f.optimizer), predicted.optimizer);
    EXPECT_EQ(static_cast<double>(f.activations), predicted.activations);
    EXPECT_EQ(static_cast<double>(f.scratch), predicted.workspace);
    EXPECT_EQ(static_cast<double>(arena.used()), predicted.total());
  }
}

// ZeRO 1, 2 and 3 over dp = 2 (the two ranks): the moment shard, with ZeRO >= 2 the gradient
// shard and staging buffers, with ZeRO-3 the parameter shard and gather buffers
// (ShardedState, as training builds them), take exactly the bytes the planner predicts on the
// rank with the larger share.
// With `ep` = 2 (a mixture of experts): the routed experts are a second state group, one EP rank
// holding each half, sharded over nobody (the expert-data-parallel group is the rank alone).
void expect_zero_arena_matches(const parallel::Comm& dp, const parallel::Comm& tp, int64_t pp,
                               int64_t v, parallel::ScheduleKind kind, int64_t micro_batches,
                               int64_t zero, double bucket_mb,
                               const ModelConfig& model = small_model(), int64_t ep = 1) {
  PlanProblem p;
  p.model = model;
  p.global_batch = 2 * micro_batches * 2;
  p.bucket_mb = bucket_mb;
  p.precision = Precision::from_recipe(TrainPrecision::kFp32);
  p.cluster.nodes = 2 * pp;
  p.cluster.devices_per_node = 1;
  Layout l{2, 1, pp, micro_batches, kind, v, zero, 0, ep};
  ASSERT_EQ(invalid_reason(p, l), "");
  const auto schedule = make_layout_schedule(l);
  const parallel::Comm experts_group = dp.split(ep > 1 ? dp.rank() : 0, 0, "edp");
  for (int64_t stage = 0; stage < pp; ++stage) {
    SCOPED_TRACE(l.label() + " bucket_mb " + std::to_string(bucket_mb) + " stage " +
                 std::to_string(stage) + " dp rank " + std::to_string(dp.rank()));
    const Memory predicted = stage_memory(p, l, schedule, stage);
    const auto chunks = stage_layers(p.model, {}, schedule, static_cast<int>(stage));
    kernels::Arena arena(size_t{256} << 20);
    ModelOptions options = predicted_options(p, l, predicted);
    const parallel::FullRegions full = parallel::full_regions(static_cast<int>(zero));
    options.param_region = full.params, options.grad_region = full.grads;
    options.with_optimizer = full.moments;
    if (ep > 1) options.ep = &dp;
    Model model(p.model, chunks, tp, arena, options);
    const size_t before = arena.used();
    const TrainingState state(model, dp, experts_group, static_cast<int>(zero), bucket_mb, arena);
    const size_t sharded = arena.used() - before;  // shards, buffers and moments
    const auto& f = model.footprint();
    EXPECT_EQ(static_cast<double>(f.activations), predicted.activations);
    EXPECT_EQ(static_cast<double>(f.scratch), predicted.workspace);
    // What ShardedState reports is what it allocated beside the model's regions.
    const parallel::StateBytes kept = state.footprint();
    EXPECT_EQ(kept.total() - static_cast<double>(f.params + f.grads + f.optimizer),
              static_cast<double>(sharded));
    // The rank holding the larger share is the one the planner prices.
    double measured[4] = {kept.params, kept.grads, kept.optimizer,
                          static_cast<double>(arena.used())};
    dp.all_reduce(measured, 4, parallel::ReduceOp::max);
    EXPECT_EQ(measured[0], predicted.params);
    EXPECT_EQ(measured[1], predicted.grads);
    EXPECT_EQ(measured[2], predicted.optimizer);
    EXPECT_EQ(measured[3], predicted.total());
    if (zero >= 2) {
      EXPECT_EQ(f.grads, 0u);
    }
    if (zero == 3) {
      EXPECT_EQ(f.params, 0u);
    }
  }
}

TEST(PlannerMemory, ZeroShardsMatchTheArenaExactly) {
  parallel::Comm world = parallel::Comm::world(60.0);
  const parallel::Comm alone = world.split(world.rank(), 0, "alone");
  for (int64_t zero : {1, 2, 3})
    for (double bucket_mb : {4.0, 0.01, 0.05}) {
      expect_zero_arena_matches(world, alone, 1, 1, parallel::ScheduleKind::k1F1B, 2, zero,
                                bucket_mb);
      expect_zero_arena_matches(world, alone, 3, 1, parallel::ScheduleKind::kGPipe, 2, zero,
                                bucket_mb);
      expect_zero_arena_matches(world, alone, 3, 2, parallel::ScheduleKind::kInterleaved1F1B, 3,
                                zero, bucket_mb);
    }
}

// A mixture of experts without and with expert parallelism (ep = 2 over the two ranks), every
// ZeRO stage: the dense and the experts' state groups each as the planner prices them.
TEST(PlannerMemory, ExpertStateGroupsMatchTheArenaExactly) {
  parallel::Comm world = parallel::Comm::world(60.0);
  const parallel::Comm alone = world.split(world.rank(), 0, "alone");
  ModelConfig moe = small_model();
  moe.n_experts = 4, moe.experts_per_token = 2, moe.moe_ffn_dim = 32, moe.dense_layers = 1;
  for (int64_t ep : {1, 2})
    for (int64_t zero : {0, 1, 2, 3}) {
      expect_zero_arena_matches(world, alone, 1, 1, parallel::ScheduleKind::k1F1B, 2, zero, 0.01,
                                moe, ep);
      expect_zero_arena_matches(world, alone, 3, 1, parallel::ScheduleKind::kGPipe, 2, zero, 4.0,
                                moe, ep);
    }
}

TEST(PlannerMemory, MatchesTheArenaExactly) {
  parallel::Comm world = parallel::Comm::world(60.0);
  ASSERT_EQ(world.size(), 2);
  const parallel::Comm alone = world.split(world.rank(), 0, "alone");
  for (const parallel::Comm* tp : {&alone, static_cast<const parallel::Comm*>(&world)}) {
    expect_arena_matches(*tp, 1, 1, parallel::ScheduleKind::k1F1B, 2);
    expect_arena_matches(*tp, 3, 1, parallel::ScheduleKind::k1F1B, 4);
    expect_arena_matches(*tp, 3, 1, parallel::ScheduleKind::kGPipe, 2);
    expect_arena_matches(*tp, 3, 2, parallel::ScheduleKind::kInterleaved1F1B, 3);
    // ZB-V: two chunks per stage with different slot counts, and the W pass's saved gradients.
    expect_arena_matches(*tp, 3, 2, parallel::ScheduleKind::kZBV, 5);
    // Checkpointing: the recomputed blocks keep nothing, one work block joins the scratch.
    expect_arena_matches(*tp, 1, 1, parallel::ScheduleKind::k1F1B, 2, 1);
    expect_arena_matches(*tp, 3, 2, parallel::ScheduleKind::kZBV, 5, 2);
  }
}

}  // namespace
}  // namespace t3d::runtime
