// Internal to kernels/cuda/: what the bf16 tensor-core attention kernels share
// (ops_attention_bf16.cu: the forward; ops_attention_bf16_backward.cu: dq, dk, dv).
//
// Causal grouped-query attention on the GPU with bf16 tensor-core tiles: the GPU twin of the CPU's
// bf16 tiles (kernels/attention_bf16.h), taken when the linear layers run a bf16 GEMM kind. The
// numerics contract is the CPU's: every operand of a tile product (q, k, v, dout, P, dS) rounded
// to bf16 (ties to even, row_math.h's bf16_of) as it enters the product, every product summed in
// fp32 (mma.sync m16n8k16, fp32 accumulators); softmax, the running max and sum, lse,
// rowsum(dO·O) and every output fp32. The sums run in another order than the CPU's, so results
// agree within bf16 rounding, not bit for bit (docs/gpu.md).
//
// Tiling (flash-attention 2): the forward runs one block per (128 query rows, head, batch), a warp
// per 32 rows (two m-tiles sharing each K and V fragment) streaming over tiles of 64 keys (32 at
// head dim 128) with an online softmax; dq one block per (64 query rows, head, batch), a warp per
// 16 rows, over tiles of 64 keys; dk and
// dv run one block per (64 keys, kv head, batch), a warp per 16 keys, streaming over the group's
// query heads in order and, for each, the query tiles that see the keys. Probabilities are
// recomputed from lse; no T x T matrix, no atomics. Each sum has an order fixed by the shape alone
// (a warp's mma chain over k in order, the tiles in order, shuffle trees), so two runs give the
// same bits. Head dims up to 128 (zero-padded to DP = 32, 64 or 128 columns); larger ones run the
// fp32 tiles (ops_attention.cu).
//
// Each call first rounds its fp32 inputs once into head-major bf16 slabs of DP columns (a buffer
// of the stream's pool: 2 bytes per element of q, k, v and, backward, dout; plus rowsum(dO·O) per
// query row), so the kernels load tiles with 16-byte loads and round nothing per tile. Shared
// tiles are row-major with rows padded by 8 elements, so a warp's fragment loads (lane =
// 4·groupID + tig reads row groupID, word tig) and ldmatrix's 8-row phases hit 32 different
// banks. A product whose B matrix is stored n-major (K for Q Kᵀ) reads it with 32-bit loads; one
// whose B is stored k-major (V for P V, K for dS K, dO and Q for dV and dK) through
// ldmatrix.trans (kernels/cuda/mma_layout.h).
#pragma once

#include <cmath>
#include <cstdint>

#include "kernels/cuda/attention_geometry.cuh"
#include "kernels/cuda/mma_layout.h"

