// Causal grouped-query attention on the GPU with bf16 tensor-core tiles: the GPU twin of the CPU's
// bf16 tiles (kernels/attention_bf16.h), taken when the linear layers run a bf16 GEMM kind. The
// numerics contract is the CPU's: every operand of a tile product (q, k, v, dout, P, dS) rounded
// to bf16 (ties to even, row_math.h's bf16_of) as it enters the product, every product summed in
// fp32 (mma.sync m16n8k16, fp32 accumulators); softmax, the running max and sum, lse,
// rowsum(dO·O) and every output fp32. The sums run in another order than the CPU's, so results
// agree within bf16 rounding, not bit for bit (docs/gpu.md).
//
// Tiling (flash-attention 2): the forward and dq run one block per (64 query rows, head, batch),
// a warp per 16 rows, streaming over tiles of 64 keys with an online softmax; dk and dv run one
// block per (64 keys, kv head, batch), a warp per 16 keys, streaming over the group's query heads
// in order and, for each, the query tiles that see the keys. Probabilities are recomputed from
// lse; no T x T matrix, no scratch, no atomics. Each sum has an order fixed by the shape alone (a
// warp's mma chain over k in order, the tiles in order, 4-lane shuffle trees), so two runs give
// the same bits. Head dims up to 128 (zero-padded to 32, 64 or 128 columns); larger ones run the
// fp32 tiles (ops_attention.cu).
//
// Shared memory holds bf16 tiles with rows padded by 8 elements, so a warp's fragment loads
// (lane = 4·groupID + tig reads row groupID, word tig) hit 32 different banks. Operands a product
// reads as its B matrix are stored with B's columns as rows (K for Q Kᵀ, Vᵀ for P V): the two
// k of a register are adjacent (kernels/cuda/mma_layout.h).
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
constexpr int kKeys = 64;           // keys per key tile of the forward and dq
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

// Rows [r0, r0 + ROWS) of a strided fp32 matrix (row r at base + r·ld, D floats) rounded to bf16
// into a row-major tile of DP columns; zero past `limit` rows and past column D.
template <int ROWS, int DP>
__device__ void load_rows(Bf16Tile t, const float* base, std::int64_t ld, std::int64_t r0,
                          std::int64_t limit, int D) {
  for (int e = threadIdx.x; e < ROWS * DP / 2; e += kThreads) {
    const int r = e / (DP / 2), c = 2 * (e % (DP / 2));
    float lo = 0.0f, hi = 0.0f;
    if (r0 + r < limit) {
      const float* row = base + (r0 + r) * ld;
      if (c < D) lo = row[c];
      if (c + 1 < D) hi = row[c + 1];
    }
    t.set_pair(r, c, pack_bf16(lo, hi));
  }
}

// The same rows transposed: tile row c (< DP) holds column c of the ROWS rows.
template <int ROWS, int DP>
__device__ void load_columns(Bf16Tile t, const float* base, std::int64_t ld, std::int64_t r0,
                             std::int64_t limit, int D) {
  for (int e = threadIdx.x; e < ROWS / 2 * DP; e += kThreads) {
    const int c = e % DP, r = 2 * (e / DP);
    float lo = 0.0f, hi = 0.0f;
    if (c < D) {
      if (r0 + r < limit) lo = base[(r0 + r) * ld + c];
      if (r0 + r + 1 < limit) hi = base[(r0 + r + 1) * ld + c];
    }
    t.set_pair(c, r, pack_bf16(lo, hi));
  }
}

// lse and delta = rowsum(dO · O) (fp32, unrounded inputs) of rows [r0, r0 + ROWS) into shared
// memory, zero past T. A warp takes every 4th row; its lanes sum columns lane, lane + 32, ... in
// order, then fold (16, 8, 4, 2, 1).
template <int ROWS>
__device__ void row_stats(float* lse_rows, float* delta, const float* dout, const float* out,
                          const float* lse, std::int64_t off, std::int64_t lse_off, std::int64_t r0,
                          const Geometry& g) {
  const int D = static_cast<int>(g.D);
  for (int r = warp_id(); r < ROWS; r += kWarps) {
    float part = 0.0f;
    if (r0 + r < g.T)
      for (int c = lane_id(); c < D; c += 32)
        part += dout[off + (r0 + r) * g.ld_q + c] * out[off + (r0 + r) * g.ld_q + c];
    for (int w = 16; w >= 1; w /= 2) part += __shfl_xor_sync(0xffffffffu, part, w);
    if (lane_id() == 0) {
      delta[r] = part;
      lse_rows[r] = r0 + r < g.T ? lse[lse_off + r0 + r] : 0.0f;
    }
  }
}

// ---- forward ------------------------------------------------------------------------------------

