// Causal grouped-query attention on the GPU, fp32, deterministic. Simple by design (the speed is
// a later step): one block per query row for the forward and dq, one block per key row for dk and
// dv, each streaming over the other side in chunks of kChunk with fixed-order sums, so no T x T
// matrix, no scratch and no atomics. Layouts, positions and the mask are kernels/ops.h's.
#include <cmath>

#include "kernels/cuda/cuda_internal.cuh"

namespace t3d::kernels::cuda {
namespace {

constexpr int kChunk = 128;                       // threads per block = keys (queries) per chunk
constexpr int kSlots = kMaxHeadDim / kChunk;      // output columns per thread: d = tid + k·kChunk

struct Geometry {  // strides of q/out/dq (ld_q) and k/v/dk/dv (ld_kv), the GQA group
  std::int64_t T, keys, H, Hkv, D, group, ld_q, ld_kv, q_pos;
  float scale;
};

__device__ float dot(const float* a, const float* b, std::int64_t D) {
  float s = 0.0f;
  for (std::int64_t d = 0; d < D; ++d) s += a[d] * b[d];
  return s;
}

template <class T, class Op>
__device__ T fold(T mine, Op op) {  // the block's values folded pairwise; every thread gets it
  __shared__ T buf[kChunk];
  buf[threadIdx.x] = mine;
  __syncthreads();
  for (int w = kChunk / 2; w > 0; w /= 2) {
    if (threadIdx.x < w) buf[threadIdx.x] = op(buf[threadIdx.x], buf[threadIdx.x + w]);
    __syncthreads();
  }
  const T all = buf[0];
  __syncthreads();
  return all;
}
struct MaxOp {
  __device__ float operator()(float a, float b) const { return b > a ? b : a; }
};
struct SumOp {
  __device__ float operator()(float a, float b) const { return a + b; }
};

// Block (i, h, b): query row i of head h, batch b.
__global__ void forward_kernel(float* out, float* lse, const float* q, const float* k,
                               const float* v, Geometry g) {
  const std::int64_t i = blockIdx.x, h = blockIdx.y, b = blockIdx.z;
  const int tid = threadIdx.x;
  const float* qi = q + (b * g.T + i) * g.ld_q + h * g.D;
  const float* kh = k + b * g.keys * g.ld_kv + (h / g.group) * g.D;
  const float* vh = v + b * g.keys * g.ld_kv + (h / g.group) * g.D;
  __shared__ float p[kChunk];
  const std::int64_t visible = g.q_pos + i + 1;  // keys 0 .. q_pos + i
  float m = -INFINITY, l = 0.0f, o[kSlots] = {};
  for (std::int64_t j0 = 0; j0 < visible; j0 += kChunk) {
    const std::int64_t j = j0 + tid;
    const int n = static_cast<int>(visible - j0 < kChunk ? visible - j0 : kChunk);
    const float score = j < visible ? g.scale * dot(qi, kh + j * g.ld_kv, g.D) : -INFINITY;
    const float m_new = fmaxf(m, fold(score, MaxOp{}));
    const float e = j < visible ? expf(score - m_new) : 0.0f;
    p[tid] = e;
    const float sum = fold(e, SumOp{});  // also orders the writes of p before the reads below
    const float alpha = m == -INFINITY ? 0.0f : expf(m - m_new);
    l = l * alpha + sum;
    for (int k2 = 0; k2 < kSlots; ++k2) {
      const std::int64_t d = tid + k2 * kChunk;
      if (d >= g.D) break;
      float acc = o[k2] * alpha;
      for (int t = 0; t < n; ++t) acc += p[t] * vh[(j0 + t) * g.ld_kv + d];
      o[k2] = acc;
    }
    m = m_new;
    __syncthreads();  // p is rewritten by the next chunk
  }
  const float inv = 1.0f / l;
  for (int k2 = 0; k2 < kSlots; ++k2) {
    const std::int64_t d = tid + k2 * kChunk;
    if (d < g.D) out[(b * g.T + i) * g.ld_q + h * g.D + d] = o[k2] * inv;
  }
  if (tid == 0) lse[(b * g.H + h) * g.T + i] = m + logf(l);
}

// Block (i, h, b): dq of query row i, dq = scale Σ_j dS_ij k_j with dS = P (dP - rowsum(dO·O)).
__global__ void dq_kernel(float* dq, const float* dout, const float* q, const float* k,
                          const float* v, const float* out, const float* lse, Geometry g) {
  const std::int64_t i = blockIdx.x, h = blockIdx.y, b = blockIdx.z;
  const int tid = threadIdx.x;
  const std::int64_t row = (b * g.T + i) * g.ld_q + h * g.D;
  const float* kh = k + b * g.keys * g.ld_kv + (h / g.group) * g.D;
  const float* vh = v + b * g.keys * g.ld_kv + (h / g.group) * g.D;
  const float delta = dot(out + row, dout + row, g.D);  // every thread, the same order
  const float lse_i = lse[(b * g.H + h) * g.T + i];
  __shared__ float ds[kChunk];
  const std::int64_t visible = g.q_pos + i + 1;
  float acc[kSlots] = {};
  for (std::int64_t j0 = 0; j0 < visible; j0 += kChunk) {
    const std::int64_t j = j0 + tid;
    const int n = static_cast<int>(visible - j0 < kChunk ? visible - j0 : kChunk);
    float d_s = 0.0f;
    if (j < visible) {
      const float pij = expf(g.scale * dot(q + row, kh + j * g.ld_kv, g.D) - lse_i);
      d_s = pij * (dot(dout + row, vh + j * g.ld_kv, g.D) - delta);
    }
    ds[tid] = d_s;
    __syncthreads();
    for (int k2 = 0; k2 < kSlots; ++k2) {
      const std::int64_t d = tid + k2 * kChunk;
      if (d >= g.D) break;
      for (int t = 0; t < n; ++t) acc[k2] += ds[t] * kh[(j0 + t) * g.ld_kv + d];
    }
    __syncthreads();
  }
  for (int k2 = 0; k2 < kSlots; ++k2) {
    const std::int64_t d = tid + k2 * kChunk;
    if (d < g.D) dq[row + d] = g.scale * acc[k2];
  }
}

// Block (j, kvh, b): dk and dv of key row j of kv head kvh, over the group's query heads in order
// and, per head, the query rows that see key j (positions >= j) in order.
__global__ void dkv_kernel(float* dk, float* dv, const float* dout, const float* q, const float* k,
                           const float* v, const float* out, const float* lse, Geometry g) {
  const std::int64_t j = blockIdx.x, kvh = blockIdx.y, b = blockIdx.z;
  const int tid = threadIdx.x;
  const std::int64_t kv_row = (b * g.keys + j) * g.ld_kv + kvh * g.D;
  __shared__ float p[kChunk], ds[kChunk];
  float acc_k[kSlots] = {}, acc_v[kSlots] = {};
  const std::int64_t first = j > g.q_pos ? j - g.q_pos : 0;  // the first row whose position >= j
  for (std::int64_t h = kvh * g.group; h < (kvh + 1) * g.group; ++h) {
    for (std::int64_t i0 = first; i0 < g.T; i0 += kChunk) {
      const std::int64_t i = i0 + tid;
      const int n = static_cast<int>(g.T - i0 < kChunk ? g.T - i0 : kChunk);
      float pij = 0.0f, d_s = 0.0f;
      if (i < g.T) {
        const std::int64_t row = (b * g.T + i) * g.ld_q + h * g.D;
        const float delta = dot(out + row, dout + row, g.D);
        pij = expf(g.scale * dot(q + row, k + kv_row, g.D) - lse[(b * g.H + h) * g.T + i]);
        d_s = pij * (dot(dout + row, v + kv_row, g.D) - delta);
      }
      p[tid] = pij;
      ds[tid] = d_s;
      __syncthreads();
      for (int k2 = 0; k2 < kSlots; ++k2) {
        const std::int64_t d = tid + k2 * kChunk;
        if (d >= g.D) break;
        for (int t = 0; t < n; ++t) {
          const std::int64_t row = (b * g.T + i0 + t) * g.ld_q + h * g.D + d;
          acc_v[k2] += p[t] * dout[row];
          acc_k[k2] += ds[t] * q[row];
        }
      }
      __syncthreads();
    }
  }
  for (int k2 = 0; k2 < kSlots; ++k2) {
    const std::int64_t d = tid + k2 * kChunk;
    if (d >= g.D) continue;
    dk[kv_row + d] = g.scale * acc_k[k2];
    dv[kv_row + d] = acc_v[k2];
  }
}

Geometry geometry(const AttentionShape& s) {
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

}  // namespace

void attention_forward(const Stream& s, float* out, float* lse, const float* q, const float* k,
                       const float* v, const AttentionShape& shape) {
  const Geometry g = geometry(shape);
  const dim3 grid(static_cast<unsigned>(g.T), static_cast<unsigned>(g.H),
                  static_cast<unsigned>(shape.B));
  forward_kernel<<<grid, kChunk, 0, s.impl().stream>>>(out, lse, q, k, v, g);
  T3D_CUDA_LAUNCHED();
}

void attention_backward(const Stream& s, float* dq, float* dk, float* dv, const float* dout,
                        const float* q, const float* k, const float* v, const float* out,
                        const float* lse, const AttentionShape& shape) {
  const Geometry g = geometry(shape);
  const dim3 q_grid(static_cast<unsigned>(g.T), static_cast<unsigned>(g.H),
                    static_cast<unsigned>(shape.B));
  dq_kernel<<<q_grid, kChunk, 0, s.impl().stream>>>(dq, dout, q, k, v, out, lse, g);
  T3D_CUDA_LAUNCHED();
  const dim3 kv_grid(static_cast<unsigned>(g.keys), static_cast<unsigned>(g.Hkv),
                     static_cast<unsigned>(shape.B));
  dkv_kernel<<<kv_grid, kChunk, 0, s.impl().stream>>>(dk, dv, dout, q, k, v, out, lse, g);
  T3D_CUDA_LAUNCHED();
}

}  // namespace t3d::kernels::cuda
