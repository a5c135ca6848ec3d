// The whole Model on a GPU (issue 40's first training check): a dense LLaMA block stack built in a
// device arena and driven through its CUDA Exec (embedding, RMSNorm, RoPE, tiled attention, the
// SwiGLU MLP through LinearInput, the fused loss, AdamW), and a mixture of experts on it (the MoE
// ops' twins), trains as the same Model does on the CPU within fp32 reordering tolerances, and
// two GPU runs give the same bits. One rank, no MPI: the
// tp group is a group of one, on which the Model calls no collective. Each test needs a GPU and
// skips with the reason where the process sees none (here: compiled, not run).
#include <gtest/gtest.h>

#include <algorithm>
#include <cmath>
#include <memory>
#include <optional>
#include <random>
#include <string>
#include <vector>

#include "kernels/arena.h"
#include "kernels/check.h"
#include "kernels/cuda/cuda_ops.h"
#include "kernels/gemm.h"
#include "kernels/ops.h"
#include "parallel/tensor_comm.h"
#include "runtime/model/model.h"
#include "tests/kernels/the_gpu.h"

namespace t3d::runtime {
namespace {

// A tensor group of one rank: the Model with tp = 1 calls none of these, so each is a failure.
class GroupOfOne final : public parallel::TensorComm {
 public:
  int rank() const override { return 0; }
  int size() const override { return 1; }
  void all_reduce(float*, size_t, parallel::ReduceOp) const override { unused(); }
  void all_reduce_bf16(uint16_t*, size_t) const override { unused(); }
  void all_gather(const float*, float*, size_t) const override { unused(); }
  void all_gather(const uint16_t*, uint16_t*, size_t) const override { unused(); }
  void reduce_scatter(const float*, float*, size_t) const override { unused(); }
  void reduce_scatter_bf16(const uint16_t*, uint16_t*, size_t) const override { unused(); }
  void recv(float*, size_t, int, int) const override { unused(); }
  void recv(uint16_t*, size_t, int, int) const override { unused(); }
  parallel::Request isend(const float*, size_t, int, int) const override { return unused(); }
  parallel::Request isend(const uint16_t*, size_t, int, int) const override { return unused(); }
  parallel::Request iall_reduce_sum(float*, size_t, const char*, int64_t) const override {
    return unused();
  }
  parallel::Request ireduce_scatter_sum(float*, const std::vector<int>&, const char*,
                                        int64_t) const override {
    return unused();
  }
  parallel::Request iall_gatherv(const float*, float*, const std::vector<int>&,
                                 const std::vector<int>&, const char*, int64_t) const override {
    return unused();
  }
  void start_all_to_allv(parallel::Exchange&, const float*, const std::vector<int>&,
                         const std::vector<int>&, float*, const std::vector<int>&,
                         const std::vector<int>&, size_t) const override {
    unused();
  }
  void start_all_to_allv(parallel::Exchange&, const uint16_t*, const std::vector<int>&,
                         const std::vector<int>&, uint16_t*, const std::vector<int>&,
                         const std::vector<int>&, size_t) const override {
    unused();
  }
  void wait(parallel::Request&, const char*, int) const override { unused(); }
  bool test(parallel::Request&) const override { return unused().pending; }
  void release(parallel::Request&) const override { unused(); }

