// The assembled model: every parameter's gradient against central finite differences of the
// loss (catches wiring errors no kernel test can: a missing residual, a swapped operand), and the
// tp = 2 model against the tp = 1 model, shard by shard. Run under mpirun -np 2.
#include <gtest/gtest.h>

#include <algorithm>
#include <cmath>
#include <random>
#include <vector>

#include "kernels/arena.h"
#include "kernels/check.h"
#include "kernels/gemm.h"
#include "kernels/ops.h"
#include "parallel/comm.h"
#include "runtime/model/model.h"
#include "tests/model/tiny_models.h"

using namespace t3d;
using runtime::Model;
using runtime::moe_config;
using runtime::tiny_config;

namespace {

struct Batch {
  std::vector<int32_t> tokens, targets;
};

Batch make_batch(int64_t rows, int64_t T, int64_t vocab) {
  std::mt19937 rng(7);
  Batch b;
  for (int64_t i = 0; i < rows * T; ++i) {
    b.tokens.push_back(static_cast<int32_t>(rng() % vocab));
    b.targets.push_back(static_cast<int32_t>(rng() % vocab));
  }
  return b;
}

std::vector<parallel::LayerRange> whole(int64_t layers) { return {{0, layers, true, true}}; }

// Summed loss (grad_scale 1) and, with `train`, the gradients.
double loss_of(Model& m, const Batch& b, bool train) {
  if (train) m.state().grads.zero();
  m.forward(0, 0, b.tokens.data(), b.targets.data(), 1.0f, train);
  const double loss = m.take_loss_sum();
  if (train) m.backward(0, 0, nullptr);
  return loss;
}

// q/k norm weights start at ones: move them to 1 ± 0.3, different per element, so that a wrong
// weight or head indexing changes the loss.
void perturb_qk_norms(Model& m) {
  for (const auto& p : m.params()) {
    if (!p.name.ends_with("q_norm.weight") && !p.name.ends_with("k_norm.weight")) continue;
    const auto w = m.state().params.view(p.name);
    const float phase = p.name.ends_with("q_norm.weight") ? 0.5f : 0.0f;
    for (int64_t i = 0; i < w.numel; ++i)
      w.data[i] = 1.0f + 0.3f * std::sin(1.3f * static_cast<float>(i) + phase);
  }
}

}  // namespace

// Also with heads wider than dim / n_heads and a scaled RoPE (wide_head_config), q/k/v biases,
// and per-head q/k norms over biases (qk_norm_config; its norm weights moved off their ones, so
// the gradient through the weight is seen too).
TEST(ModelMpi, EveryParameterGradientMatchesFiniteDifferences) {
  auto world = parallel::Comm::world(60.0);
  const auto self = world.split(world.rank(), 0, "self");  // tp group of one
  for (const auto& cfg : {tiny_config(), runtime::wide_head_config(), runtime::qkv_bias_config(),
                          runtime::qk_norm_config()}) {
    SCOPED_TRACE(cfg.qk_norm             ? "q/k norms"
                 : cfg.explicit_head_dim ? "head_dim 6, llama3 RoPE"
                 : cfg.qkv_bias          ? "q/k/v biases"
                                         : "tiny");
    kernels::Arena arena(64 << 20);
    Model m(cfg, whole(cfg.n_layers), self, arena, {2, 1, false});
    m.init(3);
    perturb_qk_norms(m);
    const Batch b = make_batch(2, cfg.seq_len, cfg.vocab_size);
    loss_of(m, b, true);
    std::mt19937 rng(11 + world.rank());
    int checked = 0;
    for (const auto& p : m.params()) {
      const auto params = m.state().params.view(p.name);
      const auto grads = m.state().grads.view(p.name);
      for (int trial = 0; trial < 3; ++trial) {
        const int64_t i = rng() % params.numel;
        const float saved = params.data[i];
        // Weights start at std 0.02, so the step must be well below that for the quotient to see
        // the slope rather than the curvature; summed losses keep fp32 rounding far below it.
        const float eps = 3e-3f;
        params.data[i] = saved + eps;
        const double up = loss_of(m, b, false);
        params.data[i] = saved - eps;
        const double down = loss_of(m, b, false);
        params.data[i] = saved;
        const double fd = (up - down) / (2.0 * eps);
        const double analytic = grads.data[i];
        EXPECT_NEAR(analytic, fd, 2e-3 + 2e-2 * std::fabs(fd)) << p.name << "[" << i << "]";
        ++checked;
      }
    }
    EXPECT_EQ(checked, 3 * static_cast<int>(m.params().size()));
  }
}

