// The tiny models the model tests build: dense, and a mixture of experts on top of it.
#pragma once

#include "runtime/recipe/recipe.h"

namespace t3d::runtime {

inline ModelConfig tiny_config() {
  return ModelConfig{.vocab_size = 16,
                     .dim = 16,
                     .n_layers = 2,
                     .n_heads = 4,
                     .n_kv_heads = 2,
                     .ffn_dim = 32,
                     .seq_len = 8};
}

// Heads wider than dim / n_heads (model.head_dim, as Qwen3's: the attention 4·6 = 24 wide over
// dim 16) and Llama 3's RoPE scaling over a pretraining context of 8 positions: the lowest of the
// 3 frequencies is smoothed, the others slowed 8×.
inline ModelConfig wide_head_config() {
  ModelConfig c = tiny_config();
  c.explicit_head_dim = 6;
  c.rope_scaling = kernels::RopeScaling::Kind::kLlama3;
  c.rope_factor = 8.0;
  c.rope_original_seq_len = 8;
  return c;
}

// Qwen2's biases on q, k and v (model.qkv_bias).
inline ModelConfig qkv_bias_config() {
  ModelConfig c = tiny_config();
  c.qkv_bias = true;
  return c;
}

// Qwen3's attention (model.qk_norm): per-head q/k RMSNorm before RoPE, heads wider than
// dim / n_heads, over the q/k/v biases (Qwen3 has none; both together test their order).
inline ModelConfig qk_norm_config() {
  ModelConfig c = tiny_config();
  c.qk_norm = true;
  c.qkv_bias = true;
  c.explicit_head_dim = 6;
  return c;
}

// Block 0 dense, block 1 a mixture of 4 routed experts (2 per token), one shared expert, the
// selection bias and the auxiliary loss.
inline ModelConfig moe_config() {
  ModelConfig c = tiny_config();
  c.n_experts = 4;
  c.experts_per_token = 2;
  c.n_shared_experts = 1;
  c.moe_ffn_dim = 8;
  c.dense_layers = 1;
  c.router_bias_rate = 1e-3;
  c.router_aux_coef = 0.1;
  return c;
}

// Qwen2-MoE's block: moe_config's with q/k/v biases and the shared expert behind its sigmoid gate
// (model.shared_expert_gate).
inline ModelConfig gated_moe_config() {
  ModelConfig c = moe_config();
  c.qkv_bias = true;
  c.shared_expert_gate = true;
  return c;
}

}  // namespace t3d::runtime