 private:
  static parallel::Request unused() {
    ADD_FAILURE() << "a one-rank Model called a collective";
    return {};
  }
};

using kernels::cuda::testing::the_gpu;

// Big enough that every kernel tiles (attention's 64-row tiles, several GEMM blocks), small
// enough for a second: 2 layers, GQA 4:2, head_dim 16.
ModelConfig config() {
  return ModelConfig{.vocab_size = 96,
                     .dim = 64,
                     .n_layers = 2,
                     .n_heads = 4,
                     .n_kv_heads = 2,
                     .ffn_dim = 160,
                     .seq_len = 80};
}

struct TrainedRun {
  std::vector<double> losses;
  std::vector<double> aux_losses;    // a mixture of experts' weighted auxiliary loss per step
  std::vector<double> routed;        // its tokens per expert over the steps (expert_counts)
  std::vector<float> grads, params;  // after the last step's backward / AdamW
};

// Qwen's attention: q/k/v biases, per-head q/k norms (RMSNorm rows of head_dim 24), heads wider
// than dim / n_heads.
ModelConfig qwen_config() {
  ModelConfig c = config();
  c.qkv_bias = true;
  c.qk_norm = true;
  c.explicit_head_dim = 24;
  return c;
}

// A mixture of experts on the same stack (issue 40's MoE check): block 0 dense, block 1 of 4
// routed experts (2 per token) of width 48 and a shared expert, the selection bias and the
// auxiliary loss, so that every MoE op runs: the router, the routing's host crossing, the grouped
// experts (one cuBLAS GEMM per expert on a GPU), the combine, the auxiliary loss's host value.
ModelConfig moe_config() {
  ModelConfig c = config();
  c.n_experts = 4;
  c.experts_per_token = 2;
  c.n_shared_experts = 1;
  c.moe_ffn_dim = 48;
  c.dense_layers = 1;
  c.router_bias_rate = 1e-3;
  c.router_aux_coef = 0.1;
  return c;
}

// The other router: sigmoid scores, gates not normalised but scaled, and a capacity that drops
// slots (a factor of 1 over 160 tokens' 320 slots: 80 a expert).
ModelConfig moe_sigmoid_capacity_config() {
  ModelConfig c = moe_config();
  c.router_score = kernels::RouterScore::kSigmoid;
  c.router_norm_topk = false;
  c.router_scale = 2.0;
  c.capacity_factor = 1.0;
  return c;
}

// `steps` AdamW steps of one micro-batch of 2 sequences, GEMMs of exec's kind, on `exec` (arena
// memory `memory`); with `bf16` the activations are stored as bf16 copies (train.precision =
// bf16). The losses, and the state read back to the host.
// `rounded_weights`: each step's passes read the weights' bf16 copy (RoundedWeights), as the
// trainer's do.
TrainedRun train(const kernels::Exec& exec, kernels::Memory memory, int steps, bool bf16 = false,
                 const ModelConfig& cfg = config(), bool rounded_weights = false) {
  const int64_t rows = 2, N = rows * cfg.seq_len;
  std::mt19937 rng(11);
  std::vector<int32_t> tokens(static_cast<size_t>(N)), targets(static_cast<size_t>(N));
  for (auto& t : tokens) t = static_cast<int32_t>(rng() % cfg.vocab_size);
  for (auto& t : targets) t = static_cast<int32_t>(rng() % cfg.vocab_size);
  const GroupOfOne one;
  kernels::Arena arena(std::size_t{64} << 20, memory);
  ModelOptions options{rows, 1, true};
  options.exec = exec;
  options.bf16 = bf16;
  options.moe_aux_weight = cfg.router_aux_coef / static_cast<double>(rows);  // as the stage's
  Model m(cfg, {{0, cfg.n_layers, true, true}}, one, arena, options);
  m.init(5);
  const auto& s = m.state();
  const int64_t n = s.params.size();
  kernels::AdamWConfig adam;
  adam.lr = 1e-2f;
  adam.weight_decay = 0.1f;
  TrainedRun r;
  for (int step = 1; step <= steps; ++step) {
    kernels::zero(exec, s.grads.data(), n);
    {
      std::optional<RoundedWeights> rounded;
      if (rounded_weights) rounded.emplace(m);
      m.forward(0, 0, tokens.data(), targets.data(), 1.0f / N, true);
      r.losses.push_back(m.take_loss_sum());
      r.aux_losses.push_back(m.aux_loss());
      m.backward(0, 0, nullptr);
    }
    if (step == steps) {
      r.grads.resize(static_cast<size_t>(n));
      kernels::copy_to_host(exec, r.grads.data(), s.grads.data(), n * sizeof(float));
    }
    kernels::adamw_step(exec, s.params.data(), s.grads.data(), s.adam_m.data(), s.adam_v.data(), n,
                        adam, step);
  }
  r.routed = m.expert_counts();
  r.params.resize(static_cast<size_t>(n));
  kernels::copy_to_host(exec, r.params.data(), s.params.data(), n * sizeof(float));
  return r;
}

// The largest |a - b| over the largest |b|: a whole-tensor relative difference.
double relative_difference(const std::vector<float>& a, const std::vector<float>& b) {
  double diff = 0, scale = 0;
  for (size_t i = 0; i < a.size(); ++i) {
    diff = std::max(diff, std::fabs(static_cast<double>(a[i]) - b[i]));
    scale = std::max(scale, std::fabs(static_cast<double>(b[i])));
  }
  return diff / scale;
}

// Two runs of one kind: the same bits (no atomics in reductions, fixed cuBLAS algorithms).
void expect_same_bits(const TrainedRun& a, const TrainedRun& b) {
  EXPECT_EQ(a.losses, b.losses);
  EXPECT_EQ(a.aux_losses, b.aux_losses);
  EXPECT_EQ(a.grads, b.grads);
  EXPECT_EQ(a.params, b.params);
}

// A GPU run against the CPU's: the same arithmetic summed in another order (GEMM blocking,
// attention tiles), so fp32 reordering differences compounded over the steps' updates: per-step
// losses (and auxiliary losses) within 1e-5, gradients within 1e-4 and parameters within 1e-5 of
// the tensors' scale.
void expect_follows_cpu(const TrainedRun& gpu, const TrainedRun& cpu) {
  ASSERT_EQ(gpu.losses.size(), cpu.losses.size());
  ASSERT_EQ(gpu.aux_losses.size(), cpu.aux_losses.size());
  for (size_t i = 0; i < cpu.losses.size(); ++i)
    EXPECT_NEAR(gpu.losses[i], cpu.losses[i], 1e-5 * std::fabs(cpu.losses[i])) << "step " << i;
  for (size_t i = 0; i < cpu.aux_losses.size(); ++i)
    EXPECT_NEAR(gpu.aux_losses[i], cpu.aux_losses[i], 1e-5 * std::fabs(cpu.aux_losses[i]))
        << "step " << i;
  EXPECT_LT(relative_difference(gpu.grads, cpu.grads), 1e-4);
  EXPECT_LT(relative_difference(gpu.params, cpu.params), 1e-5);
}

// A bf16 run against the fp32 run of its device: every step's loss within 2% (bf16 rounding of
// GEMM inputs, compounded over the steps), the rounding visible, and it trains.
void expect_bf16_follows(const TrainedRun& bf16, const TrainedRun& fp32) {
  ASSERT_EQ(bf16.losses.size(), fp32.losses.size());
  for (size_t i = 0; i < fp32.losses.size(); ++i)
    EXPECT_NEAR(bf16.losses[i], fp32.losses[i], 2e-2 * std::fabs(fp32.losses[i])) << "step " << i;
  EXPECT_NE(bf16.losses, fp32.losses);  // the bf16 path ran: its rounding shows
  EXPECT_LT(bf16.losses.back(), bf16.losses.front());
}

// The harness itself, where no GPU is needed: the one-rank Model without MPI trains on the CPU
// (the loss falls) and repeats its bits, so a GPU failure above is the GPU's.
TEST(GpuModel, TheCpuRunItComparesWithTrainsAndRepeats) {
  const TrainedRun a = train(kernels::GemmKind::kOpenBlasF32, kernels::Memory::kHost, 4);
  const TrainedRun b = train(kernels::GemmKind::kOpenBlasF32, kernels::Memory::kHost, 4);
  expect_same_bits(a, b);
  EXPECT_LT(a.losses.back(), 0.9 * a.losses.front());
  EXPECT_TRUE(std::any_of(a.grads.begin(), a.grads.end(), [](float g) { return g != 0.0f; }));
}

// The bf16 harness on the CPU (where oneDNN runs bf16 GEMMs): it repeats its bits, trains, and
// stays within the 2% the GPU's bf16 test allows of the fp32 run.
TEST(GpuModel, TheCpuBf16RunTrainsRepeatsAndFollowsFp32) {
  try {
    kernels::verify_gemm_kind(kernels::GemmKind::kOneDnnBf16);
  } catch (const GemmUnavailable& e) {
    GTEST_SKIP() << "no bf16 GEMM on this CPU: " << e.reason();
  }
  const TrainedRun fp32 = train(kernels::GemmKind::kOpenBlasF32, kernels::Memory::kHost, 4);
  const TrainedRun a = train(kernels::GemmKind::kOneDnnBf16, kernels::Memory::kHost, 4, true);
  const TrainedRun b = train(kernels::GemmKind::kOneDnnBf16, kernels::Memory::kHost, 4, true);
  expect_same_bits(a, b);
  expect_bf16_follows(a, fp32);
}

TEST(GpuModel, DenseTrainingStepsAreTheCpusAndRepeatBitForBit) {
  REQUIRE_GPU();
  constexpr int kSteps = 4;
  const kernels::Exec on_gpu(kernels::GemmKind::kOpenBlasF32, *the_gpu().stream);
  const TrainedRun cpu = train(kernels::GemmKind::kOpenBlasF32, kernels::Memory::kHost, kSteps);
  const TrainedRun first = train(on_gpu, kernels::Memory::kDevice, kSteps);
  const TrainedRun second = train(on_gpu, kernels::Memory::kDevice, kSteps);
  expect_same_bits(first, second);
  expect_follows_cpu(first, cpu);
  // And it trained: the loss fell (lr 1e-2 on one repeated batch).
  EXPECT_LT(first.losses.back(), first.losses.front());
}

// train.precision = bf16 on the GPU: bf16-stored activations whose copies feed cuBLAS's bf16 GEMMs
// (LinearInput's kFilled copies, the fused bf16 SwiGLU), fp32 attention and optimizer. Two runs
// give the same bits; the losses stay within 2% of the GPU's fp32 run (bf16 rounding of GEMM
// inputs, compounded over the steps) and it trains.
TEST(GpuModel, Bf16TrainingStepsRepeatBitForBitAndFollowFp32) {
  REQUIRE_GPU();
  constexpr int kSteps = 4;
  const kernels::Exec fp32(kernels::GemmKind::kOpenBlasF32, *the_gpu().stream);
  const kernels::Exec bf16(kernels::GemmKind::kOneDnnBf16, *the_gpu().stream);
  const TrainedRun reference = train(fp32, kernels::Memory::kDevice, kSteps);
  const TrainedRun first = train(bf16, kernels::Memory::kDevice, kSteps, /*bf16=*/true);
  const TrainedRun second = train(bf16, kernels::Memory::kDevice, kSteps, /*bf16=*/true);
  expect_same_bits(first, second);
  expect_bf16_follows(first, reference);
  // The trainer's passes read the weights' bf16 copy: the same bits.
  expect_same_bits(first, train(bf16, kernels::Memory::kDevice, kSteps, true, config(), true));
}

// The same with Qwen's attention (model.qkv_bias, model.qk_norm, head_dim 24): the biases' K = 1
// GEMMs and the per-head norms run on the GPU as on the CPU.
TEST(GpuModel, QwenAttentionTrainingStepsAreTheCpus) {
  REQUIRE_GPU();
  constexpr int kSteps = 4;
  const kernels::Exec on_gpu(kernels::GemmKind::kOpenBlasF32, *the_gpu().stream);
  const ModelConfig cfg = qwen_config();
  const TrainedRun cpu =
      train(kernels::GemmKind::kOpenBlasF32, kernels::Memory::kHost, kSteps, false, cfg);
  const TrainedRun first = train(on_gpu, kernels::Memory::kDevice, kSteps, false, cfg);
  const TrainedRun second = train(on_gpu, kernels::Memory::kDevice, kSteps, false, cfg);
  expect_same_bits(first, second);
  expect_follows_cpu(first, cpu);
}

// The MoE harness on the CPU, for both routers: it repeats its bits, trains, routes to every
// expert and adds an auxiliary loss, so that the GPU's comparisons below compare a run that
// exercises every MoE op.
TEST(GpuModel, TheCpuMoeRunItComparesWithTrainsAndRepeats) {
  for (const ModelConfig& cfg : {moe_config(), moe_sigmoid_capacity_config()}) {
    SCOPED_TRACE(cfg.capacity_factor > 0 ? "sigmoid, capacity" : "softmax, dropless");
    const TrainedRun a =
        train(kernels::GemmKind::kOpenBlasF32, kernels::Memory::kHost, 4, false, cfg);
    const TrainedRun b =
        train(kernels::GemmKind::kOpenBlasF32, kernels::Memory::kHost, 4, false, cfg);
    expect_same_bits(a, b);
    EXPECT_LT(a.losses.back(), a.losses.front());
    ASSERT_EQ(a.routed.size(), 4u);  // one MoE block
    double routed = 0;
    for (double n : a.routed) {
      EXPECT_GT(n, 0.0);
      routed += n;
    }
    EXPECT_EQ(routed, 4.0 * 160 * 2);  // steps x tokens x K (counted before any capacity drop)
    for (double aux : a.aux_losses) EXPECT_GT(aux, 0.0);
  }
}

// A mixture of experts on the GPU against the CPU: the routing on the device (its scores within
// CUDA's expf of the CPU's, so the same choices here), the permutation through the host, the
// experts' GEMMs (cuBLAS, one per expert), the combine and the auxiliary loss; two GPU runs give
// the same bits. Tolerances as the dense test's: fp32 sums in another order, compounded over the
// steps' updates.
TEST(GpuModel, MoeTrainingStepsAreTheCpusAndRepeatBitForBit) {
  REQUIRE_GPU();
  constexpr int kSteps = 4;
  const kernels::Exec on_gpu(kernels::GemmKind::kOpenBlasF32, *the_gpu().stream);
  for (const ModelConfig& cfg : {moe_config(), moe_sigmoid_capacity_config()}) {
    SCOPED_TRACE(cfg.capacity_factor > 0 ? "sigmoid, capacity" : "softmax, dropless");
    const TrainedRun cpu =
        train(kernels::GemmKind::kOpenBlasF32, kernels::Memory::kHost, kSteps, false, cfg);
    const TrainedRun first = train(on_gpu, kernels::Memory::kDevice, kSteps, false, cfg);
    const TrainedRun second = train(on_gpu, kernels::Memory::kDevice, kSteps, false, cfg);
    expect_same_bits(first, second);
    EXPECT_EQ(first.routed, cpu.routed);  // the same choices
    expect_follows_cpu(first, cpu);
    EXPECT_LT(first.losses.back(), first.losses.front());
  }
}

// The mixture of experts in bf16 on the GPU (bf16-stored activations, the experts' fused bf16
// SwiGLU, their rows gathered rounded): two runs give the same bits, within 2% of the GPU's fp32
// run, and it trains.
TEST(GpuModel, MoeBf16TrainingStepsRepeatBitForBitAndFollowFp32) {
  REQUIRE_GPU();
  constexpr int kSteps = 4;
  const kernels::Exec fp32(kernels::GemmKind::kOpenBlasF32, *the_gpu().stream);
  const kernels::Exec bf16(kernels::GemmKind::kOneDnnBf16, *the_gpu().stream);
  const ModelConfig cfg = moe_config();
  const TrainedRun reference = train(fp32, kernels::Memory::kDevice, kSteps, false, cfg);
  const TrainedRun first = train(bf16, kernels::Memory::kDevice, kSteps, true, cfg);
  const TrainedRun second = train(bf16, kernels::Memory::kDevice, kSteps, true, cfg);
  expect_same_bits(first, second);
  expect_bf16_follows(first, reference);
  expect_same_bits(first, train(bf16, kernels::Memory::kDevice, kSteps, true, cfg, true));
}

}  // namespace
}  // namespace t3d::runtime
