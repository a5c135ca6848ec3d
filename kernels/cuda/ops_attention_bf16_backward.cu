// The backward of the bf16 tensor-core attention: dq per query tile, dk and dv per key tile, no
// atomics (kernels/cuda/attention_bf16.cuh describes the tiles and their numerics).
#include "kernels/cuda/attention_bf16.cuh"

namespace t3d::kernels::cuda {
namespace {

using namespace attention_bf16;  // NOLINT: this file is their user

// s = X Yᵀ and dp = U Wᵀ for the warp's 16 rows r0.. of X and U against the first NB·8 rows of Y
// and W, over DP columns in order, from one k loop: the backward's scores and the products of
// their gradients (dq: Q Kᵀ and dO Vᵀ; dk, dv: K Qᵀ and V dOᵀ).
template <int DP, int NB>
__device__ __forceinline__ void two_products(float (&s)[NB][4], float (&dp)[NB][4],
                                             const Bf16Tile& X, const Bf16Tile& Y,
                                             const Bf16Tile& U, const Bf16Tile& W, int r0,
                                             int lane) {
#pragma unroll
  for (int n = 0; n < NB; ++n)
#pragma unroll
    for (int e = 0; e < 4; ++e) s[n][e] = dp[n][e] = 0.0f;
#pragma unroll
  for (int kk = 0; kk < DP / 16; ++kk) {
    std::uint32_t ax[4], au[4];
    load_a(ax, X, r0, 16 * kk, lane);
    load_a(au, U, r0, 16 * kk, lane);
#pragma unroll
    for (int n = 0; n < NB; ++n) {
      std::uint32_t by[2], bw[2];
      load_b(by, Y, 8 * n, 16 * kk, lane);
      mma_bf16(s[n], ax, by);
      load_b(bw, W, 8 * n, 16 * kk, lane);
      mma_bf16(dp[n], au, bw);
    }
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
  constexpr int ND = DP / 8, NB = kKeys / 8, KK = kKeys / 16;
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
    two_products<DP>(s, dp, Q, K, dO, V, r_warp, lane);  // S = Q Kᵀ, dP = dO Vᵀ
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
  constexpr int ND = DP / 8, NB = BQ / 8, KK = BQ / 16;
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
      two_products<DP>(st, dpt, K, Q, V, dO, r_warp, lane);  // Sᵀ = K Qᵀ, dPᵀ = V dOᵀ
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