// The same for a mixture of experts (softmax and sigmoid routers; softmax with a capacity that
// drops slots), with the auxiliary loss in the objective: the loss the forward sums plus the
// auxiliary loss it reports. A weight step small enough to keep every token's top-k choice (FD
// across a change of routing would see a jump, not the slope the backward computes), and with
// it the dropped slots.
TEST(ModelMpi, MoeEveryParameterGradientMatchesFiniteDifferences) {
  auto world = parallel::Comm::world(60.0);
  const auto self = world.split(world.rank(), 0, "self");
  struct Case {
    kernels::RouterScore score;
    double capacity_factor;
    bool gated = false;  // the shared expert behind its sigmoid gate (gated_moe_config)
  };
  for (const Case c :
       {Case{kernels::RouterScore::kSoftmax, 0.0}, Case{kernels::RouterScore::kSigmoid, 0.0},
        Case{kernels::RouterScore::kSoftmax, 0.75},
        Case{kernels::RouterScore::kSoftmax, 0.0, true}}) {
    SCOPED_TRACE(testing::Message()
                 << (c.score == kernels::RouterScore::kSoftmax ? "softmax" : "sigmoid")
                 << ", capacity factor " << c.capacity_factor << (c.gated ? ", gated" : ""));
    auto cfg = c.gated ? runtime::gated_moe_config() : moe_config();
    cfg.router_score = c.score;
    cfg.capacity_factor = c.capacity_factor;
    kernels::Arena arena(64 << 20);
    runtime::ModelOptions options{2, 1, false};
    options.moe_aux_weight = 0.5;
    Model m(cfg, whole(cfg.n_layers), self, arena, options);
    m.init(3);
    const Batch b = make_batch(2, cfg.seq_len, cfg.vocab_size);
    // The objective: summed token losses plus the weighted auxiliary loss of the same forward.
    const auto objective = [&] {
      m.reset_moe_stats();
      m.forward(0, 0, b.tokens.data(), b.targets.data(), 1.0f, true);
      return m.take_loss_sum() + m.aux_loss();
    };
    // The gradients on fresh scratch, then after a step on other tokens, which route elsewhere:
    // the scratch then holds another routing's values where this batch's slots drop, and a
    // dropped slot's gate gradient must still be 0. The same bits both times.
    const auto gradients = [&] {
      m.state().grads.zero();
      objective();
      m.backward(0, 0, nullptr);
      return std::vector<float>(m.state().grads.data(),
                                m.state().grads.data() + m.layout().total_floats());
    };
    const std::vector<float> on_fresh_scratch = gradients();
    Batch other = b;
    std::reverse(other.tokens.begin(), other.tokens.end());
    m.forward(0, 0, other.tokens.data(), other.targets.data(), 1.0f, true);
    m.take_loss_sum();
    m.backward(0, 0, nullptr);
    EXPECT_TRUE(gradients() == on_fresh_scratch) << "the backward reads stale scratch";
    m.state().grads.zero();
    objective();
    EXPECT_GT(m.aux_loss(), 0);
    double dropped = 0;
    for (const double d : m.dropped_slots()) dropped += d;
    if (c.capacity_factor > 0) {
      EXPECT_GT(dropped, 0) << "the capacity drops slots";
    } else {
      EXPECT_EQ(dropped, 0);
    }
    m.backward(0, 0, nullptr);
    // A training forward computes the LM head's gradient at once: keep the backward's.
    const std::vector<float> grad_region(m.state().grads.data(),
                                         m.state().grads.data() + m.layout().total_floats());
    std::mt19937 rng(11 + world.rank());
    int checked = 0;
    for (const auto& p : m.params()) {
      const auto params = m.state().params.view(p.name);
      const float* grads = grad_region.data() + m.layout().at(p.name).offset;
      for (int trial = 0; trial < 3; ++trial) {
        const int64_t i = rng() % params.numel;
        const float saved = params.data[i];
        const float eps = 1e-3f;
        params.data[i] = saved + eps;
        const double up = objective();
        params.data[i] = saved - eps;
        const double down = objective();
        params.data[i] = saved;
        const double fd = (up - down) / (2.0 * eps);
        const double analytic = grads[i];
        if (p.router_bias()) {
          EXPECT_EQ(analytic, 0.0) << p.name << ": the selection bias takes no gradient";
          continue;
        }
        EXPECT_NEAR(analytic, fd, 3e-3 + 3e-2 * std::fabs(fd)) << p.name << "[" << i << "]";
        ++checked;
      }
    }
    EXPECT_GE(checked, 3 * (static_cast<int>(m.params().size()) - 1));
  }
}

