// The forward of the bf16 tensor-core attention (kernels/cuda/attention_bf16.cuh describes the
// tiles and their numerics).
#include "kernels/cuda/attention_bf16.cuh"

namespace t3d::kernels::cuda {
namespace {

using namespace attention_bf16;  // NOLINT: this file is their user

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

// One m-tile's step of the online softmax over a key tile: its scores (C fragments of rows row0 +
// groupID and + 8, keys j0..) masked and scaled, the running max m and sum l of each row updated,
// the output accumulators rescaled, and the scores replaced by exp(s - m) (P, fp32).
template <int NB, int ND>
__device__ __forceinline__ void softmax_step(float (&s)[NB][4], float (&m)[2], float (&l)[2],
                                             float (&o)[ND][4], std::int64_t row0, std::int64_t j0,
                                             const Geometry& g, int lane) {
#pragma unroll
  for (int half = 0; half < 2; ++half) {
    const std::int64_t row = row0 + c_elem(lane, 2 * half).row, pos = g.q_pos + row;
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
}

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
      softmax_step(s[t], m[t], l[t], o[t], i0 + r_warp + 16 * t, j0, g, lane);
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

}  // namespace t3d::kernels::cuda
