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
#include <cmath>
#include <cstdint>

#include "kernels/cuda/attention_geometry.cuh"
#include "kernels/cuda/mma_layout.h"

namespace t3d::kernels::cuda {
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
constexpr int kRows = 16 * kWarps;  // query rows of a forward or dq block; keys of a dkv block
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

// ---- forward ------------------------------------------------------------------------------------

// The forward's warp holds MT m-tiles (16·MT query rows, 64·MT a block): the B fragments of K and
// V it loads serve MT products, as flash-attention 2's forward does (2 at head dims up to 128).
// Keys per tile: 32 at head dim 128 (the two m-tiles' D-wide accumulators take 128 registers of
// a lane), else 64.
constexpr int kForwardMTiles = 2;
constexpr int kForwardRows = 16 * kWarps * kForwardMTiles;
template <int DP>
struct ForwardKeys {
  static constexpr int keys = DP > 64 ? 32 : 64;
};

template <int DP>
constexpr std::size_t forward_smem() {
  return sizeof(std::uint16_t) * (kForwardRows + 2 * ForwardKeys<DP>::keys) * (DP + kPad);
}

template <int DP>
__global__ void __launch_bounds__(kThreads)
    forward_kernel(float* out, float* lse, const std::uint16_t* q16, const std::uint16_t* k16,
                   const std::uint16_t* v16, Geometry g) {
  constexpr int MT = kForwardMTiles;
  constexpr int KEYS = ForwardKeys<DP>::keys;
  constexpr int KD = DP / 16, ND = DP / 8, NB = KEYS / 8, KK = KEYS / 16;
  extern __shared__ __align__(16) std::uint16_t fwd_smem[];
  const Bf16Tile Q{fwd_smem, DP + kPad};
  const Bf16Tile K{Q.p + kForwardRows * (DP + kPad), DP + kPad};
  const Bf16Tile V{K.p + KEYS * (DP + kPad), DP + kPad};
  // The longest query tiles (the last) first: they see the most keys.
  const std::int64_t i0 = std::int64_t{gridDim.x - 1 - blockIdx.x} * kForwardRows, h = blockIdx.y,
                     b = blockIdx.z;
  const int D = static_cast<int>(g.D), lane = lane_id(), r_warp = 16 * MT * warp_id();
  const std::uint16_t* ks = slab<DP>(k16, b, h / g.group, g.Hkv, g.keys);
  const std::uint16_t* vs = slab<DP>(v16, b, h / g.group, g.Hkv, g.keys);
  load_tile<kForwardRows, DP>(Q, slab<DP>(q16, b, h, g.H, g.T), i0, g.T);
  // m-tile t, row half 0: the lane's row groupID of the tile's 16; half 1: groupID + 8.
  float m[MT][2], l[MT][2], o[MT][ND][4];
#pragma unroll
  for (int t = 0; t < MT; ++t) {
    m[t][0] = m[t][1] = -INFINITY;
    l[t][0] = l[t][1] = 0.0f;
#pragma unroll
    for (int n = 0; n < ND; ++n) o[t][n][0] = o[t][n][1] = o[t][n][2] = o[t][n][3] = 0.0f;
  }
  const std::int64_t last_row = (i0 + kForwardRows < g.T ? i0 + kForwardRows : g.T) - 1;
  const std::int64_t key_end = g.q_pos + last_row + 1;  // keys [0, key_end) are seen by the tile
  for (std::int64_t j0 = 0; j0 < key_end; j0 += KEYS) {
    __syncthreads();  // the previous key tile is no longer read (and, first time, Q is written)
    load_tile<KEYS, DP>(K, ks, j0, key_end);
    load_tile<KEYS, DP>(V, vs, j0, key_end);
    __syncthreads();
    float s[MT][NB][4];
#pragma unroll
    for (int t = 0; t < MT; ++t)
#pragma unroll
      for (int n = 0; n < NB; ++n) s[t][n][0] = s[t][n][1] = s[t][n][2] = s[t][n][3] = 0.0f;
#pragma unroll
    for (int kk = 0; kk < KD; ++kk) {  // S = Q Kᵀ
      std::uint32_t a[MT][4];
#pragma unroll
      for (int t = 0; t < MT; ++t) load_a(a[t], Q, r_warp + 16 * t, 16 * kk, lane);
#pragma unroll
      for (int n = 0; n < NB; ++n) {
        std::uint32_t bk[2];
        load_b(bk, K, 8 * n, 16 * kk, lane);
#pragma unroll
        for (int t = 0; t < MT; ++t) mma_bf16(s[t][n], a[t], bk);
      }
    }
#pragma unroll
    for (int t = 0; t < MT; ++t)
#pragma unroll
      for (int half = 0; half < 2; ++half) {
        const std::int64_t row = i0 + r_warp + 16 * t + c_elem(lane, 2 * half).row;
        const std::int64_t pos = g.q_pos + row;
        float tile_max = -INFINITY;
#pragma unroll
        for (int n = 0; n < NB; ++n)
#pragma unroll
          for (int e = 2 * half; e < 2 * half + 2; ++e) {
            const std::int64_t key = j0 + 8 * n + c_elem(lane, e).col;
            s[t][n][e] = row < g.T && key <= pos ? s[t][n][e] * g.scale : -INFINITY;
            tile_max = fmaxf(tile_max, s[t][n][e]);
          }
        const float m_new = fmaxf(m[t][half], quad_max(tile_max));
        float sum = 0.0f;
#pragma unroll
        for (int n = 0; n < NB; ++n)
#pragma unroll
          for (int e = 2 * half; e < 2 * half + 2; ++e) {
            s[t][n][e] = s[t][n][e] == -INFINITY ? 0.0f : expf(s[t][n][e] - m_new);
            sum += s[t][n][e];
          }
        const float alpha = m[t][half] == -INFINITY ? 0.0f : expf(m[t][half] - m_new);
        l[t][half] = l[t][half] * alpha + quad_sum(sum);
        m[t][half] = m_new;
#pragma unroll
        for (int n = 0; n < ND; ++n) o[t][n][2 * half] *= alpha, o[t][n][2 * half + 1] *= alpha;
      }
#pragma unroll
    for (int kk = 0; kk < KK; ++kk) {  // O += P V, P rounded to bf16 in registers
      std::uint32_t a[MT][4];
#pragma unroll
      for (int t = 0; t < MT; ++t) a_from_c(a[t], s[t][2 * kk], s[t][2 * kk + 1]);
#pragma unroll
      for (int n = 0; n < ND; n += 2) {
        std::uint32_t b0[2], b1[2];
        load_b_trans(b0, b1, V, 16 * kk, 8 * n, lane);
#pragma unroll
        for (int t = 0; t < MT; ++t) {
          mma_bf16(o[t][n], a[t], b0);
          mma_bf16(o[t][n + 1], a[t], b1);
        }
      }
    }
  }
#pragma unroll
  for (int t = 0; t < MT; ++t)
#pragma unroll
    for (int half = 0; half < 2; ++half) {
      const std::int64_t row = i0 + r_warp + 16 * t + c_elem(lane, 2 * half).row;
      if (row >= g.T) continue;
      const float inv = 1.0f / l[t][half];
#pragma unroll
      for (int n = 0; n < ND; ++n)
#pragma unroll
        for (int e = 2 * half; e < 2 * half + 2; ++e) {
          const int col = 8 * n + c_elem(lane, e).col;
          if (col < D) out[(b * g.T + row) * g.ld_q + h * g.D + col] = o[t][n][e] * inv;
        }
      if (lane % 4 == 0) lse[(b * g.H + h) * g.T + row] = m[t][half] + logf(l[t][half]);
    }
}

// ---- backward: dq -------------------------------------------------------------------------------

template <int DP>
constexpr std::size_t dq_smem() {
  return sizeof(float) * 2 * kRows + sizeof(std::uint16_t) * (2 * kRows + 2 * kKeys) * (DP + kPad);
}

template <int DP>
__global__ void __launch_bounds__(kThreads)
    dq_kernel(float* dq, const std::uint16_t* dout16, const std::uint16_t* q16,
              const std::uint16_t* k16, const std::uint16_t* v16, const float* lse,
              const float* delta, Geometry g) {
  constexpr int KD = DP / 16, ND = DP / 8, NB = kKeys / 8, KK = kKeys / 16;
  extern __shared__ __align__(16) std::uint16_t dq_smem_words[];
  float* lse_rows = reinterpret_cast<float*>(dq_smem_words);
  float* delta_rows = lse_rows + kRows;
  const Bf16Tile Q{reinterpret_cast<std::uint16_t*>(delta_rows + kRows), DP + kPad};
  const Bf16Tile dO{Q.p + kRows * (DP + kPad), DP + kPad};
  const Bf16Tile K{dO.p + kRows * (DP + kPad), DP + kPad};
  const Bf16Tile V{K.p + kKeys * (DP + kPad), DP + kPad};
  const std::int64_t i0 = std::int64_t{gridDim.x - 1 - blockIdx.x} * kRows, h = blockIdx.y,
                     b = blockIdx.z;
  const int D = static_cast<int>(g.D), lane = lane_id(), r_warp = 16 * warp_id();
  const std::uint16_t* ks = slab<DP>(k16, b, h / g.group, g.Hkv, g.keys);
  const std::uint16_t* vs = slab<DP>(v16, b, h / g.group, g.Hkv, g.keys);
  load_tile<kRows, DP>(Q, slab<DP>(q16, b, h, g.H, g.T), i0, g.T);
  load_tile<kRows, DP>(dO, slab<DP>(dout16, b, h, g.H, g.T), i0, g.T);
  load_row_stats<kRows>(lse_rows, delta_rows, lse, delta, (b * g.H + h) * g.T, i0, g.T);
  float acc[ND][4];
#pragma unroll
  for (int n = 0; n < ND; ++n) acc[n][0] = acc[n][1] = acc[n][2] = acc[n][3] = 0.0f;
  const std::int64_t last_row = (i0 + kRows < g.T ? i0 + kRows : g.T) - 1;
  const std::int64_t key_end = g.q_pos + last_row + 1;
  for (std::int64_t j0 = 0; j0 < key_end; j0 += kKeys) {
    __syncthreads();
    load_tile<kKeys, DP>(K, ks, j0, key_end);
    load_tile<kKeys, DP>(V, vs, j0, key_end);
    __syncthreads();
    float s[NB][4], dp[NB][4];
#pragma unroll
    for (int n = 0; n < NB; ++n)
#pragma unroll
      for (int e = 0; e < 4; ++e) s[n][e] = dp[n][e] = 0.0f;
#pragma unroll
    for (int kk = 0; kk < KD; ++kk) {
      std::uint32_t aq[4], ado[4];
      load_a(aq, Q, r_warp, 16 * kk, lane);
      load_a(ado, dO, r_warp, 16 * kk, lane);
#pragma unroll
      for (int n = 0; n < NB; ++n) {
        std::uint32_t bk[2], bv[2];
        load_b(bk, K, 8 * n, 16 * kk, lane);
        mma_bf16(s[n], aq, bk);  // S = Q Kᵀ
        load_b(bv, V, 8 * n, 16 * kk, lane);
        mma_bf16(dp[n], ado, bv);  // dP = dO Vᵀ
      }
    }
#pragma unroll
    for (int n = 0; n < NB; ++n)
#pragma unroll
      for (int e = 0; e < 4; ++e) {  // dS = P (dP - delta), in s
        const int r = r_warp + c_elem(lane, e).row;
        const std::int64_t row = i0 + r, key = j0 + 8 * n + c_elem(lane, e).col;
        const bool seen = row < g.T && key <= g.q_pos + row;
        const float p = seen ? expf(s[n][e] * g.scale - lse_rows[r]) : 0.0f;
        s[n][e] = p * (dp[n][e] - delta_rows[r]);
      }
#pragma unroll
    for (int kk = 0; kk < KK; ++kk) {  // dQ += dS K
      std::uint32_t a[4];
      a_from_c(a, s[2 * kk], s[2 * kk + 1]);
#pragma unroll
      for (int n = 0; n < ND; n += 2) {
        std::uint32_t b0[2], b1[2];
        load_b_trans(b0, b1, K, 16 * kk, 8 * n, lane);
        mma_bf16(acc[n], a, b0);
        mma_bf16(acc[n + 1], a, b1);
      }
    }
  }
  const std::int64_t q_off = b * g.T * g.ld_q + h * g.D;
#pragma unroll
  for (int n = 0; n < ND; ++n)
#pragma unroll
    for (int e = 0; e < 4; ++e) {
      const std::int64_t row = i0 + r_warp + c_elem(lane, e).row;
      const int col = 8 * n + c_elem(lane, e).col;
      if (row < g.T && col < D) dq[q_off + row * g.ld_q + col] = g.scale * acc[n][e];
    }
}

// ---- backward: dk, dv ---------------------------------------------------------------------------

// Query rows per step of the dk/dv kernel: 32 at head dim 128 (two D-wide fp32 accumulators per
// lane already take 128 registers), else 64.
template <int DP>
struct DkvQueryTile {
  static constexpr int rows = DP > 64 ? 32 : 64;
};

template <int DP>
constexpr std::size_t dkv_smem() {
  constexpr int BQ = DkvQueryTile<DP>::rows;
  return sizeof(float) * 2 * BQ + sizeof(std::uint16_t) * (2 * kRows + 2 * BQ) * (DP + kPad);
}

template <int DP>
__global__ void __launch_bounds__(kThreads)
    dkv_kernel(float* dk, float* dv, const std::uint16_t* dout16, const std::uint16_t* q16,
               const std::uint16_t* k16, const std::uint16_t* v16, const float* lse,
               const float* delta, Geometry g) {
  constexpr int BQ = DkvQueryTile<DP>::rows;
  constexpr int KD = DP / 16, ND = DP / 8, NB = BQ / 8, KK = BQ / 16;
  extern __shared__ __align__(16) std::uint16_t dkv_smem_words[];
  float* lse_rows = reinterpret_cast<float*>(dkv_smem_words);
  float* delta_rows = lse_rows + BQ;
  const Bf16Tile K{reinterpret_cast<std::uint16_t*>(delta_rows + BQ), DP + kPad};
  const Bf16Tile V{K.p + kRows * (DP + kPad), DP + kPad};
  const Bf16Tile Q{V.p + kRows * (DP + kPad), DP + kPad};
  const Bf16Tile dO{Q.p + BQ * (DP + kPad), DP + kPad};
  const std::int64_t j0 = std::int64_t{blockIdx.x} * kRows, kvh = blockIdx.y, b = blockIdx.z;
  const int D = static_cast<int>(g.D), lane = lane_id(), r_warp = 16 * warp_id();
  load_tile<kRows, DP>(K, slab<DP>(k16, b, kvh, g.Hkv, g.keys), j0, g.keys);
  load_tile<kRows, DP>(V, slab<DP>(v16, b, kvh, g.Hkv, g.keys), j0, g.keys);
  float acc_k[ND][4], acc_v[ND][4];
#pragma unroll
  for (int n = 0; n < ND; ++n)
#pragma unroll
    for (int e = 0; e < 4; ++e) acc_k[n][e] = acc_v[n][e] = 0.0f;
  // The first query row whose position reaches this tile's first key.
  const std::int64_t first = j0 > g.q_pos ? j0 - g.q_pos : 0;
  for (std::int64_t h = kvh * g.group; h < (kvh + 1) * g.group; ++h) {
    const std::uint16_t* qs = slab<DP>(q16, b, h, g.H, g.T);
    const std::uint16_t* dos = slab<DP>(dout16, b, h, g.H, g.T);
    for (std::int64_t i0 = first; i0 < g.T; i0 += BQ) {
      __syncthreads();  // the previous query tile is no longer read (first time: K, V written)
      load_tile<BQ, DP>(Q, qs, i0, g.T);
      load_tile<BQ, DP>(dO, dos, i0, g.T);
      load_row_stats<BQ>(lse_rows, delta_rows, lse, delta, (b * g.H + h) * g.T, i0, g.T);
      __syncthreads();
      float st[NB][4], dpt[NB][4];  // Sᵀ and dPᵀ: the warp's 16 keys x BQ queries
#pragma unroll
      for (int n = 0; n < NB; ++n)
#pragma unroll
        for (int e = 0; e < 4; ++e) st[n][e] = dpt[n][e] = 0.0f;
#pragma unroll
      for (int kk = 0; kk < KD; ++kk) {
        std::uint32_t ak[4], av[4];
        load_a(ak, K, r_warp, 16 * kk, lane);
        load_a(av, V, r_warp, 16 * kk, lane);
#pragma unroll
        for (int n = 0; n < NB; ++n) {
          std::uint32_t bq[2], bo[2];
          load_b(bq, Q, 8 * n, 16 * kk, lane);
          mma_bf16(st[n], ak, bq);  // Sᵀ = K Qᵀ
          load_b(bo, dO, 8 * n, 16 * kk, lane);
          mma_bf16(dpt[n], av, bo);  // dPᵀ = V dOᵀ
        }
      }
#pragma unroll
      for (int n = 0; n < NB; ++n)
#pragma unroll
        for (int e = 0; e < 4; ++e) {  // Pᵀ in st, dSᵀ = Pᵀ (dPᵀ - delta) in dpt
          const int c = 8 * n + c_elem(lane, e).col;
          const std::int64_t key = j0 + r_warp + c_elem(lane, e).row, row = i0 + c;
          const bool seen = row < g.T && key < g.keys && key <= g.q_pos + row;
          const float p = seen ? expf(st[n][e] * g.scale - lse_rows[c]) : 0.0f;
          st[n][e] = p;
          dpt[n][e] = p * (dpt[n][e] - delta_rows[c]);
        }
#pragma unroll
      for (int kk = 0; kk < KK; ++kk) {
        std::uint32_t ap[4], as[4];
        a_from_c(ap, st[2 * kk], st[2 * kk + 1]);
        a_from_c(as, dpt[2 * kk], dpt[2 * kk + 1]);
#pragma unroll
        for (int n = 0; n < ND; n += 2) {
          std::uint32_t b0[2], b1[2];
          load_b_trans(b0, b1, dO, 16 * kk, 8 * n, lane);
          mma_bf16(acc_v[n], ap, b0);  // dV += Pᵀ dO
          mma_bf16(acc_v[n + 1], ap, b1);
          load_b_trans(b0, b1, Q, 16 * kk, 8 * n, lane);
          mma_bf16(acc_k[n], as, b0);  // dK += dSᵀ Q
          mma_bf16(acc_k[n + 1], as, b1);
        }
      }
    }
  }
  const std::int64_t kv_off = b * g.keys * g.ld_kv + kvh * g.D;
#pragma unroll
  for (int n = 0; n < ND; ++n)
#pragma unroll
    for (int e = 0; e < 4; ++e) {
      const std::int64_t key = j0 + r_warp + c_elem(lane, e).row;
      const int col = 8 * n + c_elem(lane, e).col;
      if (key >= g.keys || col >= D) continue;
      dk[kv_off + key * g.ld_kv + col] = g.scale * acc_k[n][e];
      dv[kv_off + key * g.ld_kv + col] = acc_v[n][e];
    }
}

// ---- launches -----------------------------------------------------------------------------------

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
    q16 = buffer_.data, k16 = q16 + nq, v16 = k16 + nkv;
    round(q16, q, B, g.T, g.H, g);
    round(k16, k, B, g.keys, g.Hkv, g);
    round(v16, v, B, g.keys, g.Hkv, g);
    if (!dout) return;
    dout16 = v16 + nkv;
    round(dout16, dout, B, g.T, g.H, g);
    delta = reinterpret_cast<float*>(dout16 + nq);  // nq + 2 nkv + nq elements: 16-byte aligned
    deltas_kernel<<<grid_for(rows * 32), kBlock, 0, s.impl().stream>>>(delta, dout, out, g, rows);
    T3D_CUDA_LAUNCHED();
  }
  ~RoundedInputs() { give_rounded_buffer(s_, buffer_.slot); }
  RoundedInputs(const RoundedInputs&) = delete;
  RoundedInputs& operator=(const RoundedInputs&) = delete;

  std::uint16_t *q16 = nullptr, *k16 = nullptr, *v16 = nullptr, *dout16 = nullptr;
  float* delta = nullptr;

 private:
  void round(std::uint16_t* dst, const float* x, std::int64_t B, std::int64_t rows,
             std::int64_t heads, const Geometry& g) {
    const std::int64_t pairs = B * heads * rows * (DP / 2);
    const std::int64_t ld = heads == g.H ? g.ld_q : g.ld_kv;
    round_heads_kernel<DP><<<grid_for(pairs), kBlock, 0, s_.impl().stream>>>(
        reinterpret_cast<std::uint32_t*>(dst), x, rows, heads, g.D, ld, pairs);
    T3D_CUDA_LAUNCHED();
  }

  const Stream& s_;
  RoundedBuffer buffer_;
};