TEST(ModelMpi, TensorParallelShardsEqualTheWholeModel) {
  auto world = parallel::Comm::world(60.0);
  ASSERT_EQ(world.size(), 2);
  const auto self = world.split(world.rank(), 0, "self");
  // Dense, a mixture of experts, wide heads, q/k/v biases (tp splits both with the heads) and
  // per-head q/k norms (replicated weights, each rank's gradient its heads' share: summed over tp
  // by sum_replicated_grads, as training does before the dp reduction); the shared expert's
  // sigmoid gate (its dot summed over tp before its gradient; with sequence parallelism, 6, each
  // rank's rows' share of its weight gradient summed by sum_replicated_grads).
  for (const int kind : {0, 1, 2, 3, 4, 5, 6}) {
    SCOPED_TRACE(kind == 1   ? "mixture of experts"
                 : kind == 2 ? "head_dim 6"
                 : kind == 3 ? "q/k/v biases"
                 : kind == 4 ? "q/k norms"
                 : kind == 5 ? "gated shared expert"
                 : kind == 6 ? "gated shared expert, sequence parallel"
                             : "dense");
    const auto cfg = kind == 1   ? moe_config()
                     : kind == 2 ? runtime::wide_head_config()
                     : kind == 3 ? runtime::qkv_bias_config()
                     : kind == 4 ? runtime::qk_norm_config()
                     : kind >= 5 ? runtime::gated_moe_config()
                                 : tiny_config();
    const Batch b = make_batch(2, cfg.seq_len, cfg.vocab_size);
    kernels::Arena arena(128 << 20);
    Model full(cfg, whole(cfg.n_layers), self, arena, {2, 1, false});
    runtime::ModelOptions sharded{2, 1, false};
    sharded.sequence_parallel = kind == 6;
    Model shard(cfg, whole(cfg.n_layers), world, arena, sharded);  // tp = 2
    full.init(5);
    shard.init(5);
    perturb_qk_norms(full);
    perturb_qk_norms(shard);
    const double loss_full = loss_of(full, b, true);
    const double loss_shard = loss_of(shard, b, true);
    const int64_t region = shard.layout().total_floats();
    shard.sum_replicated_grads({0, region}, shard.state().grads.data());
    EXPECT_NEAR(loss_shard, loss_full, 1e-5 * std::fabs(loss_full));
    // Each shard's parameters and gradients are exactly its slice of the whole model's.
    for (const auto& p : full.params()) {
      const auto wf = full.state().params.view(p.name), gf = full.state().grads.view(p.name);
      const auto ws = shard.state().params.view(p.name), gs = shard.state().grads.view(p.name);
      const int64_t rows = ws.dim(0), cols = p.global_shape.size() > 1 ? ws.dim(1) : 1;
      const int64_t full_cols = p.global_shape.size() > 1 ? p.global_shape[1] : 1;
      const int64_t r0 = p.split_dim == 0 ? rows * world.rank() : 0;
      const int64_t c0 = p.split_dim == 1 ? cols * world.rank() : 0;
      for (int64_t r = 0; r < rows; ++r)
        for (int64_t c = 0; c < cols; ++c) {
          const int64_t i = r * cols + c, j = (r0 + r) * full_cols + c0 + c;
          ASSERT_EQ(ws.data[i], wf.data[j]) << p.name << " init differs at " << j;
          ASSERT_NEAR(gs.data[i], gf.data[j], 1e-5 + 1e-4 * std::fabs(gf.data[j]))
              << p.name << " gradient differs at " << j;
        }
    }
  }
}