template <int DP>
constexpr std::size_t forward_smem() {
  return sizeof(std::uint16_t) * ((kRows + kKeys) * (DP + kPad) + DP * (kKeys + kPad));
}

template <int DP>
__global__ void __launch_bounds__(kThreads)
    forward_kernel(float* out, float* lse, const float* q, const float* k, const float* v,
                   Geometry g) {
  constexpr int KD = DP / 16, ND = DP / 8, NB = kKeys / 8, KK = kKeys / 16;
  extern __shared__ __align__(16) std::uint16_t fwd_smem[];
  const Bf16Tile Q{fwd_smem, DP + kPad};
  const Bf16Tile K{Q.p + kRows * (DP + kPad), DP + kPad};
  const Bf16Tile Vt{K.p + kKeys * (DP + kPad), kKeys + kPad};
  // The longest query tiles (the last) first: they see the most keys.
  const std::int64_t i0 = std::int64_t{gridDim.x - 1 - blockIdx.x} * kRows, h = blockIdx.y,
                     b = blockIdx.z;
  const int D = static_cast<int>(g.D), lane = lane_id(), r_warp = 16 * warp_id();
  const float* qh = q + b * g.T * g.ld_q + h * g.D;
  const float* kh = k + b * g.keys * g.ld_kv + (h / g.group) * g.D;
  const float* vh = v + b * g.keys * g.ld_kv + (h / g.group) * g.D;
  load_rows<kRows, DP>(Q, qh, g.ld_q, i0, g.T, D);
  // Row half 0: the lane's row groupID of the warp's 16; half 1: groupID + 8.
  float m[2] = {-INFINITY, -INFINITY}, l[2] = {0.0f, 0.0f}, o[ND][4];
#pragma unroll
  for (int n = 0; n < ND; ++n) o[n][0] = o[n][1] = o[n][2] = o[n][3] = 0.0f;
  const std::int64_t last_row = (i0 + kRows < g.T ? i0 + kRows : g.T) - 1;
  const std::int64_t key_end = g.q_pos + last_row + 1;  // keys [0, key_end) are seen by the tile
  for (std::int64_t j0 = 0; j0 < key_end; j0 += kKeys) {
    __syncthreads();  // the previous key tile is no longer read (and, first time, Q is written)
    load_rows<kKeys, DP>(K, kh, g.ld_kv, j0, key_end, D);
    load_columns<kKeys, DP>(Vt, vh, g.ld_kv, j0, key_end, D);
    __syncthreads();
    float s[NB][4];
#pragma unroll
    for (int n = 0; n < NB; ++n) s[n][0] = s[n][1] = s[n][2] = s[n][3] = 0.0f;
#pragma unroll
    for (int kk = 0; kk < KD; ++kk) {
      std::uint32_t a[4];
      load_a(a, Q, r_warp, 16 * kk, lane);
#pragma unroll
      for (int n = 0; n < NB; ++n) {
        std::uint32_t bk[2];
        load_b(bk, K, 8 * n, 16 * kk, lane);
        mma_bf16(s[n], a, bk);
      }
    }
#pragma unroll
    for (int half = 0; half < 2; ++half) {
      const std::int64_t row = i0 + r_warp + c_elem(lane, 2 * half).row, pos = g.q_pos + row;
      float tile_max = -INFINITY;
#pragma unroll
      for (int n = 0; n < NB; ++n)
#pragma unroll
        for (int e = 2 * half; e < 2 * half + 2; ++e) {
          const std::int64_t key = j0 + 8 * n + c_elem(lane, e).col;
          s[n][e] = row < g.T && key <= pos ? s[n][e] * g.scale : -INFINITY;
          tile_max = fmaxf(tile_max, s[n][e]);
        }
      const float m_new = fmaxf(m[half], quad_max(tile_max));
      float sum = 0.0f;
#pragma unroll
      for (int n = 0; n < NB; ++n)
#pragma unroll
        for (int e = 2 * half; e < 2 * half + 2; ++e) {
          s[n][e] = s[n][e] == -INFINITY ? 0.0f : expf(s[n][e] - m_new);
          sum += s[n][e];
        }
      const float alpha = m[half] == -INFINITY ? 0.0f : expf(m[half] - m_new);
      l[half] = l[half] * alpha + quad_sum(sum);
      m[half] = m_new;
#pragma unroll
      for (int n = 0; n < ND; ++n) o[n][2 * half] *= alpha, o[n][2 * half + 1] *= alpha;
    }
#pragma unroll
    for (int kk = 0; kk < KK; ++kk) {  // O += P V, P rounded to bf16 in registers
      std::uint32_t a[4];
      a_from_c(a, s[2 * kk], s[2 * kk + 1]);
#pragma unroll
      for (int n = 0; n < ND; ++n) {
        std::uint32_t bv[2];
        load_b(bv, Vt, 8 * n, 16 * kk, lane);
        mma_bf16(o[n], a, bv);
      }
    }
  }
#pragma unroll
  for (int half = 0; half < 2; ++half) {
    const std::int64_t row = i0 + r_warp + c_elem(lane, 2 * half).row;
    if (row >= g.T) continue;
    const float inv = 1.0f / l[half];
#pragma unroll
    for (int n = 0; n < ND; ++n)
#pragma unroll
      for (int e = 2 * half; e < 2 * half + 2; ++e) {
        const int col = 8 * n + c_elem(lane, e).col;
        if (col < D) out[(b * g.T + row) * g.ld_q + h * g.D + col] = o[n][e] * inv;
      }
    if (lane % 4 == 0) lse[(b * g.H + h) * g.T + row] = m[half] + logf(l[half]);
  }
}

