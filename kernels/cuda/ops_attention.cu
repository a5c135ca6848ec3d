// Causal grouped-query attention on the GPU, fp32, flash-attention 2's tiling: the forward and dq
// run one block per (query tile, head, batch) streaming over key tiles with an online softmax; dk
// and dv run one block per (key tile, kv head, batch) streaming over the group's query heads and
// the query tiles that see the keys. Tiles live in shared memory; probabilities are recomputed
// from lse; no T x T matrix, no scratch, no atomics. Every sum has a fixed order (a thread's own
// loop, then 16-lane shuffle trees), so two runs give the same bits. Layouts, positions and the
// mask are kernels/ops.h's.
//
// Threads: 256 per block as 16 groups (ty) of 16 lanes (tx). For a score tile S (TILE x TILE) a
// thread holds rows ty·RS + i and columns tx + 16·j; for a row tile of width D (O, dQ, dK, dV) rows
// ty·RS + i and columns tx + 16·m. Shared rows are padded by one float (no bank conflicts when
// the 16 lanes read 16 rows at one column).
#include <cmath>
#include <type_traits>

#include "kernels/cuda/attention_geometry.cuh"

namespace t3d::kernels::cuda {
namespace {

constexpr int kThreads = 256, kLanes = 16;

using attention::allow_smem;
using attention::Geometry;
using attention::geometry;
using attention::grid;

// Shared-memory views: a tile of `rows` rows of `width` floats, padded by one.
struct Tile {
  float* p;
  int stride;
  __device__ float& at(int r, int c) const { return p[r * stride + c]; }
};

// The backward kernels' shared memory, carved in this order: the row tiles Q, dO, K, V (TILE rows
// of D floats, padded by one), the TILE × TILE tiles P and dS (padded by one), then TILE floats of
// lse and TILE of delta. `floats` is the whole, which the launch requests (backward_smem).
template <int TILE>
struct BackwardTiles {
  static constexpr std::size_t floats(int D) {
    return 4 * std::size_t{TILE} * (D + 1) + 2 * std::size_t{TILE} * (TILE + 1) + 2 * TILE;
  }
  Tile Q, dO, K, V, P, dS;
  float* lse_rows;
  float* delta;
  __device__ BackwardTiles(float* smem, int D)
      : Q{smem, D + 1},
        dO{Q.p + TILE * (D + 1), D + 1},
        K{dO.p + TILE * (D + 1), D + 1},
        V{K.p + TILE * (D + 1), D + 1},
        P{V.p + TILE * (D + 1), TILE + 1},
        dS{P.p + TILE * (TILE + 1), TILE + 1},
        lse_rows(dS.p + TILE * (TILE + 1)),
        delta(lse_rows + TILE) {}
};

// Loads rows [r0, r0 + rows) of a strided global matrix (row r at base + r·ld, D floats), zeros
// past `limit` rows, into a tile.
template <int TILE>
__device__ void load_rows(Tile t, const float* base, std::int64_t ld, std::int64_t r0,
                          std::int64_t limit, int D) {
  for (int e = threadIdx.x; e < TILE * D; e += kThreads) {
    const int r = e / D, c = e % D;
    t.at(r, c) = r0 + r < limit ? base[(r0 + r) * ld + c] : 0.0f;
  }
}

// The 16 lanes of a group folded pairwise (8, 4, 2, 1), the result in every lane.
__device__ float lanes_sum(float v) {
  for (int w = kLanes / 2; w >= 1; w /= 2) v += __shfl_xor_sync(0xffffffffu, v, w, kLanes);
  return v;
}
__device__ float lanes_max(float v) {
  for (int w = kLanes / 2; w >= 1; w /= 2) v = fmaxf(v, __shfl_xor_sync(0xffffffffu, v, w, kLanes));
  return v;
}

// acc[i][j] = Σ_d A[ty·RS + i][d] · B[tx + 16 j][d]: a score tile from two row tiles.
template <int TILE>
__device__ void scores(float (&acc)[TILE / 16][TILE / 16], Tile A, Tile B, int D) {
  constexpr int RS = TILE / 16;
  const int ty = threadIdx.x / kLanes, tx = threadIdx.x % kLanes;
#pragma unroll
  for (int i = 0; i < RS; ++i)
#pragma unroll
    for (int j = 0; j < RS; ++j) acc[i][j] = 0.0f;
  for (int d = 0; d < D; ++d) {
    float a[RS], b[RS];
#pragma unroll
    for (int i = 0; i < RS; ++i) a[i] = A.at(ty * RS + i, d);
#pragma unroll
    for (int j = 0; j < RS; ++j) b[j] = B.at(tx + 16 * j, d);
#pragma unroll
    for (int i = 0; i < RS; ++i)
#pragma unroll
      for (int j = 0; j < RS; ++j) acc[i][j] += a[i] * b[j];
  }
}

// acc[i][m] += Σ_c W(ty·RS + i, c) · V[c][tx + 16 m] over c < TILE, with W(r, c) = Wt.at(r, c), or
// Wt.at(c, r) when `transposed` (dV += Pᵀ dO, dK += dSᵀ Q).
template <int TILE, int DMAX, bool transposed>
__device__ void accumulate_rows(float (&acc)[TILE / 16][DMAX / 16], Tile W, Tile V, int D) {
  constexpr int RS = TILE / 16, CM = DMAX / 16;
  const int ty = threadIdx.x / kLanes, tx = threadIdx.x % kLanes;
  for (int c = 0; c < TILE; ++c) {
    float w[RS];
#pragma unroll
    for (int i = 0; i < RS; ++i) w[i] = transposed ? W.at(c, ty * RS + i) : W.at(ty * RS + i, c);
#pragma unroll
    for (int m = 0; m < CM; ++m) {
      const int col = tx + 16 * m;
      if (col < D) {
        const float v = V.at(c, col);
#pragma unroll
        for (int i = 0; i < RS; ++i) acc[i][m] += w[i] * v;
      }
    }
  }
}

template <int TILE>
constexpr int tile_floats(int dmax) {
  return TILE * (dmax + 1);
}

// ---- forward ------------------------------------------------------------------------------------

template <int TILE, int DMAX>
__global__ void __launch_bounds__(kThreads)
    forward_kernel(float* out, float* lse, const float* q, const float* k, const float* v,
                   Geometry g) {
  constexpr int RS = TILE / 16, CM = DMAX / 16;
  extern __shared__ float smem[];
  const int D = static_cast<int>(g.D), stride = D + 1;
  Tile Q{smem, stride}, K{smem + TILE * stride, stride}, V{smem + 2 * TILE * stride, stride};
  Tile P{smem + 3 * TILE * stride, TILE + 1};
  const std::int64_t i0 = std::int64_t{blockIdx.x} * TILE, h = blockIdx.y, b = blockIdx.z;
  const int ty = threadIdx.x / kLanes, tx = threadIdx.x % kLanes;
  const float* qh = q + b * g.T * g.ld_q + h * g.D;
  const float* kh = k + b * g.keys * g.ld_kv + (h / g.group) * g.D;
  const float* vh = v + b * g.keys * g.ld_kv + (h / g.group) * g.D;
  load_rows<TILE>(Q, qh, g.ld_q, i0, g.T, D);
  float m[RS], l[RS], o[RS][CM];
#pragma unroll
  for (int i = 0; i < RS; ++i) {
    m[i] = -INFINITY;
    l[i] = 0.0f;
#pragma unroll
    for (int c = 0; c < CM; ++c) o[i][c] = 0.0f;
  }
  const std::int64_t last_row = (i0 + TILE < g.T ? i0 + TILE : g.T) - 1;
  const std::int64_t key_end = g.q_pos + last_row + 1;  // keys [0, key_end) are seen by the tile
  for (std::int64_t j0 = 0; j0 < key_end; j0 += TILE) {
    __syncthreads();  // the previous tile's K, V, P are no longer read
    load_rows<TILE>(K, kh, g.ld_kv, j0, key_end, D);
    load_rows<TILE>(V, vh, g.ld_kv, j0, key_end, D);
    __syncthreads();
    float s[RS][RS];
    scores<TILE>(s, Q, K, D);
#pragma unroll
    for (int i = 0; i < RS; ++i) {
      const std::int64_t row = i0 + ty * RS + i, pos = g.q_pos + row;
      float tile_max = -INFINITY;
#pragma unroll
      for (int j = 0; j < RS; ++j) {
        const std::int64_t key = j0 + tx + 16 * j;
        const bool seen = row < g.T && key <= pos;
        s[i][j] = seen ? s[i][j] * g.scale : -INFINITY;
        tile_max = fmaxf(tile_max, s[i][j]);
      }
      const float m_new = fmaxf(m[i], lanes_max(tile_max));
      float sum = 0.0f;
#pragma unroll
      for (int j = 0; j < RS; ++j) {
        const float p = s[i][j] == -INFINITY ? 0.0f : expf(s[i][j] - m_new);
        P.at(ty * RS + i, tx + 16 * j) = p;
        sum += p;
      }
      const float alpha = m[i] == -INFINITY ? 0.0f : expf(m[i] - m_new);
      l[i] = l[i] * alpha + lanes_sum(sum);
      m[i] = m_new;
#pragma unroll
      for (int c = 0; c < CM; ++c) o[i][c] *= alpha;
    }
    __syncthreads();
    accumulate_rows<TILE, DMAX, false>(o, P, V, D);
  }
#pragma unroll
  for (int i = 0; i < RS; ++i) {
    const std::int64_t row = i0 + ty * RS + i;
    if (row >= g.T) continue;
    const float inv = 1.0f / l[i];
#pragma unroll
    for (int c = 0; c < CM; ++c) {
      const int col = tx + 16 * c;
      if (col < D) out[(b * g.T + row) * g.ld_q + h * g.D + col] = o[i][c] * inv;
    }
    if (tx == 0) lse[(b * g.H + h) * g.T + row] = m[i] + logf(l[i]);
  }
}

// ---- backward -----------------------------------------------------------------------------------

// delta[r] = rowsum(dO · O) of the query tile's rows, into shared memory (zero past T).
template <int TILE, int DMAX>
__device__ void row_deltas(float* delta, Tile dO, const float* oh, std::int64_t ld, std::int64_t i0,
                           std::int64_t T, int D) {
  constexpr int RS = TILE / 16, CM = DMAX / 16;
  const int ty = threadIdx.x / kLanes, tx = threadIdx.x % kLanes;
#pragma unroll
  for (int i = 0; i < RS; ++i) {
    const int r = ty * RS + i;
    float part = 0.0f;
    if (i0 + r < T) {
#pragma unroll
      for (int c = 0; c < CM; ++c) {
        const int col = tx + 16 * c;
        if (col < D) part += oh[(i0 + r) * ld + col] * dO.at(r, col);
      }
    }
    const float all = lanes_sum(part);
    if (tx == 0) delta[r] = all;
  }
}

// Loads query tile i0 of one head (rows of Q and dO at q_off, the head's lse rows at lse_off)
// and computes its deltas. The deltas are read only after the caller's next __syncthreads.
template <int TILE, int DMAX>
__device__ void load_query_tile(const BackwardTiles<TILE>& t, const float* q, const float* dout,
                                const float* out, const float* lse, std::int64_t q_off,
                                std::int64_t lse_off, std::int64_t i0, const Geometry& g, int D) {
  load_rows<TILE>(t.Q, q + q_off, g.ld_q, i0, g.T, D);
  load_rows<TILE>(t.dO, dout + q_off, g.ld_q, i0, g.T, D);
  for (int r = threadIdx.x; r < TILE; r += kThreads)
    t.lse_rows[r] = i0 + r < g.T ? lse[lse_off + i0 + r] : 0.0f;
  __syncthreads();
  row_deltas<TILE, DMAX>(t.delta, t.dO, out + q_off, g.ld_q, i0, g.T, D);
}

// For one (query tile, key tile) pair: P = exp(scale·Q Kᵀ − lse) and dS = P (dO Vᵀ − delta) into
// shared tiles, with the causal mask and the rows past T zero.
template <int TILE>
__device__ void probabilities_and_grads(Tile P, Tile dS, Tile Q, Tile K, Tile dO, Tile V,
                                        const float* lse_rows, const float* delta, std::int64_t i0,
                                        std::int64_t j0, const Geometry& g, int D) {
  constexpr int RS = TILE / 16;
  const int ty = threadIdx.x / kLanes, tx = threadIdx.x % kLanes;
  float s[RS][RS], dp[RS][RS];
  scores<TILE>(s, Q, K, D);
  scores<TILE>(dp, dO, V, D);
#pragma unroll
  for (int i = 0; i < RS; ++i) {
    const int r = ty * RS + i;
    const std::int64_t row = i0 + r, pos = g.q_pos + row;
#pragma unroll
    for (int j = 0; j < RS; ++j) {
      const int c = tx + 16 * j;
      const std::int64_t key = j0 + c;
      const bool seen = row < g.T && key < g.keys && key <= pos;
      const float p = seen ? expf(s[i][j] * g.scale - lse_rows[r]) : 0.0f;
      P.at(r, c) = p;
      dS.at(r, c) = p * (dp[i][j] - delta[r]);
    }
  }
}

template <int TILE, int DMAX>
__global__ void __launch_bounds__(kThreads)
    dq_kernel(float* dq, const float* dout, const float* q, const float* k, const float* v,
              const float* out, const float* lse, Geometry g) {
  constexpr int RS = TILE / 16, CM = DMAX / 16;
  extern __shared__ float smem[];
  const int D = static_cast<int>(g.D);
  const BackwardTiles<TILE> t(smem, D);
  const std::int64_t i0 = std::int64_t{blockIdx.x} * TILE, h = blockIdx.y, b = blockIdx.z;
  const int ty = threadIdx.x / kLanes, tx = threadIdx.x % kLanes;
  const std::int64_t q_off = b * g.T * g.ld_q + h * g.D;
  const std::int64_t kv_off = b * g.keys * g.ld_kv + (h / g.group) * g.D;
  load_query_tile<TILE, DMAX>(t, q, dout, out, lse, q_off, (b * g.H + h) * g.T, i0, g, D);
  float acc[RS][CM] = {};
  const std::int64_t last_row = (i0 + TILE < g.T ? i0 + TILE : g.T) - 1;
  const std::int64_t key_end = g.q_pos + last_row + 1;
  for (std::int64_t j0 = 0; j0 < key_end; j0 += TILE) {
    __syncthreads();
    load_rows<TILE>(t.K, k + kv_off, g.ld_kv, j0, key_end, D);
    load_rows<TILE>(t.V, v + kv_off, g.ld_kv, j0, key_end, D);
    __syncthreads();
    probabilities_and_grads<TILE>(t.P, t.dS, t.Q, t.K, t.dO, t.V, t.lse_rows, t.delta, i0, j0, g,
                                  D);
    __syncthreads();
    accumulate_rows<TILE, DMAX, false>(acc, t.dS, t.K, D);  // dQ += dS K
  }
#pragma unroll
  for (int i = 0; i < RS; ++i) {
    const std::int64_t row = i0 + ty * RS + i;
    if (row >= g.T) continue;
#pragma unroll
    for (int c = 0; c < CM; ++c) {
      const int col = tx + 16 * c;
      if (col < D) dq[q_off + row * g.ld_q + col] = g.scale * acc[i][c];
    }
  }
}

template <int TILE, int DMAX>
__global__ void __launch_bounds__(kThreads)
    dkv_kernel(float* dk, float* dv, const float* dout, const float* q, const float* k,
               const float* v, const float* out, const float* lse, Geometry g) {
  constexpr int RS = TILE / 16, CM = DMAX / 16;
  extern __shared__ float smem[];
  const int D = static_cast<int>(g.D);
  const BackwardTiles<TILE> t(smem, D);
  const std::int64_t j0 = std::int64_t{blockIdx.x} * TILE, kvh = blockIdx.y, b = blockIdx.z;
  const int ty = threadIdx.x / kLanes, tx = threadIdx.x % kLanes;
  const std::int64_t kv_off = b * g.keys * g.ld_kv + kvh * g.D;
  load_rows<TILE>(t.K, k + kv_off, g.ld_kv, j0, g.keys, D);
  load_rows<TILE>(t.V, v + kv_off, g.ld_kv, j0, g.keys, D);
  float acc_k[RS][CM] = {}, acc_v[RS][CM] = {};
  // The first query row whose position reaches this tile's first key.
  const std::int64_t first = j0 > g.q_pos ? j0 - g.q_pos : 0;
  for (std::int64_t h = kvh * g.group; h < (kvh + 1) * g.group; ++h) {
    const std::int64_t q_off = b * g.T * g.ld_q + h * g.D;
    for (std::int64_t i0 = first; i0 < g.T; i0 += TILE) {
      __syncthreads();
      load_query_tile<TILE, DMAX>(t, q, dout, out, lse, q_off, (b * g.H + h) * g.T, i0, g, D);
      __syncthreads();
      probabilities_and_grads<TILE>(t.P, t.dS, t.Q, t.K, t.dO, t.V, t.lse_rows, t.delta, i0, j0, g,
                                    D);
      __syncthreads();
      accumulate_rows<TILE, DMAX, true>(acc_v, t.P, t.dO, D);  // dV += Pᵀ dO
      accumulate_rows<TILE, DMAX, true>(acc_k, t.dS, t.Q, D);  // dK += dSᵀ Q
    }
  }
#pragma unroll
  for (int i = 0; i < RS; ++i) {
    const std::int64_t key = j0 + ty * RS + i;
    if (key >= g.keys) continue;
#pragma unroll
    for (int c = 0; c < CM; ++c) {
      const int col = tx + 16 * c;
      if (col >= D) continue;
      dk[kv_off + key * g.ld_kv + col] = g.scale * acc_k[i][c];
      dv[kv_off + key * g.ld_kv + col] = acc_v[i][c];
    }
  }
}

// Shared bytes: the forward's 3 row tiles and P; the backward's BackwardTiles.
template <int TILE>
std::size_t forward_smem(int D) {
  return sizeof(float) * (3 * TILE * (D + 1) + TILE * (TILE + 1));
}
template <int TILE>
std::size_t backward_smem(int D) {
  return sizeof(float) * BackwardTiles<TILE>::floats(D);
}

template <int TILE, int DMAX>
void forward(const Stream& s, float* out, float* lse, const float* q, const float* k,
             const float* v, const Geometry& g, std::int64_t B) {
  const std::size_t bytes = forward_smem<TILE>(static_cast<int>(g.D));
  // The instance's largest need, the same on every call: host threads launching it with other
  // head dims cannot lower the limit between another's setting and its launch.
  allow_smem(forward_kernel<TILE, DMAX>, forward_smem<TILE>(DMAX));
  forward_kernel<TILE, DMAX>
      <<<grid(g.T, TILE, g.H, B), kThreads, bytes, s.impl().stream>>>(out, lse, q, k, v, g);
  T3D_CUDA_LAUNCHED();
}

template <int TILE, int DMAX>
void backward(const Stream& s, float* dq, float* dk, float* dv, const float* dout, const float* q,
              const float* k, const float* v, const float* out, const float* lse, const Geometry& g,
              std::int64_t B) {
  const std::size_t bytes = backward_smem<TILE>(static_cast<int>(g.D));
  allow_smem(dq_kernel<TILE, DMAX>, backward_smem<TILE>(DMAX));  // as in forward
  allow_smem(dkv_kernel<TILE, DMAX>, backward_smem<TILE>(DMAX));
  dq_kernel<TILE, DMAX><<<grid(g.T, TILE, g.H, B), kThreads, bytes, s.impl().stream>>>(
      dq, dout, q, k, v, out, lse, g);
  T3D_CUDA_LAUNCHED();
  dkv_kernel<TILE, DMAX><<<grid(g.keys, TILE, g.Hkv, B), kThreads, bytes, s.impl().stream>>>(
      dk, dv, dout, q, k, v, out, lse, g);
  T3D_CUDA_LAUNCHED();
}

}  // namespace

int attention_fp32_tile(std::int64_t head_dim, std::size_t smem_per_block) {
  if (head_dim <= 128) return backward_smem<64>(128) <= smem_per_block ? 64 : 32;
  return backward_smem<32>(256) <= smem_per_block ? 32 : 16;
}

namespace {

template <int N>
using I = std::integral_constant<int, N>;

// Runs run(TILE, DMAX) (std::integral_constant each) on the kernels' instance for `tile` rows
// (0: the GPU's) at head dim D.
template <class Run>
void with_tiles(const Stream& s, std::int64_t D, int tile, Run&& run) {
  if (tile == 0) tile = attention_fp32_tile(D, s.impl().smem_per_block);
  T3D_ASSERT(D <= 128 ? tile == 64 || tile == 32 : tile == 32 || tile == 16,
             "fp32 attention tiles of ", tile, " rows at head dim ", D);
  if (D <= 128) return tile == 64 ? run(I<64>{}, I<128>{}) : run(I<32>{}, I<128>{});
  return tile == 32 ? run(I<32>{}, I<256>{}) : run(I<16>{}, I<256>{});
}

}  // namespace

void attention_forward(const Stream& s, float* out, float* lse, const float* q, const float* k,
                       const float* v, const AttentionShape& shape, int tile) {
  const Geometry g = geometry(shape);
  with_tiles(s, g.D, tile, [&](auto rows, auto dmax) {
    forward<decltype(rows)::value, decltype(dmax)::value>(s, out, lse, q, k, v, g, shape.B);
  });
}

void attention_backward(const Stream& s, float* dq, float* dk, float* dv, const float* dout,
                        const float* q, const float* k, const float* v, const float* out,
                        const float* lse, const AttentionShape& shape, int tile) {
  const Geometry g = geometry(shape);
  with_tiles(s, g.D, tile, [&](auto rows, auto dmax) {
    backward<decltype(rows)::value, decltype(dmax)::value>(s, dq, dk, dv, dout, q, k, v, out, lse,
                                                           g, shape.B);
  });
}

void attention_decode(const Stream& s, float* out, const float* q, const float* k_cache,
                      const float* v_cache, float* lse, std::int64_t n, std::int64_t n_heads,
                      std::int64_t n_kv_heads, std::int64_t head_dim) {
  T3D_ASSERT(n > 0, "decoding needs at least the query's own key, got n = ", n);
  AttentionShape shape;
  shape.B = 1, shape.T = 1, shape.n_heads = n_heads, shape.n_kv_heads = n_kv_heads;
  shape.head_dim = head_dim, shape.q_pos = n - 1, shape.kv_len = n;
  attention_forward(s, out, lse, q, k_cache, v_cache, shape);
}

}  // namespace t3d::kernels::cuda