// The GEMM kind is each Model's own (ModelOptions::gemm), not the process's: two Models of one
// process, one on OpenBLAS fp32 and one on oneDNN bf16, run interleaved, and each computes what
// it computes alone. A process-wide kind would give both the same bits.
TEST(ModelMpi, TwoModelsOfOneProcessEachRunTheirOwnGemmKind) {
  try {
    kernels::verify_gemm_kind(kernels::GemmKind::kOneDnnBf16);
  } catch (const GemmUnavailable& e) {
    GTEST_SKIP() << "no bf16 GEMM on this CPU, nothing to tell apart: " << e.reason();
  }
  auto world = parallel::Comm::world(60.0);
  const auto self = world.split(world.rank(), 0, "self");
  const auto cfg = tiny_config();
  const Batch b = make_batch(2, cfg.seq_len, cfg.vocab_size);
  runtime::ModelOptions fp32{2, 1, false};
  fp32.exec = kernels::GemmKind::kOpenBlasF32;
  runtime::ModelOptions bf16 = fp32;
  bf16.exec = kernels::GemmKind::kOneDnnBf16;
  kernels::Arena arena32(64 << 20), arena16(64 << 20);
  Model m32(cfg, whole(cfg.n_layers), self, arena32, fp32);
  Model m16(cfg, whole(cfg.n_layers), self, arena16, bf16);
  m32.init(5);
  m16.init(5);
  const auto grads = [](Model& m) {
    return std::vector<float>(m.state().grads.data(),
                              m.state().grads.data() + m.state().grads.size());
  };
  const double loss32 = loss_of(m32, b, true);
  const std::vector<float> grads32 = grads(m32);
  const double loss16 = loss_of(m16, b, true);
  const std::vector<float> grads16 = grads(m16);
  // The fp32 Model after the bf16 one ran: the same bits as before, not the bf16 Model's.
  EXPECT_EQ(loss_of(m32, b, true), loss32);
  EXPECT_EQ(grads(m32), grads32);
  EXPECT_NE(grads16, grads32) << "the bf16 Model computed in fp32";
  EXPECT_NEAR(loss16, loss32, 1e-2 * std::fabs(loss32)) << "bf16 inputs, fp32 sums: close";
  // And the bf16 Model after the fp32 one ran again: its own bits.
  EXPECT_EQ(loss_of(m16, b, true), loss16);
  EXPECT_EQ(grads(m16), grads16);
}

// Model::round_weights: a step's passes read the weights' bf16 copy (the same bits as rounding
// each weight per GEMM: loss and gradients), and once the window ends a changed weight is read
// as it now is, not from the stale copy (what an evaluation between steps, after the optimizer,
// relies on). The MoE model covers the experts' GEMMs and the router.
TEST(ModelMpi, RoundedWeightsGiveTheSameBitsAndEndWithTheirWindow) {
  try {
    kernels::verify_gemm_kind(kernels::GemmKind::kOneDnnBf16);
  } catch (const GemmUnavailable& e) {
    GTEST_SKIP() << "no bf16 GEMM on this CPU: " << e.reason();
  }
  auto world = parallel::Comm::world(60.0);
  const auto self = world.split(world.rank(), 0, "self");
  for (const auto& cfg : {tiny_config(), moe_config()}) {
    const Batch b = make_batch(2, cfg.seq_len, cfg.vocab_size);
    runtime::ModelOptions bf16{2, 1, false};
    bf16.exec = kernels::GemmKind::kOneDnnBf16;
    kernels::Arena arena(64 << 20);
    Model m(cfg, whole(cfg.n_layers), self, arena, bf16);
    m.init(5);
    const auto grads = [&] {
      return std::vector<float>(m.state().grads.data(),
                                m.state().grads.data() + m.state().grads.size());
    };
    const double per_call = loss_of(m, b, true);
    const std::vector<float> per_call_grads = grads();
    {
      const runtime::RoundedWeights rounded(m);
      ASSERT_NE(m.exec().weight_copy, nullptr);
      EXPECT_TRUE(m.exec().weight_copy->current);
      EXPECT_EQ(loss_of(m, b, true), per_call);
      EXPECT_EQ(grads(), per_call_grads);
    }
    EXPECT_FALSE(m.exec().weight_copy->current);
    // Scale every weight by 3 (an optimizer step): the loss follows, as a fresh copy's would.
    float* params = m.state().params.data();
    for (int64_t i = 0; i < m.state().params.size(); ++i) params[i] *= 3.0f;
    const double changed = loss_of(m, b, false);
    EXPECT_NE(changed, per_call);
    {
      const runtime::RoundedWeights rounded(m);
      EXPECT_EQ(loss_of(m, b, false), changed);
    }
  }
}