template <int DP>
void forward(const Stream& s, float* out, float* lse, const float* q, const float* k,
             const float* v, const Geometry& g, std::int64_t B) {
  const RoundedInputs<DP> in(s, g, B, q, k, v, nullptr, nullptr);
  allow_smem(forward_kernel<DP>, forward_smem<DP>());
  forward_kernel<DP>
      <<<grid(g.T, kForwardRows, g.H, B), kThreads, forward_smem<DP>(), s.impl().stream>>>(
          out, lse, in.q16, in.k16, in.v16, g);
  T3D_CUDA_LAUNCHED();
}

template <int DP>
void backward(const Stream& s, float* dq, float* dk, float* dv, const float* dout, const float* q,
              const float* k, const float* v, const float* out, const float* lse, const Geometry& g,
              std::int64_t B) {
  const RoundedInputs<DP> in(s, g, B, q, k, v, dout, out);
  allow_smem(dq_kernel<DP>, dq_smem<DP>());
  allow_smem(dkv_kernel<DP>, dkv_smem<DP>());
  dq_kernel<DP><<<grid(g.T, kRows, g.H, B), kThreads, dq_smem<DP>(), s.impl().stream>>>(
      dq, in.dout16, in.q16, in.k16, in.v16, lse, in.delta, g);
  T3D_CUDA_LAUNCHED();
  dkv_kernel<DP><<<grid(g.keys, kRows, g.Hkv, B), kThreads, dkv_smem<DP>(), s.impl().stream>>>(
      dk, dv, in.dout16, in.q16, in.k16, in.v16, lse, in.delta, g);
  T3D_CUDA_LAUNCHED();
}

}  // namespace

