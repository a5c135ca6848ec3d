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

}  // namespace t3d::runtime
