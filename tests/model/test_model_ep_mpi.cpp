// Expert parallelism at the model level (runtime/model/model_moe.cpp): every rank builds the same
// small MoE model twice, with ep = world size (the EP group is the world) and as an ep = 1
// reference over a one-rank group, from the same seed, and feeds both this rank's own tokens.
// The dispatch and combine must change nothing that the rank computes: its loss, its statistics,
// the input gradient of the MoE chunk and every dense weight gradient are the reference's, and
// each expert's weight gradient on the rank holding it is the sum over all ranks of the
// reference's gradient for that expert (what the data-parallel reduction without EP would hold).
// Run under mpirun -np 2 and -np 4 (E = 4: two experts per rank, or one).
#include <gtest/gtest.h>

#include <algorithm>
#include <cmath>
#include <cstdio>
#include <functional>
#include <random>
#include <string>
#include <utility>
#include <vector>

#include "kernels/arena.h"
#include "kernels/blas.h"
#include "kernels/gemm.h"
#include "kernels/ops.h"
#include "parallel/comm.h"
#include "runtime/model/model.h"
#include "tests/model/tiny_models.h"

using namespace t3d;
using runtime::Model;
using runtime::moe_config;

namespace {

constexpr int64_t kMoeLayer = 1;

struct Batch {
  std::vector<int32_t> tokens, targets;
};

Batch make_batch(int64_t rows, const runtime::ModelConfig& c, unsigned seed) {
  std::mt19937 rng(seed);
  Batch b;
  for (int64_t i = 0; i < rows * c.seq_len; ++i) {
    b.tokens.push_back(static_cast<int32_t>(rng() % c.vocab_size));
    b.targets.push_back(static_cast<int32_t>(rng() % c.vocab_size));
  }
  return b;
}

// What one training micro-batch leaves: the summed loss (grad_scale 1), the MoE statistics, the
// gradient of the MoE chunk's input and the gradient region.
struct Pass {
  double loss = 0, aux_loss = 0;
  std::vector<double> expert_counts, dropped_slots;
  std::vector<float> input_grad, grads;
};

// Two chunks, the dense block with the embedding and the MoE block with the head, so that the
// MoE chunk's input gradient is there to compare (a first chunk stops at the embedding). The
// caller moves activations and gradients between them as the pipeline executor would.
Pass train_pass(Model& m, const Batch& b) {
  m.state().grads.zero();
  m.reset_moe_stats();
  Pass p;
  m.forward(0, 0, b.tokens.data(), nullptr, 1.0f, true);
  std::copy_n(m.output(0, 0), m.io_floats(), m.input(1, 0));
  m.forward(1, 0, nullptr, b.targets.data(), 1.0f, true);
  p.loss = m.take_loss_sum();
  const int64_t waits = kernels::host_waits();
  m.backward(1, 0, nullptr);
  p.input_grad.assign(m.input_grad(1, 0), m.input_grad(1, 0) + m.io_floats());
  m.backward(0, 0, p.input_grad.data());
  // It reads the routing (and under EP the counts) its forward kept.
  EXPECT_EQ(kernels::host_waits(), waits) << "the backward made the host wait";
  p.aux_loss = m.aux_loss();
  p.expert_counts = m.expert_counts();
  p.dropped_slots = m.dropped_slots();
  p.grads.assign(m.state().grads.data(), m.state().grads.data() + m.layout().total_floats());
  return p;
}

// `rtol` 0: bit for bit. Otherwise every element within rtol of the largest magnitude of
// `expected` (a GEMM's rounding error scales with its sums, not with the element).
void expect_same(const float* actual, const float* expected, int64_t n, double rtol,
                 const std::string& what) {
  double scale = 0;
  for (int64_t i = 0; i < n; ++i) scale = std::max(scale, std::fabs(double(expected[i])));
  int64_t bad = 0;
  for (int64_t i = 0; i < n; ++i) {
    const bool same = rtol == 0 ? actual[i] == expected[i]
                                : std::fabs(double(actual[i]) - expected[i]) <= rtol * scale;
    if (!same && bad++ < 3)
      ADD_FAILURE() << what << "[" << i << "]: " << actual[i] << ", expected " << expected[i]
                    << (rtol == 0 ? " (bit for bit)" : " (within " + std::to_string(rtol) + ")");
  }
  EXPECT_EQ(bad, 0) << what << ": elements that differ";
}

struct Case {
  const char* what;
  int64_t experts_per_token = 2;
  double capacity_factor = 0;
  // The router's selection bias per expert on this rank (empty: as initialised, zeros). It picks
  // the experts without entering the gates (aux-loss-free balancing), so a large value forces
  // the choice and leaves the math as it is.
  std::function<std::vector<float>(int rank)> bias;
};

// The gradient of every routed expert tensor of `m`, in its params() order, one after the other.
std::vector<float> expert_grads(const Model& m, const std::vector<float>& grads) {
  std::vector<float> out;
  for (const auto& p : m.params()) {
    if (p.expert < 0) continue;
    const auto& t = m.layout().at(p.name);
    out.insert(out.end(), grads.begin() + t.offset, grads.begin() + t.offset + t.numel);
  }
  return out;
}

void check_case(const parallel::Comm& world, const parallel::Comm& self, const Case& c,
                kernels::GemmKind gemm, double rtol) {
  auto cfg = moe_config();
  cfg.experts_per_token = c.experts_per_token;
  cfg.capacity_factor = c.capacity_factor;
  const std::vector<parallel::LayerRange> chunks = {{0, 1, true, false}, {1, 2, false, true}};
  runtime::ModelOptions options{2, 1, false};
  options.exec = gemm;
  options.moe_aux_weight = 0.5;
  runtime::ModelOptions ep_options = options;
  ep_options.ep = &world;
  kernels::Arena arena(64 << 20);
  Model ep(cfg, chunks, self, arena, ep_options);
  Model reference(cfg, chunks, self, arena, options);
  ASSERT_EQ(ep.experts().size(cfg), cfg.n_experts / world.size());
  ep.init(5);
  reference.init(5);
  if (c.bias) {
    const std::vector<float> bias = c.bias(world.rank());
    const std::string name =
        runtime::block_param_name(kMoeLayer, runtime::BlockWeight::kRouterBias);
    for (Model* m : {&ep, &reference}) {
      const auto view = m->state().params.view(name);
      ASSERT_EQ(view.numel, static_cast<int64_t>(bias.size()));
      std::copy(bias.begin(), bias.end(), view.data);
    }
  }
  const Batch b = make_batch(2, cfg, 7 + 101 * static_cast<unsigned>(world.rank()));
  const Pass got = train_pass(ep, b), want = train_pass(reference, b);

  // What this rank computes of its own tokens.
  if (rtol == 0)
    EXPECT_EQ(got.loss, want.loss);
  else
    EXPECT_NEAR(got.loss, want.loss, rtol * std::fabs(want.loss));
  EXPECT_EQ(got.aux_loss, want.aux_loss) << "the router runs on this rank alone";
  EXPECT_EQ(got.expert_counts, want.expert_counts);
  EXPECT_EQ(got.dropped_slots, want.dropped_slots);
  expect_same(got.input_grad.data(), want.input_grad.data(),
              static_cast<int64_t>(want.input_grad.size()), rtol, "MoE chunk input gradient");

  // Dense tensors: this rank's own gradients. Experts: the sum over the ranks in rank order (the
  // order ExpertShape::part_offsets adds the sources in).
  const std::vector<float> mine = expert_grads(reference, want.grads);
  std::vector<float> all(mine.size() * static_cast<size_t>(world.size()));
  world.all_gather(mine.data(), all.data(), mine.size());
  int64_t experts_checked = 0;
  for (const auto& p : ep.params()) {
    const auto& t = ep.layout().at(p.name);
    const float* g = got.grads.data() + t.offset;
    if (p.expert < 0) {
      expect_same(g, want.grads.data() + reference.layout().at(p.name).offset, t.numel, rtol,
                  p.name);
      continue;
    }
    EXPECT_GE(p.expert, ep.experts().begin);
    EXPECT_LT(p.expert, ep.experts().begin + ep.experts().size(cfg));
    // Its place among the reference's expert tensors, which are in the same order.
    int64_t at = 0;
    for (const auto& q : reference.params()) {
      if (q.name == p.name) break;
      if (q.expert >= 0) at += reference.layout().at(q.name).numel;
    }
    std::vector<float> sum(static_cast<size_t>(t.numel), 0.0f);
    for (int r = 0; r < world.size(); ++r)
      for (int64_t i = 0; i < t.numel; ++i)
        sum[static_cast<size_t>(i)] += all[r * mine.size() + static_cast<size_t>(at + i)];
    expect_same(g, sum.data(), t.numel, rtol, p.name + " (sum over ranks)");
    ++experts_checked;
  }
  EXPECT_EQ(experts_checked, 3 * ep.experts().size(cfg)) << "gate, up, down per local expert";
}

std::vector<Case> cases(int ranks) {
  const auto cfg = moe_config();
  std::vector<Case> out;
  out.push_back({"normal routing", 2, 0, nullptr});
  // Experts E/2.. (the upper half of the ranks) win every token of every rank: the lower ranks
  // receive no rows and send all of theirs, the upper ones keep theirs and receive the rest.
  out.push_back({"every token to the upper ranks' experts", 2, 0, [cfg](int) {
                   std::vector<float> bias(static_cast<size_t>(cfg.n_experts), 0.0f);
                   for (int64_t e = cfg.n_experts / 2; e < cfg.n_experts; ++e) bias[e] = 10.0f;
                   return bias;
                 }});
  // One expert per token, and it is the last rank's last expert for every token: one expert
  // receives every slot of every rank.
  out.push_back({"every slot to one expert", 1, 0, [cfg](int) {
                   std::vector<float> bias(static_cast<size_t>(cfg.n_experts), 0.0f);
                   bias.back() = 10.0f;
                   return bias;
                 }});
  // Each rank's own choice of the expert that wins everything: rank r's tokens all go to rank
  // (r + 1) mod P's first expert, so every rank sends all and receives another rank's all.
  out.push_back({"each rank's slots to the next rank's expert", 1, 0, [cfg, ranks](int rank) {
                   std::vector<float> bias(static_cast<size_t>(cfg.n_experts), 0.0f);
                   bias[((rank + 1) % ranks) * (cfg.n_experts / ranks)] = 10.0f;
                   return bias;
                 }});
  // A capacity of 6 rows per expert (ceil(0.75 · 32 slots / 4 experts)): the slots past it drop
  // on their own rank, before any leaves it.
  out.push_back({"capacity factor 0.75 drops slots", 2, 0.75, nullptr});
  return out;
}

// Whether GEMMs of `kind` give each row of a product the same bits whatever rows surround it (an
// M-row GEMM against each row alone, M up to the experts' 32 rows, at the experts' widths, both
// the forward's and the input gradient's product). With EP an expert's GEMMs see other rows
// around a row than without.
bool rows_independent(kernels::GemmKind kind) {
  const auto cfg = moe_config();
  const int64_t C = cfg.dim, F = cfg.moe_ffn_dim;
  std::mt19937 rng(3);
  std::uniform_real_distribution<float> u(-1, 1);
  std::vector<float> w(static_cast<size_t>(C * F)), x(static_cast<size_t>(33 * C));
  for (auto& v : w) v = u(rng);
  for (auto& v : x) v = u(rng);
  for (const auto& [in, out] : {std::pair{C, F}, std::pair{F, C}}) {
    for (int64_t M = 1; M <= 33; ++M) {
      std::vector<float> all(static_cast<size_t>(M * out)), one(static_cast<size_t>(out));
      kernels::linear_forward(kind, all.data(), x.data(), w.data(), M, in, out);
      for (int64_t r = 0; r < M; ++r) {
        kernels::linear_forward(kind, one.data(), x.data() + r * in, w.data(), 1, in, out);
        if (!std::equal(one.begin(), one.end(), all.begin() + r * out)) return false;
      }
      // dx (M, in) = dy (M, out) · w (out, in)
      std::vector<float> dx_all(static_cast<size_t>(M * in)), dx_one(static_cast<size_t>(in));
      kernels::linear_backward_input(kind, dx_all.data(), x.data(), w.data(), M, in, out);
      for (int64_t r = 0; r < M; ++r) {
        kernels::linear_backward_input(kind, dx_one.data(), x.data() + r * out, w.data(), 1, in,
                                       out);
        if (!std::equal(dx_one.begin(), dx_one.end(), dx_all.begin() + r * in)) return false;
      }
    }
  }
  return true;
}

}  // namespace