// ---- backward: dq -------------------------------------------------------------------------------

template <int DP>
constexpr std::size_t dq_smem() {
  return sizeof(float) * 2 * kRows +
         sizeof(std::uint16_t) * ((2 * kRows + 2 * kKeys) * (DP + kPad) + DP * (kKeys + kPad));
}

template <int DP>
__global__ void __launch_bounds__(kThreads)
    dq_kernel(float* dq, const float* dout, const float* q, const float* k, const float* v,
              const float* out, const float* lse, Geometry g) {
  constexpr int KD = DP / 16, ND = DP / 8, NB = kKeys / 8, KK = kKeys / 16;
  extern __shared__ __align__(16) std::uint16_t dq_smem_words[];
  float* lse_rows = reinterpret_cast<float*>(dq_smem_words);
  float* delta = lse_rows + kRows;
  const Bf16Tile Q{reinterpret_cast<std::uint16_t*>(delta + kRows), DP + kPad};
  const Bf16Tile dO{Q.p + kRows * (DP + kPad), DP + kPad};
  const Bf16Tile K{dO.p + kRows * (DP + kPad), DP + kPad};
  const Bf16Tile V{K.p + kKeys * (DP + kPad), DP + kPad};
  const Bf16Tile Kt{V.p + kKeys * (DP + kPad), kKeys + kPad};
  const std::int64_t i0 = std::int64_t{gridDim.x - 1 - blockIdx.x} * kRows, h = blockIdx.y,
                     b = blockIdx.z;
  const int D = static_cast<int>(g.D), lane = lane_id(), r_warp = 16 * warp_id();
  const std::int64_t q_off = b * g.T * g.ld_q + h * g.D;
  const std::int64_t kv_off = b * g.keys * g.ld_kv + (h / g.group) * g.D;
  load_rows<kRows, DP>(Q, q + q_off, g.ld_q, i0, g.T, D);
  load_rows<kRows, DP>(dO, dout + q_off, g.ld_q, i0, g.T, D);
  row_stats<kRows>(lse_rows, delta, dout, out, lse, q_off, (b * g.H + h) * g.T, i0, g);
  float acc[ND][4];
#pragma unroll
  for (int n = 0; n < ND; ++n) acc[n][0] = acc[n][1] = acc[n][2] = acc[n][3] = 0.0f;
  const std::int64_t last_row = (i0 + kRows < g.T ? i0 + kRows : g.T) - 1;
  const std::int64_t key_end = g.q_pos + last_row + 1;
  for (std::int64_t j0 = 0; j0 < key_end; j0 += kKeys) {
    __syncthreads();
    load_rows<kKeys, DP>(K, k + kv_off, g.ld_kv, j0, key_end, D);
    load_rows<kKeys, DP>(V, v + kv_off, g.ld_kv, j0, key_end, D);
    load_columns<kKeys, DP>(Kt, k + kv_off, g.ld_kv, j0, key_end, D);
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
        s[n][e] = p * (dp[n][e] - delta[r]);
      }
#pragma unroll
    for (int kk = 0; kk < KK; ++kk) {  // dQ += dS K
      std::uint32_t a[4];
      a_from_c(a, s[2 * kk], s[2 * kk + 1]);
#pragma unroll
      for (int n = 0; n < ND; ++n) {
        std::uint32_t bk[2];
        load_b(bk, Kt, 8 * n, 16 * kk, lane);
        mma_bf16(acc[n], a, bk);
      }
    }
  }
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
  return sizeof(float) * 2 * BQ +
         sizeof(std::uint16_t) * ((2 * kRows + 2 * BQ) * (DP + kPad) + 2 * DP * (BQ + kPad));
}

