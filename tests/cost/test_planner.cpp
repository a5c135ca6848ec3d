// The planner on the two reference cases and on properties its formulas must have.
#include <gtest/gtest.h>

#include <algorithm>
#include <cmath>
#include <set>

#include "kernels/check.h"
#include "runtime/cost/planner.h"
#include "runtime/model/model_spec.h"

namespace t3d::runtime {
namespace {

using parallel::ScheduleKind;

PlanProblem load_problem(const std::string& recipe, const std::string& cluster) {
  return make_problem(load_recipe(T3D_SOURCE_DIR "/recipes/" + recipe),
                      load_cluster(T3D_SOURCE_DIR "/recipes/clusters/" + cluster));
}
PlanProblem llama13b() { return load_problem("llama13b_64npu.toml", "npu64.toml"); }
PlanProblem llama70b() { return load_problem("llama70b_1024h100.toml", "h100_1024.toml"); }

// Does any layout of mesh dp × tp × pp in `space` fit? Fails the test if the mesh has none.
bool mesh_fits(const PlanProblem& p, int64_t dp, int64_t tp, int64_t pp, const PlanSpace& space) {
  int64_t tried = 0;
  for (const Layout& l : enumerate_layouts(p, space)) {
    if (l.dp != dp || l.tp != tp || l.pp != pp) continue;
    ++tried;
    if (evaluate(p, l).fits) return true;
  }
  EXPECT_GT(tried, 0) << "no layout enumerated for dp" << dp << " tp" << tp << " pp" << pp;
  return false;
}

PlanSpace no_zero() {
  PlanSpace s;
  s.zero = {0};
  s.checkpoint = {0, 1, 2};  // none, full, every other block
  return s;
}

// The reference's stated precision, under both readings of it: bf16 weights and gradients with
// fp32 AdamW moments, with (16 B per parameter, the recipe's bf16) or without fp32 master weights
// (12 B). The verdicts must not hinge on which.
TEST(Planner13B, ReferenceMemoryVerdictsWithoutZero) {
  for (double master : {4.0, 0.0}) {
    PlanProblem p = llama13b();
    ASSERT_DOUBLE_EQ(p.precision.weight, 2);
    ASSERT_DOUBLE_EQ(p.precision.moment, 4);
    p.precision.master = master;
    SCOPED_TRACE("master weights bytes " + std::to_string(master));
    EXPECT_FALSE(mesh_fits(p, 64, 1, 1, no_zero())) << "DP=64";
    EXPECT_FALSE(mesh_fits(p, 16, 4, 1, no_zero())) << "TP=4 × DP=16";
    EXPECT_TRUE(mesh_fits(p, 8, 8, 1, no_zero())) << "TP=8 × DP=8";
    EXPECT_TRUE(mesh_fits(p, 8, 1, 8, no_zero())) << "PP=8 × DP=8";
    EXPECT_TRUE(mesh_fits(p, 8, 4, 2, no_zero())) << "TP=4 × PP=2 × DP=8";
  }
}

TEST(Planner13B, ParameterCountIsLlama13B) {
  const PlanProblem p = llama13b();
  Layout l;
  l.dp = 64;
  const Memory m = peak_memory(p, l, make_layout_schedule(l));
  EXPECT_NEAR(m.params / p.precision.weight / 1e9, 13.02, 0.01);
}

TEST(Planner13B, RecipeLayoutFitsAndIsRanked) {
  const PlanProblem p = llama13b();
  const Plan plan = make_plan(p, no_zero());
  ASSERT_FALSE(plan.ranked.empty());
  for (size_t i = 1; i < plan.ranked.size(); ++i)
    ASSERT_GE(plan.ranked[i - 1].time.tokens_per_s_per_device,
              plan.ranked[i].time.tokens_per_s_per_device);
  for (const Candidate& c : plan.ranked) ASSERT_LE(c.memory.total(), 32 * kGiB);
  const Layout own =
      layout_of_recipe(load_recipe(T3D_SOURCE_DIR "/recipes/llama13b_64npu.toml"), p.cluster);
  EXPECT_EQ(own.label(), "dp8 tp4 pp2 1f1b m8 z0 ckpt:none");
  EXPECT_TRUE(evaluate(p, own).fits);
}

TEST(Planner70B, GuideLayoutIsFeasible) {
  const PlanProblem p = llama70b();
  EXPECT_TRUE(mesh_fits(p, 16, 8, 8, no_zero()));
  const Layout own =
      layout_of_recipe(load_recipe(T3D_SOURCE_DIR "/recipes/llama70b_1024h100.toml"), p.cluster);
  EXPECT_EQ(own.label(), "dp16 tp8 pp8 1f1b m128 z0 ckpt:full");
  const Candidate c = evaluate(p, own);
  EXPECT_TRUE(c.fits) << c.memory.total() / kGiB << " GiB";
  // The guide's arithmetic: 70B × 16 B / 64 ≈ 17.5 GB of state per GPU, then activations.
  EXPECT_NEAR((c.memory.params + c.memory.grads + c.memory.optimizer) / 1e9, 17.5, 1.0);
}

TEST(Planner, EnumerationRespectsTheConstraints) {
  const PlanProblem p = llama13b();
  const auto layouts = enumerate_layouts(p, PlanSpace{});
  ASSERT_FALSE(layouts.empty());
  for (const Layout& l : layouts) {
    ASSERT_EQ(l.world(), 64);
    ASSERT_EQ(8 % l.tp, 0) << l.label();
    ASSERT_EQ(p.model.n_heads % l.tp, 0) << l.label();
    ASSERT_EQ(p.model.n_layers % l.pp, 0) << l.label();
    ASSERT_EQ(p.global_batch % (l.dp * l.micro_batches), 0) << l.label();
    if (l.dp == 1) {
      ASSERT_EQ(l.zero, 0);
    }
    if (l.schedule == ScheduleKind::kInterleaved1F1B) {
      ASSERT_EQ(l.micro_batches % l.pp, 0);
    }
    if (l.schedule == ScheduleKind::kZBV) {
      ASSERT_GT(l.pp, 1);
      ASSERT_EQ(l.virtual_stages, 2);
    }
  }
  EXPECT_TRUE(std::any_of(layouts.begin(), layouts.end(),
                          [](const Layout& l) { return l.schedule == ScheduleKind::kZBV; }));
}

TEST(Planner, ActivationSlotsFollowTheSchedule) {
  Layout l;
  l.pp = 4;
  l.micro_batches = 8;
  const auto one_f_one_b = make_layout_schedule(l);
  for (int s = 0; s < 4; ++s) EXPECT_EQ(activation_slots(one_f_one_b, s), 4 - s);
  l.schedule = ScheduleKind::kGPipe;
  EXPECT_EQ(activation_slots(make_layout_schedule(l), 3), 8);
  l.pp = 1;
  l.schedule = ScheduleKind::k1F1B;
  EXPECT_EQ(activation_slots(make_layout_schedule(l), 0), 1);  // plain gradient accumulation
  // ZB-V: per chunk, in model order; the stage's chunks together hold 1F1B's 2·pp chunks.
  l = Layout{};
  l.pp = 4;
  l.micro_batches = 8;
  l.schedule = ScheduleKind::kZBV;
  l.virtual_stages = 2;
  const auto zbv = make_layout_schedule(l);
  for (int s = 0; s < 4; ++s) {
    const auto per_chunk = chunk_activation_slots(zbv, s);
    ASSERT_EQ(per_chunk.size(), 2u);
    EXPECT_EQ(per_chunk[0] + per_chunk[1], 8) << "stage " << s;
    EXPECT_EQ(activation_slots(zbv, s), std::max(per_chunk[0], per_chunk[1]));
  }
  EXPECT_GT(chunk_activation_slots(zbv, 0)[0], chunk_activation_slots(zbv, 0)[1]);
}

TEST(Planner, ZeroAndCheckpointingSaveWhatTheyShould) {
  const PlanProblem p = llama13b();
  Layout l{8, 8, 1, 8, ScheduleKind::k1F1B, 1, 0, 0};
  const auto s = make_layout_schedule(l);
  // Each stage shrinks memory: ZeRO-1 the optimizer state, ZeRO-2 the gradients (to 1/dp plus
  // two staging buffers of the largest bucket), ZeRO-3 the weights.
  double previous = 1e300;
  Memory zero1;
  for (int64_t z = 0; z <= 3; ++z) {
    l.zero = z;
    const Memory m = peak_memory(p, l, s);
    EXPECT_LT(m.total(), previous) << "ZeRO-" << z;
    previous = m.total();
    if (z == 1) zero1 = m;
    if (z == 2) {
      EXPECT_EQ(m.optimizer, zero1.optimizer);
      // 40 layers of 13B over tp 8: a 4 MiB bucket is one layer (~39 MB); two of those on
      // top of 1/8 of ~1.6 GB of gradients.
      EXPECT_GT(m.grads, zero1.grads / 8);
      EXPECT_LT(m.grads, zero1.grads / 8 + 3 * zero1.grads / 40);
    }
  }
  l.zero = 0;
  const Memory none = peak_memory(p, l, s);
  const StepTime t_none = step_time(p, l, s);
  l.checkpoint_every = 1;
  const Memory full = peak_memory(p, l, s);
  const StepTime t_full = step_time(p, l, s);
  EXPECT_LT(full.activations, none.activations / 5);
  EXPECT_GT(full.workspace, none.workspace);
  // Full recomputation adds one forward: compute goes from f+b+w to 2f+b+w, about 4/3.
  EXPECT_NEAR(t_full.compute / t_none.compute, 4.0 / 3.0, 0.03);
}

TEST(Planner, StepTimePartsAddUpAndBubbleIsTheSimulators) {
  PlanProblem p = llama13b();
  const Layout l{8, 4, 2, 8, ScheduleKind::k1F1B, 1, 0, 0};
  const auto s = make_layout_schedule(l);
  const StepTime t = step_time(p, l, s);
  EXPECT_NEAR(t.compute + t.tp + t.ep + t.dp + t.pp + t.bubble, t.total, 1e-9 * t.total);
  EXPECT_GT(t.tp, 0);
  EXPECT_GT(t.pp, 0);
  // Free, instant links leave compute and the textbook 1F1B bubble (p-1)/(m+p-1) alone.
  p.cluster.intra_node_gbps = p.cluster.inter_node_gbps = 1e12;
  p.cluster.intra_node_latency_us = p.cluster.inter_node_latency_us = 0;
  const StepTime ideal = step_time(p, l, s);
  EXPECT_NEAR(ideal.bubble / ideal.total, 1.0 / 9.0, 1e-6);
  EXPECT_NEAR(ideal.compute, t.compute, 1e-12);
  EXPECT_NEAR(ideal.bubble_fraction, 1.0 / 9.0, 1e-6);
  // run.replay_every = 4: one more pipeline pass (the makespan, without the dp sync) every 4
  // steps, and nothing else changes.
  PlanProblem checked = llama13b();
  EXPECT_EQ(t.replay, 0);
  checked.replay_every = 4;
  const StepTime r = step_time(checked, l, s);
  EXPECT_NEAR(r.replay, (t.total - t.dp) / 4, 1e-9 * t.total);
  EXPECT_NEAR(r.total, t.total + r.replay, 1e-9 * t.total);
  EXPECT_NEAR(r.compute + r.tp + r.ep + r.dp + r.pp + r.bubble + r.replay, r.total, 1e-9 * r.total);
  EXPECT_EQ(
      make_problem(parse_recipe("[run]\nreplay_every = 7\n", "r.toml"), p.cluster).replay_every, 7);
}

// A mixture of experts is priced block by block along its active path: on one stage the step's
// compute is exactly the FLOPs MFU counts (model_train_flops_per_token: the router and K of E
// experts per MoE block, the MLP of a leading dense block), and fewer experts per token cost less.
TEST(Planner, MoeComputeIsTheActivePathsFlops) {
  PlanProblem p = load_problem("moe.toml", "npu64.toml");
  ASSERT_TRUE(p.model.moe());
  const double flops_s = p.cluster.peak_tflops * 1e12 * p.cluster.compute_efficiency;
  const Layout l{1, 1, 1, 4, ScheduleKind::k1F1B, 1, 0, 0};
  const auto s = make_layout_schedule(l);
  for (const int64_t dense_layers : {0, 1, 3}) {
    SCOPED_TRACE(testing::Message() << "dense_layers " << dense_layers);
    p.model.dense_layers = dense_layers;
    const double flops = static_cast<double>(p.global_batch * p.model.seq_len) *
                         model_train_flops_per_token(p.model);
    EXPECT_NEAR(step_time(p, l, s).compute * flops_s, flops, 1e-9 * flops);
  }
  const double top2 = step_time(p, l, s).compute;
  p.model.experts_per_token = 1;
  EXPECT_LT(step_time(p, l, s).compute, top2);
  // Every block's W holds all its weight-gradient GEMMs (docs/moe.md): a MoE block's router, K of
  // its E experts, its shared experts and its attention, one matmul pass as a dense block's.
  const double rows = static_cast<double>(micro_rows(p, l) * p.model.seq_len);
  for (const int64_t dense_layers : {0, 1}) {
    SCOPED_TRACE(testing::Message() << "W, dense_layers " << dense_layers);
    p.model.dense_layers = dense_layers;
    double matmul = 0;
    for (int64_t layer = 0; layer < p.model.n_layers; ++layer)
      matmul += block_flops_per_token(p.model, l.tp, layer).matmul;
    EXPECT_NEAR(stage_costs(p, l).w * flops_s, rows * matmul, 1e-9 * rows * matmul);
  }
}

// Expert parallelism (docs/moe.md): each of ep ranks keeps n_experts / ep of the routed experts'
// state, so exactly (ep − 1)/ep of the experts' bytes leave the rank's memory; the all-to-alls
// cost time that ep = 1 does not, the FLOPs are the same; the search tries every ep dividing dp
// and n_experts, for a mixture of experts only.
TEST(Planner, ExpertParallelismShardsTheExpertsAndPricesTheAllToAll) {
  PlanProblem p = load_problem("moe.toml", "npu64.toml");
  ASSERT_TRUE(p.model.moe());
  // Every routed expert's tensors, whole (their tp = 4 slices are multiples of the alignment).
  double expert_floats = 0;
  for (const auto& t : param_table(p.model))
    if (t.expert >= 0) expert_floats += static_cast<double>(tp_shard_box(t, 1, 0).numel());
  const Layout one{16, 4, 1, 1, ScheduleKind::k1F1B, 1, 0, 0, 1};
  Layout four = one;
  four.ep = 4;
  ASSERT_EQ(invalid_reason(p, four), "");
  const auto s = make_layout_schedule(one);
  const Memory m1 = stage_memory(p, one, s, 0), m4 = stage_memory(p, four, s, 0);
  const double weight = p.precision.weight, freed = expert_floats * 3 / 4 / 4;  // tp = 4
  EXPECT_NEAR(m1.params - m4.params, freed * weight, 1e-6 * m1.params);
  const StepTime t1 = step_time(p, one, s), t4 = step_time(p, four, s);
  EXPECT_EQ(t1.ep, 0.0);
  EXPECT_GT(t4.ep, 0.0);
  EXPECT_DOUBLE_EQ(t4.compute, t1.compute);
  // A measured all-to-all (plan --calibrate) prices the exchange instead of the links: without
  // latency, twice its bandwidth halves the time.
  PlanProblem measured = p;
  measured.cluster.all_to_all_gbps = 10;
  const double at10 = step_time(measured, four, s).ep;
  measured.cluster.all_to_all_gbps = 20;
  EXPECT_NE(at10, t4.ep);
  EXPECT_NEAR(step_time(measured, four, s).ep, at10 / 2, 1e-12 * at10);
  measured.cluster.all_to_all_latency_us = 50;
  EXPECT_GT(step_time(measured, four, s).ep, at10 / 2);
  // The DP sync per state group: the dense parameters over dp (stride tp), the experts by a ring
  // of their own over the dp/ep ranks holding the same ones (stride tp·ep).
  Layout eight = one;
  eight.ep = 8;
  ASSERT_EQ(invalid_reason(p, eight), "");
  // Floats of a state group on a rank holding the experts of EP rank 0 of `ep` (tp = 4).
  const auto group_floats = [&](StateGroup group, int64_t ep) {
    const ParamUnits units =
        param_units(p.model, {{0, p.model.n_layers, true, true}}, 4, expert_share(p.model, ep, 0));
    const GroupUnits g = group_units(p.model, units, group);
    return static_cast<double>(g.end - g.begin);
  };
  const double grad = p.precision.grad;
  const double dense_s = ring_reduce_scatter_s(group_floats(StateGroup::kDense, 1) * grad, 16,
                                               group_link(p.cluster, 4, 16));
  EXPECT_DOUBLE_EQ(dp_sync(p, one).reduce_scatter_s,
                   dense_s + ring_reduce_scatter_s(group_floats(StateGroup::kExperts, 1) * grad, 16,
                                                   group_link(p.cluster, 4, 16)));
  EXPECT_DOUBLE_EQ(dp_sync(p, eight).reduce_scatter_s,
                   dense_s + ring_reduce_scatter_s(group_floats(StateGroup::kExperts, 8) * grad, 2,
                                                   group_link(p.cluster, 32, 2)));
  std::set<int64_t> eps;
  for (const Layout& l : enumerate_layouts(p, PlanSpace{}))
    if (l.dp == 16) eps.insert(l.ep);
  EXPECT_EQ(eps, (std::set<int64_t>{1, 2, 4, 8}));  // 8 experts
  Layout three = one;
  three.ep = 3;
  EXPECT_NE(invalid_reason(p, three), "");
  PlanProblem dense = p;
  dense.model.n_experts = 0;
  EXPECT_NE(invalid_reason(dense, four), "");
  for (const Layout& l : enumerate_layouts(dense, PlanSpace{})) EXPECT_EQ(l.ep, 1);
}

TEST(Planner, RingFormulasAndLinks) {
  const Link link{1e9, 0.0, false};
  EXPECT_DOUBLE_EQ(ring_all_reduce_s(8e9, 8, link), 14.0);  // 2 (n-1)/n · bytes / bw
  EXPECT_DOUBLE_EQ(ring_reduce_scatter_s(8e9, 8, link), 7.0);
  EXPECT_DOUBLE_EQ(ring_all_reduce_s(8e9, 1, link), 0.0);
  EXPECT_DOUBLE_EQ(ring_all_reduce_s(0, 4, {1e9, 1e-6, false}), 6e-6);  // 2 (n-1) latencies
  const Cluster c = llama13b().cluster;  // 8 per node, 800 inside, 200 per node between
  EXPECT_FALSE(group_link(c, 1, 8).inter_node);
  EXPECT_DOUBLE_EQ(group_link(c, 1, 8).bytes_per_s, 800e9);
  EXPECT_TRUE(group_link(c, 8, 8).inter_node);
  EXPECT_DOUBLE_EQ(group_link(c, 8, 8).bytes_per_s, 25e9);  // one member per node: 200 / 8
  EXPECT_DOUBLE_EQ(group_link(c, 4, 8).bytes_per_s, 50e9);  // two members per node
  EXPECT_FALSE(group_link(c, 4, 2).inter_node);
}

TEST(Planner, WrittenRecipeRoundTrips) {
  const Recipe recipe = load_recipe(T3D_SOURCE_DIR "/recipes/llama13b_64npu.toml");
  const Cluster cluster = load_cluster(T3D_SOURCE_DIR "/recipes/clusters/npu64.toml");
  const Layout l{4, 8, 2, 8, ScheduleKind::kInterleaved1F1B, 4, 1, 2};
  const Recipe written = recipe_with_layout(recipe, l, cluster);
  EXPECT_EQ(layout_of_recipe(written, cluster).label(), l.label());
  EXPECT_EQ(written.train.activation_checkpoint.name(), "every:2");
  EXPECT_EQ(parse_recipe(written.to_toml(), "<again>").to_toml(), written.to_toml());
}

TEST(Planner, InvalidLayoutsAreExplained) {
  const PlanProblem p = llama13b();
  EXPECT_NE(invalid_reason(p, {8, 8, 2, 8}), "");  // 128 ≠ 64 devices
  EXPECT_NE(invalid_reason(p, {2, 16, 2, 8}).find("node"), std::string::npos);  // tp spans nodes
  EXPECT_NE(invalid_reason(p, {16, 1, 4, 3}).find("global_batch"), std::string::npos);
  EXPECT_THROW(explain(p, {16, 1, 4, 3}), UserError);
  EXPECT_NE(invalid_reason(p, {8, 4, 2, 8, ScheduleKind::kZBV, 1}).find("zb_v"), std::string::npos);
  EXPECT_EQ(invalid_reason(p, {8, 4, 2, 8, ScheduleKind::kZBV, 2}), "");
  // ZB-V's stage 0 holds the embedding and the head; its two chunks' slots are listed apart.
  const std::string zbv = explain(p, {8, 4, 2, 8, ScheduleKind::kZBV, 2});
  EXPECT_NE(zbv.find("embedding, final norm and LM head"), std::string::npos) << zbv;
  EXPECT_NE(zbv.find("activations {"), std::string::npos) << zbv;
  const std::string text = explain(p, {8, 4, 2, 8});
  for (const char* part :
       {"weights", "optimizer", "activations", "tp: all-reduce", "pipeline", "tokens/s/device"})
    EXPECT_NE(text.find(part), std::string::npos) << part << " missing from:\n" << text;
}

}  // namespace
}  // namespace t3d::runtime