// oneDNN's AVX-512 fp32 GEMMs compute a row's product independently of the other rows of the
// GEMM, and the sources' gradient parts are added in rank order: every comparison bit for bit.
// Its AVX2 kernels (a CPU without AVX-512, e.g. AMD Zen 3) round a row by its place in the GEMM,
// as OpenBLAS's tails do: there the comparison is OpenBLAS's, within 1e-5.
TEST(ModelEpMpi, DispatchAndCombineChangeNothingOneDnn) {
  auto world = parallel::Comm::world(60.0);
  ASSERT_EQ(moe_config().n_experts % world.size(), 0);
  const auto self = world.split(world.rank(), 0, "self");
  const bool independent = rows_independent(kernels::GemmKind::kOneDnnF32);
  const auto cpu = kernels::detect_cpu_features();
  if (cpu.avx512f && cpu.avx512bw && cpu.avx512vl) {
    EXPECT_TRUE(independent) << "oneDNN's AVX-512 fp32 GEMMs round a row by its place";
  }
  if (!independent && world.rank() == 0)
    std::printf(
        "oneDNN's fp32 GEMMs here round a row by its place: within 1e-5, not bit for bit\n");
  for (const Case& c : cases(world.size())) {
    SCOPED_TRACE(c.what);
    check_case(world, self, c, kernels::GemmKind::kOneDnnF32, independent ? 0 : 1e-5);
  }
}