// What a GPU's step waits for (kernels::host_waits, counted on the CPU at the same call sites). A
// forward's tokens and targets cross in without a wait (small uploads) and its loss stays in the
// Exec's memory until take_loss_sum (one wait for any number of forwards); each
// mixture-of-experts block waits for its routing (`chosen` out; the slot maps go in without a
// wait) and in a training forward for the auxiliary loss's value. The backward, whole or as B
// then W, and with its blocks stored in bf16 or recomputed, waits for nothing: it reads the
// routing its forward kept, a recomputed block too, whose gradients are then the bits of the
// run without recompute. (Expert parallelism: test_model_ep_mpi.)
TEST(ModelMpi, TheBackwardMakesTheHostWaitForNothing) {
  auto world = parallel::Comm::world(60.0);
  const auto self = world.split(world.rank(), 0, "self");
  struct Case {
    bool split, bf16_stored;
    int64_t checkpoint_every;
  };
  std::vector<float> plain_grads[2];  // dense, MoE: the first case's (fp32, whole backward)
  auto moe = moe_config();
  moe.n_layers = 3;  // two MoE blocks: a recompute reading the other's routing would show
  for (const Case c : {Case{false, false, 0}, Case{true, false, 0}, Case{false, true, 0},
                       Case{true, true, 0}, Case{false, false, 1}}) {
    for (const auto& cfg : {tiny_config(), moe}) {
      std::vector<float>& plain = plain_grads[cfg.n_experts > 0];
      SCOPED_TRACE(testing::Message()
                   << (cfg.n_experts ? "MoE" : "dense") << (c.split ? ", B then W" : "")
                   << (c.bf16_stored ? ", bf16-stored" : "")
                   << (c.checkpoint_every ? ", recomputed" : ""));
      kernels::Arena arena(64 << 20);
      runtime::ModelOptions options{2, 1, false};
      options.moe_aux_weight = 0.5;
      options.split_backward = c.split;
      options.bf16 = c.bf16_stored;
      options.checkpoint_every = c.checkpoint_every;
      Model m(cfg, whole(cfg.n_layers), self, arena, options);
      m.init(3);
      const Batch b = make_batch(2, cfg.seq_len, cfg.vocab_size);
      const int64_t moe_blocks = cfg.n_experts > 0 ? cfg.n_layers - cfg.dense_layers : 0;
      for (const bool train : {false, true}) {  // the backward below follows the training one
        const int64_t before = kernels::host_waits();
        m.forward(0, 0, b.tokens.data(), b.targets.data(), 1.0f, train);
        EXPECT_EQ(kernels::host_waits() - before, moe_blocks * (train ? 2 : 1));
        const int64_t taken = kernels::host_waits();
        EXPECT_GT(m.take_loss_sum(), 0.0);
        EXPECT_EQ(kernels::host_waits() - taken, 1) << "the loss's one crossing";
      }
      const int64_t before = kernels::host_waits();
      if (c.split) {
        m.backward_input(0, 0, nullptr);
        m.backward_weight(0, 0);
      } else {
        m.backward(0, 0, nullptr);
      }
      EXPECT_EQ(kernels::host_waits() - before, 0);
      const std::vector<float> grads(m.state().grads.data(),
                                     m.state().grads.data() + m.layout().total_floats());
      if (plain.empty()) plain = grads;
      if (c.checkpoint_every) EXPECT_TRUE(grads == plain) << "recomputed blocks' gradients";
    }
  }
}

TEST(ModelMpi, ArenaTooSmallFailsAtBuildNamingTheTensor) {
  auto world = parallel::Comm::world(60.0);
  const auto self = world.split(world.rank(), 0, "self");
  kernels::Arena arena(64 << 10);  // 64 KiB: not even the parameters fit
  try {
    Model m(tiny_config(), whole(2), self, arena, {2, 1, true});
    FAIL() << "a model larger than the arena was built";
  } catch (const UserError& e) {
    const std::string msg = e.what();
    EXPECT_NE(msg.find("hbm_gib"), std::string::npos) << msg;
  }
}

