// Embedding, RMSNorm, RoPE and SwiGLU on the GPU, each element through kernels/row_math.h in the
// CPU's order, so that their bits equal the CPU backend's (cuda_ops.h says which).
#include <cub/device/device_radix_sort.cuh>

#include "kernels/cuda/cuda_internal.cuh"
#include "kernels/row_math.h"

namespace t3d::kernels::cuda {
namespace {

__global__ void embedding_forward_kernel(float* out, const std::int32_t* tokens, const float* wte,
                                         std::int64_t N, std::int64_t C, std::int64_t vocab_start,
                                         std::int64_t vocab_end) {
  for (std::int64_t e = blockIdx.x * std::int64_t{blockDim.x} + threadIdx.x; e < N * C;
       e += std::int64_t{gridDim.x} * blockDim.x) {
    const std::int64_t i = e / C, c = e % C, t = tokens[i];
    out[e] = (t >= vocab_start && t < vocab_end) ? wte[(t - vocab_start) * C + c] : 0.0f;
  }
}

__global__ void iota_kernel(std::int32_t* x, std::int64_t n) {
  for (std::int64_t i = blockIdx.x * std::int64_t{blockDim.x} + threadIdx.x; i < n;
       i += std::int64_t{gridDim.x} * blockDim.x)
    x[i] = static_cast<std::int32_t>(i);
}

// dwte[t][c] += dout[i][c] for the rows i of token t in increasing i: the CPU's sequence of adds
// for each (t, c), so its bits. The rows come sorted by token, stably (`token` and `row` of
// sorted position p); a thread per (position that starts a token's run, column) adds the run.
__global__ void embedding_backward_runs_kernel(float* dwte, const float* dout,
                                               const std::int32_t* token, const std::int32_t* row,
                                               std::int64_t N, std::int64_t C,
                                               std::int64_t vocab_start, std::int64_t vocab_end) {
  for (std::int64_t e = blockIdx.x * std::int64_t{blockDim.x} + threadIdx.x; e < N * C;
       e += std::int64_t{gridDim.x} * blockDim.x) {
    const std::int64_t p = e / C, c = e % C, t = token[p];
    if ((p > 0 && token[p - 1] == t) || t < vocab_start || t >= vocab_end) continue;
    float* w = dwte + (t - vocab_start) * C + c;
    float acc = *w;
    for (std::int64_t q = p; q < N && token[q] == t; ++q) acc += dout[row[q] * C + c];
    *w = acc;
  }
}

// RMSNorm: 16 threads per row (kRowLanes rows per block). Lane j sums the columns c ≡ j (mod 16)
// in increasing c, then lanes fold pairwise 8, 4, 2, 1: row_math.h's order, the CPU's bits.
constexpr int kLanes = 16;
constexpr int kRowsPerBlock = kBlock / kLanes;

template <bool Three>
__device__ double row_sum16(const float* a, const float* b, const float* e, std::int64_t C,
                            int lane) {
  double s = 0.0;
#pragma unroll 8  // loads of later columns in flight while the sum waits: same order, same bits
  for (std::int64_t c = lane; c < C; c += kLanes)
    s += Three ? detail::rms_term(a[c], b[c], e[c]) : detail::rms_term(a[c], b[c]);
  for (int w = kLanes / 2; w >= 1; w /= 2) s += __shfl_down_sync(0xffffffffu, s, w, kLanes);
  return __shfl_sync(0xffffffffu, s, 0, kLanes);  // lane 0 holds the row's sum
}

__global__ void rmsnorm_forward_kernel(float* out, bf16* out16, float* rstd, const float* inp,
                                       const float* weight, std::int64_t N, std::int64_t C,
                                       float eps) {
  // Rows past N compute row N - 1 again and write nothing: every lane of the warp reaches the
  // shuffles.
  const std::int64_t mine = blockIdx.x * std::int64_t{kRowsPerBlock} + threadIdx.x / kLanes;
  const bool live = mine < N;
  const std::int64_t row = live ? mine : N - 1;
  const int lane = threadIdx.x % kLanes;
  const float* x = inp + row * C;
  const float r = detail::rms_rstd(row_sum16<false>(x, x, nullptr, C, lane), C, eps);
  if (!live) return;
#pragma unroll 8
  for (std::int64_t c = lane; c < C; c += kLanes) {
    const float y = detail::rms_out(x[c], r, weight[c]);
    out[row * C + c] = y;
    if (out16) out16[row * C + c] = detail::bf16_of(y);
  }
  if (lane == 0) rstd[row] = r;
}

__global__ void rmsnorm_backward_kernel(float* dinp, const float* dout, const float* inp,
                                        const float* weight, const float* rstd, std::int64_t N,
                                        std::int64_t C, bool accumulate) {
  const std::int64_t mine = blockIdx.x * std::int64_t{kRowsPerBlock} + threadIdx.x / kLanes;
  const bool live = mine < N;  // as in the forward
  const std::int64_t row = live ? mine : N - 1;
  const int lane = threadIdx.x % kLanes;
  const float* x = inp + row * C;
  const float* dy = dout + row * C;
  float* dx = dinp + row * C;
  const float r = rstd[row];
  const float k = detail::rms_k(row_sum16<true>(dy, weight, x, C, lane), r, C);
  if (!live) return;
#pragma unroll 8
  for (std::int64_t c = lane; c < C; c += kLanes) {
    const float d = detail::rms_dx(dy[c], x[c], weight[c], r, k);
    dx[c] = accumulate ? dx[c] + d : d;
  }
}

// The weight gradient, dweight_c += sum over rows of row_math.h's rms_dweight_term, summed in
// chunks of kDweightRows rows: one thread per (chunk, column) sums the chunk's rows in order from
// 0 into sums[chunk][c]; then one thread per column adds the chunks' sums to dweight in chunk
// order. The CPU sums each column's rows in one sequence, which leaves a GPU only C threads of
// N sequential adds (a few SMs busy); the chunks regroup the same fp32 terms, so the result
// is within fp32 rounding of the CPU's, and fixed by the shape.
constexpr std::int64_t kDweightRows = 128;

__global__ void rmsnorm_dweight_chunks_kernel(float* sums, const float* dout, const float* inp,
                                              const float* rstd, std::int64_t N, std::int64_t C,
                                              std::int64_t chunks) {
  for (std::int64_t e = blockIdx.x * std::int64_t{blockDim.x} + threadIdx.x; e < chunks * C;
       e += std::int64_t{gridDim.x} * blockDim.x) {
    const std::int64_t c = e % C, i0 = e / C * kDweightRows;
    const std::int64_t i1 = N - i0 < kDweightRows ? N : i0 + kDweightRows;
    float part = 0.0f;
    for (std::int64_t i = i0; i < i1; ++i)
      part += detail::rms_dweight_term(dout[i * C + c], inp[i * C + c], rstd[i]);
    sums[e] = part;
  }
}

__global__ void rmsnorm_dweight_fold_kernel(float* dweight, const float* sums, std::int64_t C,
                                            std::int64_t chunks) {
  const std::int64_t c = blockIdx.x * std::int64_t{blockDim.x} + threadIdx.x;
  if (c >= C) return;
  float acc = dweight[c];
  for (std::int64_t k = 0; k < chunks; ++k) acc += sums[k * C + c];
  dweight[c] = acc;
}

// One thread per (row, head, pair i < D/2).
__global__ void rope_kernel(float* out, const float* inp, const float* table, std::int64_t B,
                            std::int64_t T, std::int64_t n_heads, std::int64_t D,
                            std::int64_t pos_offset, float sign) {
  const std::int64_t half = D / 2, pairs = B * T * n_heads * half;
  for (std::int64_t e = blockIdx.x * std::int64_t{blockDim.x} + threadIdx.x; e < pairs;
       e += std::int64_t{gridDim.x} * blockDim.x) {
    const std::int64_t i = e % half, head_row = e / half;  // head_row = bt * n_heads + h
    const std::int64_t t = head_row / n_heads % T;
    const float* cos = table + (pos_offset + t) * D;
    const std::int64_t at = head_row * D + i;
    const float x1 = inp[at], x2 = inp[at + half];  // both read before writing (in place)
    detail::rope_rotate(x1, x2, cos[i], sign * cos[half + i], out[at], out[at + half]);
  }
}

__global__ void swiglu_forward_kernel(float* h, const float* gate, const float* up,
                                      std::int64_t n) {
  for (std::int64_t i = blockIdx.x * std::int64_t{blockDim.x} + threadIdx.x; i < n;
       i += std::int64_t{gridDim.x} * blockDim.x)
    h[i] = detail::swiglu_value(gate[i], up[i]);
}

__global__ void swiglu_backward_kernel(float* dgate, float* dup, const float* dh, const float* gate,
                                       const float* up, std::int64_t n) {
  for (std::int64_t i = blockIdx.x * std::int64_t{blockDim.x} + threadIdx.x; i < n;
       i += std::int64_t{gridDim.x} * blockDim.x)
    detail::swiglu_grads(dh[i], gate[i], up[i], dgate[i], dup[i]);
}

__global__ void swiglu_forward_bf16_kernel(bf16* h16, bf16* gate16, bf16* up16, const float* gate,
                                           const float* up, std::int64_t n) {
  for (std::int64_t i = blockIdx.x * std::int64_t{blockDim.x} + threadIdx.x; i < n;
       i += std::int64_t{gridDim.x} * blockDim.x) {
    h16[i] = detail::bf16_of(detail::swiglu_value(gate[i], up[i]));
    gate16[i] = detail::bf16_of(gate[i]);
    up16[i] = detail::bf16_of(up[i]);
  }
}

__global__ void swiglu_backward_bf16_kernel(bf16* dgate16, bf16* dup16, const float* dh,
                                            const bf16* gate16, const bf16* up16, std::int64_t n) {
  for (std::int64_t i = blockIdx.x * std::int64_t{blockDim.x} + threadIdx.x; i < n;
       i += std::int64_t{gridDim.x} * blockDim.x) {
    float dg, du;
    detail::swiglu_grads(dh[i], detail::float_of(gate16[i]), detail::float_of(up16[i]), dg, du);
    dgate16[i] = detail::bf16_of(dg);
    dup16[i] = detail::bf16_of(du);
  }
}

unsigned blocks_of(std::int64_t n, std::int64_t per_block) {
  return static_cast<unsigned>((n + per_block - 1) / per_block);
}

}  // namespace

void embedding_forward(const Stream& s, float* out, const std::int32_t* tokens, const float* wte,
                       std::int64_t N, std::int64_t C, std::int64_t vocab_start,
                       std::int64_t vocab_end) {
  T3D_ASSERT(vocab_start >= 0 && vocab_start <= vocab_end, "vocab slice [", vocab_start, ", ",
             vocab_end, ")");
  if (N * C <= 0) return;
  embedding_forward_kernel<<<grid_for(N * C), kBlock, 0, s.impl().stream>>>(out, tokens, wte, N, C,
                                                                            vocab_start, vocab_end);
  T3D_CUDA_LAUNCHED();
}

void embedding_backward(const Stream& s, float* dwte, const float* dout, const std::int32_t* tokens,
                        std::int64_t N, std::int64_t C, std::int64_t vocab_start,
                        std::int64_t vocab_end) {
  if (N * C <= 0) return;
  // The rows sorted by token, stably (CUB's radix sort of (token, row) pairs: a sort's result is
  // unique, so deterministic), in the stream's sort scratch: sorted tokens, rows 0..N-1, sorted
  // rows, then CUB's temporary storage.
  T3D_ASSERT(N <= INT32_MAX, "embedding rows ", N);
  const int n = static_cast<int>(N);
  cudaStream_t st = s.impl().stream;
  std::size_t temp_bytes = 0;
  T3D_CUDA_CHECK(cub::DeviceRadixSort::SortPairs(
      nullptr, temp_bytes, tokens, static_cast<std::int32_t*>(nullptr),
      static_cast<const std::int32_t*>(nullptr), static_cast<std::int32_t*>(nullptr), n, 0, 32,
      st));
  const std::size_t ints = (3 * static_cast<std::size_t>(N) + 63) / 64 * 64;  // 256-byte aligned
  auto* scratch = reinterpret_cast<std::int32_t*>(
      s.impl().sort_scratch.at_least(st, ints * sizeof(std::int32_t) + temp_bytes));
  std::int32_t *sorted_tokens = scratch, *rows = scratch + N, *sorted_rows = scratch + 2 * N;
  iota_kernel<<<grid_for(N), kBlock, 0, st>>>(rows, N);
  T3D_CUDA_LAUNCHED();
  T3D_CUDA_CHECK(cub::DeviceRadixSort::SortPairs(scratch + ints, temp_bytes, tokens, sorted_tokens,
                                                 rows, sorted_rows, n, 0, 32, st));
  embedding_backward_runs_kernel<<<grid_for(N * C), kBlock, 0, st>>>(
      dwte, dout, sorted_tokens, sorted_rows, N, C, vocab_start, vocab_end);
  T3D_CUDA_LAUNCHED();
}

void rmsnorm_forward(const Stream& s, float* out, float* rstd, const float* inp,
                     const float* weight, std::int64_t N, std::int64_t C, float eps, bf16* out16) {
  if (N <= 0) return;
  rmsnorm_forward_kernel<<<blocks_of(N, kRowsPerBlock), kBlock, 0, s.impl().stream>>>(
      out, out16, rstd, inp, weight, N, C, eps);
  T3D_CUDA_LAUNCHED();
}

void rmsnorm_backward(const Stream& s, float* dinp, float* dweight, const float* dout,
                      const float* inp, const float* weight, const float* rstd, std::int64_t N,
                      std::int64_t C, Out mode) {
  if (N <= 0 || C <= 0) return;  // a launch of no blocks is an error
  rmsnorm_backward_kernel<<<blocks_of(N, kRowsPerBlock), kBlock, 0, s.impl().stream>>>(
      dinp, dout, inp, weight, rstd, N, C, mode == Out::kAccumulate);
  T3D_CUDA_LAUNCHED();
  const std::int64_t chunks = (N + kDweightRows - 1) / kDweightRows;
  float* sums =
      s.impl().row_chunk_sums.at_least(s.impl().stream, static_cast<std::size_t>(chunks * C));
  rmsnorm_dweight_chunks_kernel<<<grid_for(chunks * C), kBlock, 0, s.impl().stream>>>(
      sums, dout, inp, rstd, N, C, chunks);
  T3D_CUDA_LAUNCHED();
  rmsnorm_dweight_fold_kernel<<<blocks_of(C, kBlock), kBlock, 0, s.impl().stream>>>(dweight, sums,
                                                                                    C, chunks);
  T3D_CUDA_LAUNCHED();
}

void rope_forward(const Stream& s, float* out, const float* inp, const float* table, std::int64_t B,
                  std::int64_t T, std::int64_t n_heads, std::int64_t D, std::int64_t pos_offset) {
  T3D_ASSERT(D % 2 == 0 && pos_offset >= 0, "RoPE head_dim ", D, " offset ", pos_offset);
  const std::int64_t pairs = B * T * n_heads * (D / 2);
  if (pairs <= 0) return;
  rope_kernel<<<grid_for(pairs), kBlock, 0, s.impl().stream>>>(out, inp, table, B, T, n_heads, D,
                                                               pos_offset, 1.0f);
  T3D_CUDA_LAUNCHED();
}

void rope_backward(const Stream& s, float* dinp, const float* dout, const float* table,
                   std::int64_t B, std::int64_t T, std::int64_t n_heads, std::int64_t D,
                   std::int64_t pos_offset) {
  T3D_ASSERT(D % 2 == 0 && pos_offset >= 0, "RoPE head_dim ", D, " offset ", pos_offset);
  const std::int64_t pairs = B * T * n_heads * (D / 2);
  if (pairs <= 0) return;
  rope_kernel<<<grid_for(pairs), kBlock, 0, s.impl().stream>>>(dinp, dout, table, B, T, n_heads, D,
                                                               pos_offset, -1.0f);
  T3D_CUDA_LAUNCHED();
}

void swiglu_forward(const Stream& s, float* h, const float* gate, const float* up, std::int64_t n) {
  if (n <= 0) return;
  swiglu_forward_kernel<<<grid_for(n), kBlock, 0, s.impl().stream>>>(h, gate, up, n);
  T3D_CUDA_LAUNCHED();
}

void swiglu_backward(const Stream& s, float* dgate, float* dup, const float* dh, const float* gate,
                     const float* up, std::int64_t n) {
  if (n <= 0) return;
  swiglu_backward_kernel<<<grid_for(n), kBlock, 0, s.impl().stream>>>(dgate, dup, dh, gate, up, n);
  T3D_CUDA_LAUNCHED();
}

void swiglu_forward_bf16(const Stream& s, bf16* h16, bf16* gate16, bf16* up16, const float* gate,
                         const float* up, std::int64_t n) {
  if (n <= 0) return;
  swiglu_forward_bf16_kernel<<<grid_for(n), kBlock, 0, s.impl().stream>>>(h16, gate16, up16, gate,
                                                                          up, n);
  T3D_CUDA_LAUNCHED();
}

void swiglu_backward_bf16(const Stream& s, bf16* dgate16, bf16* dup16, const float* dh,
                          const bf16* gate16, const bf16* up16, std::int64_t n) {
  if (n <= 0) return;
  swiglu_backward_bf16_kernel<<<grid_for(n), kBlock, 0, s.impl().stream>>>(dgate16, dup16, dh,
                                                                           gate16, up16, n);
  T3D_CUDA_LAUNCHED();
}

}  // namespace t3d::kernels::cuda