// OpenBLAS's tail kernels round a row differently by its place in the GEMM, and the experts'
// GEMMs see other rows around a row with EP than without: the same math within 1e-5 of each
// tensor's largest magnitude (fp32 sums of at most C = 16 or Fe = 8 products per element, and
// of up to 32 rows per weight gradient, differ by a few ulps).
TEST(ModelEpMpi, DispatchAndCombineChangeNothingOpenBlas) {
  auto world = parallel::Comm::world(60.0);
  const auto self = world.split(world.rank(), 0, "self");
  for (const Case& c : cases(world.size())) {
    SCOPED_TRACE(c.what);
    check_case(world, self, c, kernels::GemmKind::kOpenBlasF32, 1e-5);
  }
}

// The capacity case really drops slots, and the forced cases route as they say: otherwise the
// cases above would test normal routing five times.
TEST(ModelEpMpi, TheCasesRouteAsIntended) {
  auto world = parallel::Comm::world(60.0);
  const auto self = world.split(world.rank(), 0, "self");
  const auto all = cases(world.size());
  for (const Case& c : all) {
    SCOPED_TRACE(c.what);
    auto cfg = moe_config();
    cfg.experts_per_token = c.experts_per_token;
    cfg.capacity_factor = c.capacity_factor;
    kernels::Arena arena(64 << 20);
    runtime::ModelOptions options{2, 1, false};
    options.ep = &world;
    Model m(cfg, {{0, 1, true, false}, {1, 2, false, true}}, self, arena, options);
    m.init(5);
    if (c.bias) {
      const std::vector<float> bias = c.bias(world.rank());
      const auto view = m.state().params.view(
          runtime::block_param_name(kMoeLayer, runtime::BlockWeight::kRouterBias));
      std::copy(bias.begin(), bias.end(), view.data);
    }
    const Pass p = train_pass(m, make_batch(2, cfg, 7 + 101 * static_cast<unsigned>(world.rank())));
    const double slots = 2.0 * cfg.seq_len * cfg.experts_per_token;
    double routed = 0;
    for (const double n : p.expert_counts) routed += n;
    EXPECT_EQ(routed, slots);
    const std::string what = c.what;
    if (c.capacity_factor > 0) {
      EXPECT_GT(p.dropped_slots[0], 0);
    }
    if (what == "every slot to one expert") {
      EXPECT_EQ(p.expert_counts.back(), slots);
    }
    if (what == "every token to the upper ranks' experts") {
      for (int64_t e = 0; e < cfg.n_experts / 2; ++e) EXPECT_EQ(p.expert_counts[e], 0) << e;
    }
  }
}