bool attention_bf16_tiles(const AttentionShape& shape) {
  return shape.head_dim > 0 && shape.head_dim <= kMaxBf16HeadDim;
}

void attention_forward_bf16(const Stream& s, float* out, float* lse, const float* q, const float* k,
                            const float* v, const AttentionShape& shape) {
  if (!attention_bf16_tiles(shape)) return attention_forward(s, out, lse, q, k, v, shape);
  const Geometry g = geometry(shape);
  if (g.D <= 32) return forward<32>(s, out, lse, q, k, v, g, shape.B);
  if (g.D <= 64) return forward<64>(s, out, lse, q, k, v, g, shape.B);
  forward<128>(s, out, lse, q, k, v, g, shape.B);
}

void attention_backward_bf16(const Stream& s, float* dq, float* dk, float* dv, const float* dout,
                             const float* q, const float* k, const float* v, const float* out,
                             const float* lse, const AttentionShape& shape) {
  if (!attention_bf16_tiles(shape))
    return attention_backward(s, dq, dk, dv, dout, q, k, v, out, lse, shape);
  const Geometry g = geometry(shape);
  if (g.D <= 32) return backward<32>(s, dq, dk, dv, dout, q, k, v, out, lse, g, shape.B);
  if (g.D <= 64) return backward<64>(s, dq, dk, dv, dout, q, k, v, out, lse, g, shape.B);
  backward<128>(s, dq, dk, dv, dout, q, k, v, out, lse, g, shape.B);
}

}  // namespace t3d::kernels::cuda