// Every activation and scratch row of the spec is bound to its own arena allocation: read back
// from the members the math uses, in allocation order, the pointers tile the activation and
// scratch regions exactly (no null, no overlap, no gap), each as large as its row, and together
// the footprint. A row bound to another row's member, or a size that drifted from the one
// allocated, breaks the tiling.
TEST(ModelMpi, BoundRowsTileTheArena) {
  auto world = parallel::Comm::world(60.0);
  const auto self = world.split(world.rank(), 0, "self");
  const auto cfg = tiny_config();
  struct Case {
    const char* what;
    std::vector<parallel::LayerRange> chunks;
    const parallel::Comm* tp;
    runtime::ModelOptions options;
    const runtime::ModelConfig* config = nullptr;  // nullptr: tiny_config()
  };
  std::vector<Case> cases;
  {
    runtime::ModelOptions o{2, 2, false};
    o.split_backward = true;
    cases.push_back({"two chunks, two slots, split backward",
                     {{0, 1, true, false}, {1, 2, false, true}},
                     &self,
                     o});
    o.bf16 = true;
    o.checkpoint_every = 2;
    cases.push_back({"bf16 copies, checkpointing", whole(cfg.n_layers), &self, o});
    runtime::ModelOptions sp{2, 1, false};
    sp.sequence_parallel = true;
    sp.bf16 = true;
    cases.push_back({"tp 2 with sequence parallelism, bf16", whole(cfg.n_layers), &world, sp});
    runtime::ModelOptions cp{2, 1, false};
    cp.cp = &world;
    cases.push_back({"context parallelism", whole(cfg.n_layers), &self, cp});
  }
  const auto moe = moe_config();
  auto moe_only = moe_config();  // no dense MLP anywhere: its backward's scratch is absent
  moe_only.dense_layers = 0;
  moe_only.n_shared_experts = 0;
  {
    runtime::ModelOptions o{2, 2, false};
    o.split_backward = true;
    cases.push_back({"mixture of experts: two chunks, two slots, split backward",
                     {{0, 1, true, false}, {1, 2, false, true}},
                     &self,
                     o,
                     &moe});
    o.bf16 = true;
    o.checkpoint_every = 2;
    cases.push_back({"mixture of experts: bf16 copies, checkpointing", whole(2), &self, o, &moe});
    runtime::ModelOptions stored{2, 1, false};
    stored.bf16 = true;
    cases.push_back({"mixture of experts: bf16 copies", whole(2), &self, stored, &moe});
    cases.push_back({"only mixtures of experts, no shared expert", whole(2), &self,
                     runtime::ModelOptions{2, 1, false}, &moe_only});
    runtime::ModelOptions ep{2, 2, false};
    ep.ep = &world;  // each rank half the experts; the exchange's rows, and in bf16 its wire
    ep.bf16 = true;
    ep.split_backward = true;
    cases.push_back({"mixture of experts: expert parallelism, bf16 copies, split backward",
                     whole(2), &self, ep, &moe});
  }
  for (const auto& c : cases) {
    SCOPED_TRACE(c.what);
    kernels::Arena arena(64 << 20);
    Model m(c.config ? *c.config : cfg, c.chunks, *c.tp, arena, c.options);
    const auto rows = m.bound_rows();
    ASSERT_FALSE(rows.empty());
    size_t total = 0;
    for (size_t i = 0; i < rows.size(); ++i) {
      ASSERT_NE(rows[i].data, nullptr) << rows[i].name;
      if (i + 1 < rows.size())
        EXPECT_EQ(static_cast<const std::byte*>(rows[i].data) + rows[i].bytes, rows[i + 1].data)
            << rows[i].name << " is not followed by " << rows[i + 1].name;
      total += rows[i].bytes;
    }
    EXPECT_EQ(total, m.footprint().activations + m.footprint().scratch);
    EXPECT_EQ(rows.back().name.rfind("scratch.", 0), 0u) << rows.back().name;
  }
}