// The zero-bubble split (Model::backward_input, then backward_weight) leaves every weight-gradient
// GEMM of a block to W: for the MoE block its router, routed and shared experts' too, with and
// without expert parallelism. After B the matrices' gradients are still zero and their units not
// done (the norms', the embedding's and the head's, which B or the forward computes, already
// final); after W the whole gradient region is the unsplit backward's, bit for bit, and so is
// the input gradient: the same GEMMs on the same values, only later.
TEST(ModelEpMpi, SplitBackwardLeavesEveryWeightGradientToW) {
  auto world = parallel::Comm::world(60.0);
  const auto self = world.split(world.rank(), 0, "self");
  auto cfg = moe_config();
  cfg.qkv_bias = true;  // the q/k/v biases' gradients are W's too (dq, dk, dv kept for it)
  cfg.qk_norm = true;   // the q/k norms' are B's (as the other norms'); W's dq, dk are past them
  ASSERT_GT(cfg.n_shared_experts, 0);
  const std::vector<parallel::LayerRange> chunks = {{0, 1, true, false}, {1, 2, false, true}};
  for (const bool expert_parallel : {false, true})
    for (const bool bf16 : {false, true}) {
      SCOPED_TRACE(testing::Message() << (expert_parallel ? "ep = world" : "ep = 1")
                                      << (bf16 ? ", bf16 copies" : ", fp32"));
      runtime::ModelOptions options{2, 1, false};
      options.moe_aux_weight = 0.5;
      options.bf16 = bf16;
      if (expert_parallel) options.ep = &world;
      runtime::ModelOptions split_options = options;
      split_options.split_backward = true;
      kernels::Arena arena(64 << 20);
      Model whole(cfg, chunks, self, arena, options);
      Model split(cfg, chunks, self, arena, split_options);
      whole.init(5);
      split.init(5);
      const Batch b = make_batch(2, cfg, 7 + 101 * static_cast<unsigned>(world.rank()));
      const Pass want = train_pass(whole, b);

      std::vector<int64_t> done;  // units whose gradients a pass completed, in order
      for (const auto group : runtime::kStateGroups)
        split.set_grad_hook(group, [&done](int64_t unit) { done.push_back(unit); });
      split.state().grads.zero();
      split.forward(0, 0, b.tokens.data(), nullptr, 1.0f, true);
      std::copy_n(split.output(0, 0), split.io_floats(), split.input(1, 0));
      split.forward(1, 0, nullptr, b.targets.data(), 1.0f, true);
      EXPECT_EQ(split.take_loss_sum(), want.loss);
      const int64_t waits = kernels::host_waits();
      split.backward_input(1, 0, nullptr);
      const std::vector<float> input_grad(split.input_grad(1, 0),
                                          split.input_grad(1, 0) + split.io_floats());
      expect_same(input_grad.data(), want.input_grad.data(),
                  static_cast<int64_t>(input_grad.size()), 0, "MoE chunk input gradient after B");
      split.backward_input(0, 0, input_grad.data());
      // Only the head (done in the forward) and the embedding (B) are complete.
      EXPECT_EQ(done, (std::vector<int64_t>{cfg.n_layers, -1}));

      const float* grads = split.state().grads.data();
      int64_t deferred = 0, routed = 0;
      for (const auto& p : split.params()) {
        const auto& t = split.layout().at(p.name);
        const bool qkv_bias = p.name.ends_with("_proj.bias");
        const bool block_matrix = p.unit >= 0 && p.unit != cfg.n_layers && p.trained() &&
                                  (p.global_shape.size() == 2 || qkv_bias);
        const float* w = want.grads.data() + t.offset;
        if (!block_matrix) {  // norms, embedding, head, the untrained bias: final after B
          expect_same(grads + t.offset, w, t.numel, 0, p.name + " after B");
          continue;
        }
        ++deferred;
        routed += p.expert >= 0;
        EXPECT_TRUE(std::any_of(w, w + t.numel, [](float x) { return x != 0.0f; }))
            << p.name << ": the unsplit backward gives it no gradient, the check below is empty";
        EXPECT_TRUE(std::all_of(grads + t.offset, grads + t.offset + t.numel,
                                [](float x) { return x == 0.0f; }))
            << p.name << " has a gradient before W";
      }
      // Block 0: q, k, v, o, gate, up, down; block 1: q, k, v, o, router, the shared experts'
      // three and three per local expert; the q/k/v biases of both.
      EXPECT_EQ(routed, 3 * split.experts().size(cfg));
      EXPECT_EQ(deferred, 7 + 4 + 1 + 3 + routed + 6);

      split.backward_weight(1, 0);
      split.backward_weight(0, 0);
      EXPECT_EQ(kernels::host_waits(), waits) << "B or W made the host wait";
      const int64_t experts_unit = runtime::experts_unit(cfg, 1);
      EXPECT_EQ(done, (std::vector<int64_t>{cfg.n_layers, -1, 1, experts_unit, 0}));
      expect_same(grads, want.grads.data(), split.layout().total_floats(), 0,
                  "gradient region after W");
    }
}