namespace t3d::kernels::cuda::attention_bf16 {
// Internal linkage: each including file has its own copy of the kernels below.
namespace {

using attention::allow_smem;
using attention::Geometry;
using attention::geometry;
using attention::grid;
using mma::a_from_c;
using mma::Bf16Tile;
using mma::c_elem;
using mma::load_a;
using mma::load_b;
using mma::pack_bf16;

constexpr int kWarps = 4, kThreads = 32 * kWarps;
constexpr int kRows = 16 * kWarps;  // query rows of a dq block; keys of a dk/dv block
constexpr int kKeys = 64;           // keys per key tile of dq
constexpr int kPad = 8;             // bf16 elements of padding per tile row
constexpr int kMaxBf16HeadDim = 128;

// d += a · b on the tensor cores: A 16 x 16 (row), B 16 x 8 (col), bf16; C, D fp32.
__device__ __forceinline__ void mma_bf16(float (&d)[4], const std::uint32_t (&a)[4],
                                         const std::uint32_t (&b)[2]) {
  asm("mma.sync.aligned.m16n8k16.row.col.f32.bf16.bf16.f32 {%0,%1,%2,%3}, {%4,%5,%6,%7}, "
      "{%8,%9}, {%0,%1,%2,%3};\n"
      : "+f"(d[0]), "+f"(d[1]), "+f"(d[2]), "+f"(d[3])
      : "r"(a[0]), "r"(a[1]), "r"(a[2]), "r"(a[3]), "r"(b[0]), "r"(b[1]));
}

// The 4 lanes of a quad (one groupID: one row of a C fragment) folded (1, then 2); every lane
// gets the same value.
__device__ __forceinline__ float quad_sum(float v) {
  v += __shfl_xor_sync(0xffffffffu, v, 1);
  return v + __shfl_xor_sync(0xffffffffu, v, 2);
}
__device__ __forceinline__ float quad_max(float v) {
  v = fmaxf(v, __shfl_xor_sync(0xffffffffu, v, 1));
  return fmaxf(v, __shfl_xor_sync(0xffffffffu, v, 2));
}

__device__ __forceinline__ int lane_id() { return static_cast<int>(threadIdx.x) & 31; }
__device__ __forceinline__ int warp_id() { return static_cast<int>(threadIdx.x) >> 5; }

// ---- the inputs, rounded once -------------------------------------------------------------------

// x (B, rows, heads·D at row stride ld) rounded to bf16 into head-major slabs of DP columns:
// out[((b·heads + h)·rows + r)·DP + c] = bf16(x[b][r][h·D + c]) for c < D, 0 for D <= c < DP.
template <int DP>
__global__ void round_heads_kernel(std::uint32_t* out, const float* x, std::int64_t rows,
                                   std::int64_t heads, std::int64_t D, std::int64_t ld,
                                   std::int64_t pairs) {
  for (std::int64_t e = std::int64_t{blockIdx.x} * blockDim.x + threadIdx.x; e < pairs;
       e += std::int64_t{gridDim.x} * blockDim.x) {
    const int c = static_cast<int>(2 * (e % (DP / 2)));
    const std::int64_t slab_row = e / (DP / 2);  // (b·heads + h)·rows + r
    const std::int64_t r = slab_row % rows, h = slab_row / rows % heads,
                       b = slab_row / rows / heads;
    const float* src = x + (b * rows + r) * ld + h * D;
    out[e] = pack_bf16(c < D ? src[c] : 0.0f, c + 1 < D ? src[c + 1] : 0.0f);
  }
}

// delta[(b·H + h)·T + row] = rowsum(dO · O) of a query row (fp32, unrounded inputs): a warp per
// row, its lanes summing columns lane, lane + 32, ... in order, then folding (16, 8, 4, 2, 1).
__global__ void deltas_kernel(float* delta, const float* dout, const float* out, Geometry g,
                              std::int64_t rows) {
  const int lane = lane_id();
  const std::int64_t warps = std::int64_t{gridDim.x} * blockDim.x / 32;
  for (std::int64_t w = (std::int64_t{blockIdx.x} * blockDim.x + threadIdx.x) / 32; w < rows;
       w += warps) {
    const std::int64_t row = w % g.T, h = w / g.T % g.H, b = w / g.T / g.H;
    const std::int64_t off = (b * g.T + row) * g.ld_q + h * g.D;
    float part = 0.0f;
    for (std::int64_t c = lane; c < g.D; c += 32) part += dout[off + c] * out[off + c];
    for (int m = 16; m >= 1; m /= 2) part += __shfl_xor_sync(0xffffffffu, part, m);
    if (lane == 0) delta[w] = part;
  }
}

// Rows [r0, r0 + ROWS) of a head's slab (rows of DP bf16) into a tile, zero from row `limit`.
template <int ROWS, int DP>
__device__ void load_tile(Bf16Tile t, const std::uint16_t* slab, std::int64_t r0,
                          std::int64_t limit) {
  constexpr int kChunks = DP / 8;  // 16-byte pieces of a row
  for (int e = threadIdx.x; e < ROWS * kChunks; e += kThreads) {
    const int r = e / kChunks, c = 8 * (e % kChunks);
    uint4 w = make_uint4(0u, 0u, 0u, 0u);
    if (r0 + r < limit) w = *reinterpret_cast<const uint4*>(slab + (r0 + r) * DP + c);
    *reinterpret_cast<uint4*>(t.p + r * t.stride + c) = w;
  }
}

// lse and delta of query rows [r0, r0 + ROWS) (at `off` of the (B, H, T) arrays), zero past T.
template <int ROWS>
__device__ void load_row_stats(float* lse_rows, float* delta_rows, const float* lse,
                               const float* delta, std::int64_t off, std::int64_t r0,
                               std::int64_t T) {
  for (int r = threadIdx.x; r < ROWS; r += kThreads) {
    const bool in = r0 + r < T;
    lse_rows[r] = in ? lse[off + r0 + r] : 0.0f;
    delta_rows[r] = in ? delta[off + r0 + r] : 0.0f;
  }
}

// The B fragments of columns n0..n0+7 (b0) and n0+8..n0+15 (b1) of B[k][n] = x(k0 + k, n0 + n),
// x row-major in shared memory (mma::ldmatrix_b_source).
__device__ __forceinline__ void load_b_trans(std::uint32_t (&b0)[2], std::uint32_t (&b1)[2],
                                             const Bf16Tile& x, int k0, int n0, int lane) {
  const mma::RowCol e = mma::ldmatrix_b_source(lane);
  const auto addr = static_cast<std::uint32_t>(
      __cvta_generic_to_shared(x.p + (k0 + e.row) * x.stride + n0 + e.col));
  asm volatile("ldmatrix.sync.aligned.m8n8.x4.trans.shared.b16 {%0,%1,%2,%3}, [%4];\n"
               : "=r"(b0[0]), "=r"(b0[1]), "=r"(b1[0]), "=r"(b1[1])
               : "r"(addr)
               : "memory");
}

// Slab of head h of batch b: heads·rows rows of DP bf16 per batch.
template <int DP>
__device__ const std::uint16_t* slab(const std::uint16_t* base, std::int64_t b, std::int64_t h,
                                     std::int64_t heads, std::int64_t rows) {
  return base + ((b * heads + h) * rows) * DP;
}

// A call's rounded inputs: q, k, v and (backward) dout as head-major bf16 slabs of DP columns,
// then (backward) the rows' deltas, in one buffer of the stream's pool, given back once the
// kernels that read it are enqueued (a later user's work runs after them on the one stream).
template <int DP>
class RoundedInputs {
 public:
  RoundedInputs(const Stream& s, const Geometry& g, std::int64_t B, const float* q, const float* k,
                const float* v, const float* dout, const float* out)
      : s_(s) {
    const std::int64_t nq = B * g.H * g.T * DP, nkv = B * g.Hkv * g.keys * DP;
    const std::int64_t rows = B * g.H * g.T;
    const std::int64_t elems = nq + 2 * nkv + (dout ? nq + 2 * rows : 0);
    buffer_ = take_rounded_buffer(s, static_cast<std::size_t>(elems));
    try {  // a failed launch throws: the slot goes back to the pool (no destructor runs)
      q16 = buffer_.data, k16 = q16 + nq, v16 = k16 + nkv;
      round(q16, q, B, g.T, g.H, g.ld_q, g.D);
      round(k16, k, B, g.keys, g.Hkv, g.ld_kv, g.D);
      round(v16, v, B, g.keys, g.Hkv, g.ld_kv, g.D);
      if (!dout) return;
      dout16 = v16 + nkv;
      round(dout16, dout, B, g.T, g.H, g.ld_q, g.D);
      delta = reinterpret_cast<float*>(dout16 + nq);  // nq + 2 nkv + nq elements: 16-byte aligned
      deltas_kernel<<<grid_for(rows * 32), kBlock, 0, s.impl().stream>>>(delta, dout, out, g, rows);
      T3D_CUDA_LAUNCHED();
    } catch (...) {
      give_rounded_buffer(s_, buffer_.slot);
      throw;
    }
  }
  ~RoundedInputs() { give_rounded_buffer(s_, buffer_.slot); }
  RoundedInputs(const RoundedInputs&) = delete;
  RoundedInputs& operator=(const RoundedInputs&) = delete;

  std::uint16_t *q16 = nullptr, *k16 = nullptr, *v16 = nullptr, *dout16 = nullptr;
  float* delta = nullptr;

 private:
  // x (B, rows, heads·D at row stride ld) into dst's slabs.
  void round(std::uint16_t* dst, const float* x, std::int64_t B, std::int64_t rows,
             std::int64_t heads, std::int64_t ld, std::int64_t D) {
    const std::int64_t pairs = B * heads * rows * (DP / 2);
    round_heads_kernel<DP><<<grid_for(pairs), kBlock, 0, s_.impl().stream>>>(
        reinterpret_cast<std::uint32_t*>(dst), x, rows, heads, D, ld, pairs);
    T3D_CUDA_LAUNCHED();
  }

  const Stream& s_;
  RoundedBuffer buffer_;
};

}  // namespace
}  // namespace t3d::kernels::cuda::attention_bf16
