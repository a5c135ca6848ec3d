// Decoding with a KV cache: attention_decode against the double-precision reference, and the
// Decoder's logits at every position against a whole-sequence forward built from the training
// kernels (attention_forward, no cache); sampling is deterministic and top-k / greedy behave.
#include <gtest/gtest.h>

#include <cmath>
#include <set>
#include <string>
#include <vector>

#include "../kernels/reference.h"
#include "kernels/check.h"
#include "kernels/device.h"
#include "kernels/ops.h"
#include "kernels/ops_decode.h"
#include "runtime/use/generate.h"
#ifdef T3D_HAVE_CUDA
#include "kernels/cuda/cuda_ops.h"
#endif

namespace t3d::runtime {
namespace {

namespace k = t3d::kernels;
using k::ref::Vec;

constexpr k::GemmKind kFp32 = k::GemmKind::kOpenBlasF32;

TEST(use_decode, attention_decode_matches_reference_at_every_position) {
  const int T = 19, H = 6, Hkv = 2, D = 8;  // grouped-query: 3 query heads per kv head
  const auto q = k::ref::random_floats(size_t(T) * H * D, 1, -2, 2);
  const auto kk = k::ref::random_floats(size_t(T) * Hkv * D, 2, -2, 2);
  const auto v = k::ref::random_floats(size_t(T) * Hkv * D, 3);
  Vec expected;
  k::ref::attention(k::ref::to_double(q), k::ref::to_double(kk), k::ref::to_double(v), 1, T, H, Hkv,
                    D, &expected, nullptr);
  std::vector<float> out(size_t(H) * D), scores(T);
  for (int t = 0; t < T; ++t) {
    // Row t of causal attention is one query over the first t + 1 keys: the cache at step t.
    k::attention_decode(k::kCpu, out.data(), q.data() + size_t(t) * H * D, kk.data(), v.data(),
                        scores.data(), t + 1, H, Hkv, D);
    k::ref::expect_close(
        out, Vec(expected.begin() + size_t(t) * H * D, expected.begin() + size_t(t + 1) * H * D),
        1e-5, 1e-6, "attention_decode row");
  }
}

ModelConfig tiny_config() {
  return ModelConfig{.vocab_size = 40,
                     .dim = 32,
                     .n_layers = 2,
                     .n_heads = 4,
                     .n_kv_heads = 2,
                     .ffn_dim = 48,
                     .seq_len = 16};
}

SnapshotWeights random_weights(const ModelConfig& m) {
  SnapshotWeights w;
  w.path = "(random)";
  w.recipe.model = m;
  w.tensors = llama_tensor_table(m);
  uint32_t seed = 10;
  for (auto& t : w.tensors) {
    size_t n = 1;
    for (const int64_t d : t.shape) n *= static_cast<size_t>(d);
    // Norm weights near 1, matrices large enough that attention is far from uniform.
    t.data = t.shape.size() == 1 ? k::ref::random_floats(n, seed++, 0.8f, 1.2f)
                                 : k::ref::random_floats(n, seed++, -0.3f, 0.3f);
  }
  return w;
}

// The whole sequence at once, as Model::forward_layer computes it (no cache): (T, V) logits.
std::vector<float> full_forward(const SnapshotWeights& w, const std::vector<int32_t>& tokens) {
  const ModelConfig& m = w.recipe.model;
  const int64_t T = static_cast<int64_t>(tokens.size()), C = m.dim, D = m.head_dim();
  const int64_t H = m.n_heads, Hkv = m.n_kv_heads, F = m.ffn_dim, V = m.vocab_size;
  const float eps = static_cast<float>(m.norm_eps);
  const auto W = [&](const std::string& n) { return w.at(n).data.data(); };
  std::vector<float> x(T * C), xn(T * C), rstd(T), q(T * H * D), kk(T * Hkv * D), v(T * Hkv * D),
      att(T * H * D), lse(H * T), gate(T * F), up(T * F), h(T * F), rope(T * D), logits(T * V);
  const k::AttentionShape shape{1, T, H, Hkv, D, 8};
  std::vector<float> scratch(k::attention_scratch_floats(shape));
  k::rope_table(rope.data(), T, D, m.rope_theta, m.rope());
  k::embedding_forward(k::kCpu, x.data(), tokens.data(), W("model.embed_tokens.weight"), T, C, 0,
                       V);
  for (int64_t l = 0; l < m.n_layers; ++l) {
    const std::string p = "model.layers." + std::to_string(l) + ".";
    k::rmsnorm_forward(k::kCpu, xn.data(), rstd.data(), x.data(), W(p + "input_layernorm.weight"),
                       T, C, eps);
    k::linear_forward(kFp32, q.data(), xn.data(), W(p + "self_attn.q_proj.weight"), T, C, H * D);
    k::linear_forward(kFp32, kk.data(), xn.data(), W(p + "self_attn.k_proj.weight"), T, C, Hkv * D);
    k::linear_forward(kFp32, v.data(), xn.data(), W(p + "self_attn.v_proj.weight"), T, C, Hkv * D);
    for (int64_t t = 0; m.qkv_bias && t < T; ++t) {  // the biases, row by row
      k::add_inplace(k::kCpu, q.data() + t * H * D, W(p + "self_attn.q_proj.bias"), H * D);
      k::add_inplace(k::kCpu, kk.data() + t * Hkv * D, W(p + "self_attn.k_proj.bias"), Hkv * D);
      k::add_inplace(k::kCpu, v.data() + t * Hkv * D, W(p + "self_attn.v_proj.bias"), Hkv * D);
    }
    if (m.qk_norm) {  // per head: T·H rows of D (qn, kn take the normalised copies)
      std::vector<float> qn(q.size()), kn(kk.size()), head_rstd(T * H);
      k::rmsnorm_forward(k::kCpu, qn.data(), head_rstd.data(), q.data(),
                         W(p + "self_attn.q_norm.weight"), T * H, D, eps);
      k::rmsnorm_forward(k::kCpu, kn.data(), head_rstd.data(), kk.data(),
                         W(p + "self_attn.k_norm.weight"), T * Hkv, D, eps);
      q = qn, kk = kn;
    }
    k::rope_forward(k::kCpu, q.data(), q.data(), rope.data(), 1, T, H, D, 0);
    k::rope_forward(k::kCpu, kk.data(), kk.data(), rope.data(), 1, T, Hkv, D, 0);
    k::attention_forward(kFp32, att.data(), lse.data(), q.data(), kk.data(), v.data(),
                         scratch.data(), shape);
    k::linear_forward(kFp32, x.data(), att.data(), W(p + "self_attn.o_proj.weight"), T, H * D, C,
                      k::Out::kAccumulate);
    k::rmsnorm_forward(k::kCpu, xn.data(), rstd.data(), x.data(),
                       W(p + "post_attention_layernorm.weight"), T, C, eps);
    k::linear_forward(kFp32, gate.data(), xn.data(), W(p + "mlp.gate_proj.weight"), T, C, F);
    k::linear_forward(kFp32, up.data(), xn.data(), W(p + "mlp.up_proj.weight"), T, C, F);
    k::swiglu_forward(k::kCpu, h.data(), gate.data(), up.data(), T * F);
    k::linear_forward(kFp32, x.data(), h.data(), W(p + "mlp.down_proj.weight"), T, F, C,
                      k::Out::kAccumulate);
  }
  k::rmsnorm_forward(k::kCpu, xn.data(), rstd.data(), x.data(), W("model.norm.weight"), T, C, eps);
  k::linear_forward(kFp32, logits.data(), xn.data(), W("lm_head.weight"), T, C, V);
  return logits;
}

// The Decoder's logits at every position against full_forward's, a full cache refused.
void expect_cached_logits_match(const ModelConfig& m) {
  const SnapshotWeights w = random_weights(m);
  std::vector<int32_t> tokens;
  for (int t = 0; t < m.seq_len; ++t) tokens.push_back((7 * t + 3) % m.vocab_size);
  const std::vector<float> expected = full_forward(w, tokens);
  Decoder decoder(w, kFp32);
  double worst = 0;
  for (int t = 0; t < m.seq_len; ++t) {
    const auto logits = decoder.step(tokens[t]);
    ASSERT_EQ(static_cast<int64_t>(logits.size()), m.vocab_size);
    for (int64_t j = 0; j < m.vocab_size; ++j)
      worst = std::max(worst, double(std::abs(logits[j] - expected[t * m.vocab_size + j])));
  }
  EXPECT_LT(worst, 1e-4) << "decoder vs whole-sequence logits";
  EXPECT_THROW(decoder.step(0), UserError) << "a full cache refuses another token";
  decoder.reset();  // and starts over at position 0 with the same result
  const auto again = decoder.step(tokens[0]);
  for (int64_t j = 0; j < m.vocab_size; ++j) EXPECT_NEAR(again[j], expected[j], 1e-4);
}

TEST(use_decode, cached_logits_match_whole_sequence_forward) {
  expect_cached_logits_match(tiny_config());
}

// Llama 3's RoPE scaling in the decoder's table: with a pretraining context of 8 positions the
// head's lowest frequency is smoothed and the others slowed 4×, so a decoder that left the table
// unscaled would differ from the whole-sequence forward within the 16 positions. Heads 12 wide
// over dim 32 (model.head_dim): the cache and the projections are n_heads·head_dim wide.
TEST(use_decode, cached_logits_match_with_scaled_rope_and_wide_heads) {
  ModelConfig m = tiny_config();
  m.explicit_head_dim = 12;
  m.rope_scaling = k::RopeScaling::Kind::kLlama3;
  m.rope_factor = 4.0;
  m.rope_low_freq_factor = 1.0;
  m.rope_high_freq_factor = 2.0;
  m.rope_original_seq_len = 8;
  expect_cached_logits_match(m);
  m.rope_scaling = k::RopeScaling::Kind::kLinear;
  expect_cached_logits_match(m);
}

// q/k/v biases (model.qkv_bias; random here, about 1): added to q and to the cached k and v.
TEST(use_decode, cached_logits_match_with_qkv_biases) {
  ModelConfig m = tiny_config();
  m.qkv_bias = true;
  expect_cached_logits_match(m);
}

// Per-head q/k norms (model.qk_norm; weights random about 1) after the biases, heads 12 wide:
// applied to q and to the cached k.
TEST(use_decode, cached_logits_match_with_qk_norm) {
  ModelConfig m = tiny_config();
  m.qk_norm = true;
  expect_cached_logits_match(m);
  m.qkv_bias = true;
  m.explicit_head_dim = 12;
  expect_cached_logits_match(m);
}

#ifdef T3D_HAVE_CUDA
// The decoder on a GPU (its weights copied into device memory, each op's CUDA twin, the logits
// crossing once a token): the CPU decoder's logits within 1e-4 at every position, with q/k/v
// biases and per-head norms on; and a full cache refused there too.
TEST(use_decode, gpu_logits_match_the_cpus) {
  std::string why;
  if (k::cuda::visible_devices(&why).empty()) GTEST_SKIP() << "no GPU: " << why;
  const auto device = k::Device::open(k::DeviceChoice::kCuda, 0);
  ModelConfig m = tiny_config();
  m.qkv_bias = m.qk_norm = true;
  const SnapshotWeights w = random_weights(m);
  Decoder cpu(w, kFp32), gpu(w, device->exec(kFp32));
  double worst = 0;
  for (int t = 0; t < m.seq_len; ++t) {
    const auto a = cpu.step((5 * t + 1) % m.vocab_size);
    const auto b = gpu.step((5 * t + 1) % m.vocab_size);
    ASSERT_EQ(a.size(), b.size());
    for (size_t j = 0; j < a.size(); ++j) worst = std::max(worst, double(std::abs(a[j] - b[j])));
  }
  EXPECT_LT(worst, 1e-4) << "GPU decoder vs CPU decoder";
  EXPECT_THROW(gpu.step(0), UserError);
}
#endif

TEST(use_decode, greedy_and_seeded_sampling_are_deterministic) {
  const ModelConfig m = tiny_config();
  const SnapshotWeights w = random_weights(m);
  const std::vector<int32_t> prompt = {1, 2, 3};
  const auto run = [&](const SamplingOptions& o, int64_t n = 40) {
    Decoder d(w, kFp32);
    return generate(d, prompt, n, m.vocab_size, o);
  };
  // 40 new tokens after a 3-token prompt pass the 16-position context twice: the cache refills.
  const auto greedy = run({0.0, 0, 1});
  EXPECT_EQ(greedy.size(), 40u);
  EXPECT_EQ(greedy, run({0.0, 0, 99})) << "greedy ignores the seed";
  EXPECT_EQ(greedy, run({1.0, 1, 5})) << "top-k = 1 is greedy";
  const auto a = run({1.0, 0, 7}), b = run({1.0, 0, 7}), c = run({1.0, 0, 8});
  EXPECT_EQ(a, b) << "same seed, same tokens";
  EXPECT_NE(a, c) << "another seed, other tokens";
  // The first greedy token is the argmax of the prompt's last logits.
  Decoder d(w, kFp32);
  std::span<const float> logits;
  for (const int32_t t : prompt) logits = d.step(t);
  EXPECT_EQ(greedy[0], std::max_element(logits.begin(), logits.end()) - logits.begin());
}

TEST(use_decode, top_k_and_vocab_limit_bound_the_choice) {
  // Logits 0..9: top-3 keeps ids 7, 8, 9; a vocab limit of 5 keeps ids 0..4.
  std::vector<float> logits(10);
  for (int i = 0; i < 10; ++i) logits[i] = static_cast<float>(i);
  std::mt19937_64 rng(3);
  std::set<int32_t> top3, limited;
  for (int i = 0; i < 300; ++i) {
    top3.insert(pick_token(logits, 10, {5.0, 3, 0}, rng));
    limited.insert(pick_token(logits, 5, {5.0, 0, 0}, rng));
  }
  EXPECT_EQ(top3, (std::set<int32_t>{7, 8, 9}));
  EXPECT_EQ(limited, (std::set<int32_t>{0, 1, 2, 3, 4}));
  EXPECT_EQ(pick_token(logits, 5, {0.0, 0, 0}, rng), 4) << "greedy within the limit";
}

TEST(use_decode, empty_prompt_is_a_user_error) {
  const SnapshotWeights w = random_weights(tiny_config());
  Decoder d(w, kFp32);
  EXPECT_THROW(generate(d, {}, 5, 40, {}), UserError);
}

}  // namespace
}  // namespace t3d::runtime
