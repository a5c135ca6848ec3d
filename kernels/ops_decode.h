// Attention for autoregressive decoding: one new query row per head against the keys and values
// of every earlier position, kept in a KV cache. The training kernel (attention_forward) works on
// whole sequences and would recompute all T rows for each new token; decoding needs one row, so
// this is a separate, small op. Same convention as ops.h: fp32, row-major, no allocation, the
// Exec first.
#pragma once

#include <cstdint>

#include "kernels/exec.h"

namespace t3d::kernels {

// out[h] = softmax(q[h] · k[j]^T / sqrt(D), j < n) · v[j] for each query head h; query head h reads
// kv head h / (H / Hkv) (grouped-query attention). Causality is implicit: the cache holds only
// positions up to and including the query's own. On a GPU, the CUDA twin (the training forward's
// tiles at one query row: within 1e-5, kernels/cuda/cuda_ops.h).
void attention_decode(const Exec& exec,
                      float* out,            // out (H * D)
                      const float* q,        // q (H * D), after RoPE at position n - 1
                      const float* k_cache,  // k_cache (n, Hkv * D), after RoPE
                      const float* v_cache,  // v_cache (n, Hkv * D)
                      float* scratch,        // max(n, H) floats
                      std::int64_t n, std::int64_t n_heads, std::int64_t n_kv_heads,
                      std::int64_t head_dim);

}  // namespace t3d::kernels
