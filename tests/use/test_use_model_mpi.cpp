// The decoder and the exporter against the training Model itself (one rank, so under mpirun -np 1):
// llama_tensor_table names and shapes Model's parameter table exactly, and the decoder's logits,
// fed the Model's own weights, give the loss Model::forward computes for the same sequence.
#include <gtest/gtest.h>

#include <cmath>

#include "kernels/arena.h"
#include "kernels/check.h"
#include "parallel/comm.h"
#include "runtime/model/model.h"
#include "runtime/use/export.h"
#include "runtime/use/generate.h"

using namespace t3d;

namespace {

runtime::ModelConfig config(bool tied) {
  return runtime::ModelConfig{.vocab_size = 24,
                              .dim = 32,
                              .n_layers = 3,
                              .n_heads = 4,
                              .n_kv_heads = 2,
                              .ffn_dim = 40,
                              .seq_len = 12,
                              .tie_embeddings = tied};
}

}  // namespace

TEST(UseModelMpi, TensorTableIsTheModelsParameterTable) {
  auto world = parallel::Comm::world(60.0);
  const auto self = world.split(world.rank(), 0, "self");
  for (const bool tied : {false, true}) {
    const auto cfg = config(tied);
    kernels::Arena arena(64 << 20);
    runtime::Model m(cfg, {{0, cfg.n_layers, true, true}}, self, arena, {1, 1, false});
    const auto table = runtime::llama_tensor_table(cfg);
    ASSERT_EQ(table.size(), m.params().size()) << "tied " << tied;
    for (size_t i = 0; i < table.size(); ++i) {
      EXPECT_EQ(table[i].name, m.params()[i].name);
      EXPECT_EQ(table[i].shape, m.params()[i].global_shape) << table[i].name;
    }
  }
}

namespace {

// The decoder's loss over one sequence, fed the weights of a Model of `cfg`, equals the Model's.
void expect_decoder_loss_equals_model(const runtime::ModelConfig& cfg) {
  auto world = parallel::Comm::world(60.0);
  const auto self = world.split(world.rank(), 0, "self");
  kernels::Arena arena(64 << 20);
  runtime::Model m(cfg, {{0, cfg.n_layers, true, true}}, self, arena, {1, 1, false});
  m.init(5);
  // Larger weights than the init's 0.02 so attention and the MLP matter to the loss.
  for (float* p = m.state().params.data(); p != m.state().params.data() + m.state().params.size();
       ++p)
    *p *= 10.0f;
  // q/k/v biases start at zero: give them values, so that both sides must add them.
  for (const auto& p : m.params()) {
    if (!p.name.ends_with("_proj.bias")) continue;
    const auto b = m.state().params.view(p.name);
    for (int64_t i = 0; i < b.numel; ++i) b.data[i] = 0.5f * std::sin(0.7f * static_cast<float>(i));
  }
  // q/k norm weights (ones, then 10): about 1, different per element, so that both sides must
  // apply them with the same weights.
  for (const auto& p : m.params()) {
    if (!p.name.ends_with("q_norm.weight") && !p.name.ends_with("k_norm.weight")) continue;
    const auto g = m.state().params.view(p.name);
    for (int64_t i = 0; i < g.numel; ++i) g.data[i] = 1.0f + 0.3f * std::cos(static_cast<float>(i));
  }
  std::vector<int32_t> tokens, targets;
  for (int64_t t = 0; t < cfg.seq_len; ++t) {
    tokens.push_back(static_cast<int32_t>((5 * t + 1) % cfg.vocab_size));
    targets.push_back(static_cast<int32_t>((3 * t + 2) % cfg.vocab_size));
  }
  m.forward(0, 0, tokens.data(), targets.data(), 0.0f, false);
  const double model_loss = m.take_loss_sum();

  runtime::SnapshotWeights w;
  w.recipe.model = cfg;
  w.tensors = runtime::llama_tensor_table(cfg);
  for (auto& t : w.tensors) {
    const auto v = m.state().params.view(t.name);
    t.data.assign(v.data, v.data + v.numel);
  }
  runtime::Decoder decoder(w, kernels::GemmKind::kOpenBlasF32);  // the Model's default kind
  double decoder_loss = 0;
  for (int64_t t = 0; t < cfg.seq_len; ++t) {
    const auto logits = decoder.step(tokens[t]);
    double max = logits[0], sum = 0;
    for (const float x : logits) max = std::max<double>(max, x);
    for (const float x : logits) sum += std::exp(x - max);
    decoder_loss += std::log(sum) + max - logits[targets[t]];
  }
  EXPECT_GT(model_loss, 1.0);
  EXPECT_NEAR(decoder_loss, model_loss, 1e-5 * model_loss)
      << "the decoder (KV cache, one row at a time) and Model::forward (whole sequence)";
}

}  // namespace

TEST(UseModelMpi, DecoderLossEqualsModelForward) {
  expect_decoder_loss_equals_model(config(false));
}

// Llama 3's scaled RoPE (a pretraining context of 4 positions, so it scales within the 12) and
// heads 10 wide over dim 32: the Model's table and shapes are the decoder's (test_decode checks
// the decoder against the definition).
TEST(UseModelMpi, DecoderLossEqualsModelForwardWithScaledRopeAndWideHeads) {
  auto cfg = config(false);
  cfg.explicit_head_dim = 10;
  cfg.rope_scaling = kernels::RopeScaling::Kind::kLlama3;
  cfg.rope_factor = 8.0;
  cfg.rope_high_freq_factor = 3.0;
  cfg.rope_original_seq_len = 4;
  expect_decoder_loss_equals_model(cfg);
}

// q/k/v biases (model.qkv_bias), nonzero: the Model adds them as a K = 1 GEMM, the decoder as a
// vector addition.
TEST(UseModelMpi, DecoderLossEqualsModelForwardWithQkvBiases) {
  auto cfg = config(false);
  cfg.qkv_bias = true;
  expect_decoder_loss_equals_model(cfg);
}

// Per-head q/k norms (model.qk_norm) after nonzero biases, heads 10 wide: the Model normalises
// N·heads rows, the decoder the row's heads, q and the cached k.
TEST(UseModelMpi, DecoderLossEqualsModelForwardWithQkNorm) {
  auto cfg = config(false);
  cfg.qk_norm = true;
  cfg.qkv_bias = true;
  cfg.explicit_head_dim = 10;
  expect_decoder_loss_equals_model(cfg);
}