template <int DP>
__global__ void __launch_bounds__(kThreads)
    dkv_kernel(float* dk, float* dv, const float* dout, const float* q, const float* k,
               const float* v, const float* out, const float* lse, Geometry g) {
  constexpr int BQ = DkvQueryTile<DP>::rows;
  constexpr int KD = DP / 16, ND = DP / 8, NB = BQ / 8, KK = BQ / 16;
  extern __shared__ __align__(16) std::uint16_t dkv_smem_words[];
  float* lse_rows = reinterpret_cast<float*>(dkv_smem_words);
  float* delta = lse_rows + BQ;
  const Bf16Tile K{reinterpret_cast<std::uint16_t*>(delta + BQ), DP + kPad};
  const Bf16Tile V{K.p + kRows * (DP + kPad), DP + kPad};
  const Bf16Tile Q{V.p + kRows * (DP + kPad), DP + kPad};
  const Bf16Tile dO{Q.p + BQ * (DP + kPad), DP + kPad};
  const Bf16Tile Qt{dO.p + BQ * (DP + kPad), BQ + kPad};
  const Bf16Tile dOt{Qt.p + DP * (BQ + kPad), BQ + kPad};
  const std::int64_t j0 = std::int64_t{blockIdx.x} * kRows, kvh = blockIdx.y, b = blockIdx.z;
  const int D = static_cast<int>(g.D), lane = lane_id(), r_warp = 16 * warp_id();
  const std::int64_t kv_off = b * g.keys * g.ld_kv + kvh * g.D;
  load_rows<kRows, DP>(K, k + kv_off, g.ld_kv, j0, g.keys, D);
  load_rows<kRows, DP>(V, v + kv_off, g.ld_kv, j0, g.keys, D);
  float acc_k[ND][4], acc_v[ND][4];
#pragma unroll
  for (int n = 0; n < ND; ++n)
#pragma unroll
    for (int e = 0; e < 4; ++e) acc_k[n][e] = acc_v[n][e] = 0.0f;
  // The first query row whose position reaches this tile's first key.
  const std::int64_t first = j0 > g.q_pos ? j0 - g.q_pos : 0;
  for (std::int64_t h = kvh * g.group; h < (kvh + 1) * g.group; ++h) {
    const std::int64_t q_off = b * g.T * g.ld_q + h * g.D;
    for (std::int64_t i0 = first; i0 < g.T; i0 += BQ) {
      __syncthreads();  // the previous query tile is no longer read
      load_rows<BQ, DP>(Q, q + q_off, g.ld_q, i0, g.T, D);
      load_rows<BQ, DP>(dO, dout + q_off, g.ld_q, i0, g.T, D);
      load_columns<BQ, DP>(Qt, q + q_off, g.ld_q, i0, g.T, D);
      load_columns<BQ, DP>(dOt, dout + q_off, g.ld_q, i0, g.T, D);
      row_stats<BQ>(lse_rows, delta, dout, out, lse, q_off, (b * g.H + h) * g.T, i0, g);
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
          dpt[n][e] = p * (dpt[n][e] - delta[c]);
        }
#pragma unroll
      for (int kk = 0; kk < KK; ++kk) {
        std::uint32_t ap[4], as[4];
        a_from_c(ap, st[2 * kk], st[2 * kk + 1]);
        a_from_c(as, dpt[2 * kk], dpt[2 * kk + 1]);
#pragma unroll
        for (int n = 0; n < ND; ++n) {
          std::uint32_t bo[2], bq[2];
          load_b(bo, dOt, 8 * n, 16 * kk, lane);
          mma_bf16(acc_v[n], ap, bo);  // dV += Pᵀ dO
          load_b(bq, Qt, 8 * n, 16 * kk, lane);
          mma_bf16(acc_k[n], as, bq);  // dK += dSᵀ Q
        }
      }
    }
  }
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

template <int DP>
void forward(const Stream& s, float* out, float* lse, const float* q, const float* k,
             const float* v, const Geometry& g, std::int64_t B) {
  constexpr std::size_t bytes = forward_smem<DP>();
  allow_smem(forward_kernel<DP>, bytes);
  forward_kernel<DP>
      <<<grid(g.T, kRows, g.H, B), kThreads, bytes, s.impl().stream>>>(out, lse, q, k, v, g);
  T3D_CUDA_LAUNCHED();
}

template <int DP>
void backward(const Stream& s, float* dq, float* dk, float* dv, const float* dout, const float* q,
              const float* k, const float* v, const float* out, const float* lse, const Geometry& g,
              std::int64_t B) {
  allow_smem(dq_kernel<DP>, dq_smem<DP>());
  allow_smem(dkv_kernel<DP>, dkv_smem<DP>());
  dq_kernel<DP><<<grid(g.T, kRows, g.H, B), kThreads, dq_smem<DP>(), s.impl().stream>>>(
      dq, dout, q, k, v, out, lse, g);
  T3D_CUDA_LAUNCHED();
  dkv_kernel<DP><<<grid(g.keys, kRows, g.Hkv, B), kThreads, dkv_smem<DP>(), s.impl().stream>>>(
      dk, dv, dout, q, k, v, out, lse, g);
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
