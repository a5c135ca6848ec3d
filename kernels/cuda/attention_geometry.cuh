// Internal to kernels/cuda/: what both attention kernels (the fp32 tiles of ops_attention.cu, the
// bf16 tensor-core tiles of ops_attention_bf16.cu) derive from an AttentionShape, and their launch
// helpers. Layouts, positions and the mask are kernels/ops.h's.
#pragma once

#include <cmath>
#include <cstdint>

#include "kernels/cuda/cuda_internal.cuh"

namespace t3d::kernels::cuda::attention {

// Rows per batch (T queries, `keys` keys), heads, the group size H / Hkv, row strides of q and of
// k/v (H·D and Hkv·D floats), the first query's position and 1/sqrt(D).
struct Geometry {
  std::int64_t T, keys, H, Hkv, D, group, ld_q, ld_kv, q_pos;
  float scale;
};

inline Geometry geometry(const AttentionShape& s) {
  T3D_USER_CHECK(s.n_kv_heads > 0 && s.n_heads % s.n_kv_heads == 0, "n_heads (", s.n_heads,
                 ") must be a positive multiple of n_kv_heads (", s.n_kv_heads, ")");
  T3D_USER_CHECK(s.head_dim > 0 && s.head_dim <= kMaxHeadDim, "the CUDA attention takes head_dim ",
                 "up to ", kMaxHeadDim, ", got ", s.head_dim);
  T3D_ASSERT(s.B > 0 && s.T > 0, "attention shape B=", s.B, " T=", s.T);
  T3D_ASSERT(s.q_pos >= 0 && s.q_pos + s.T <= s.keys(), "attention queries at positions ", s.q_pos,
             "..", s.q_pos + s.T, " but ", s.keys(), " keys");
  return {s.T,
          s.keys(),
          s.n_heads,
          s.n_kv_heads,
          s.head_dim,
          s.n_heads / s.n_kv_heads,
          s.n_heads * s.head_dim,
          s.n_kv_heads * s.head_dim,
          s.q_pos,
          1.0f / std::sqrt(static_cast<float>(s.head_dim))};
}

// A kernel may use `bytes` of dynamic shared memory (above 48 KiB needs the opt-in).
template <class Kernel>
void allow_smem(Kernel kernel, std::size_t bytes) {
  T3D_CUDA_CHECK(cudaFuncSetAttribute(kernel, cudaFuncAttributeMaxDynamicSharedMemorySize,
                                      static_cast<int>(bytes)));
}

// One block per tile of `rows` rows, per head, per batch.
inline dim3 grid(std::int64_t rows, int tile, std::int64_t heads, std::int64_t B) {
  T3D_ASSERT(heads <= 65535 && B <= 65535, "attention over ", heads, " heads and ", B,
             " sequences: a CUDA grid's y and z stop at 65535");
  return dim3(static_cast<unsigned>((rows + tile - 1) / tile), static_cast<unsigned>(heads),
              static_cast<unsigned>(B));
}

}  // namespace t3d::kernels::cuda::attention
