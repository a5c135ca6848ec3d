// The model the tests of runtime/train build on two data-parallel ranks: several ZeRO buckets of
// kSmallModelBucketMb, so slices are uneven and every rank owns (and writes) boxes of its own.
#pragma once

#include "runtime/recipe/recipe.h"

namespace t3d::runtime {

inline ModelConfig small_model() {
  return ModelConfig{.vocab_size = 96,
                     .dim = 64,
                     .n_layers = 3,
                     .n_heads = 4,
                     .n_kv_heads = 2,
                     .ffn_dim = 176,
                     .seq_len = 16};
}
inline constexpr double kSmallModelBucketMb = 0.02;

}  // namespace t3d::runtime
