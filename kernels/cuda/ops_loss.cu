// Softmax cross-entropy on the GPU: one block per row; the row's max and sum of exponentials are
// reduced in a fixed order (strided per thread, then pairwise), the sum in double as on the CPU.
#include <cmath>

#include "kernels/cuda/cuda_internal.cuh"

namespace t3d::kernels::cuda {
namespace {

template <class T, class Op>
__device__ T block_fold(T mine, Op op) {  // every thread gets the fold of the block's values
  __shared__ T buf[kBlock];
  buf[threadIdx.x] = mine;
  __syncthreads();
  for (int w = kBlock / 2; w > 0; w /= 2) {
    if (threadIdx.x < w) buf[threadIdx.x] = op(buf[threadIdx.x], buf[threadIdx.x + w]);
    __syncthreads();
  }
  const T all = buf[0];
  __syncthreads();  // buf may be reused by the next fold
  return all;
}

struct Max {
  __device__ float operator()(float a, float b) const { return b > a ? b : a; }
};
struct Sum {
  __device__ double operator()(double a, double b) const { return a + b; }
};

__device__ float row_max_of(const float* x, std::int64_t V) {
  float m = -INFINITY;
  for (std::int64_t j = threadIdx.x; j < V; j += kBlock) m = x[j] > m ? x[j] : m;
  return block_fold(m, Max{});
}

__device__ float row_sum_exp(const float* x, std::int64_t V, float max) {
  double s = 0.0;
  for (std::int64_t j = threadIdx.x; j < V; j += kBlock) s += expf(x[j] - max);
  return static_cast<float>(block_fold(s, Sum{}));
}

// x = (softmax - onehot) · grad_scale; the row's loss from thread 0.
__device__ void loss_and_grad_row(float* x, float* loss, std::int64_t V, float max, float sum_exp,
                                  float target_logit, std::int64_t local_target, float grad_scale) {
  const float inv_sum = 1.0f / sum_exp;
  for (std::int64_t j = threadIdx.x; j < V; j += kBlock)
    x[j] = expf(x[j] - max) * inv_sum * grad_scale;
  __syncthreads();
  if (threadIdx.x == 0) {
    if (local_target >= 0) x[local_target] -= grad_scale;
    *loss = logf(sum_exp) + max - target_logit;
  }
}

__device__ void zero_row(float* x, float* loss, std::int64_t V) {
  for (std::int64_t j = threadIdx.x; j < V; j += kBlock) x[j] = 0.0f;
  if (threadIdx.x == 0) *loss = 0.0f;
}

__global__ void fused_kernel(float* logits, float* losses, const std::int32_t* targets,
                             std::int64_t V, float grad_scale) {
  const std::int64_t i = blockIdx.x;
  float* x = logits + i * V;
  const std::int32_t t = targets[i];
  if (t == kIgnoreIndex) return zero_row(x, losses + i, V);
  const float max = row_max_of(x, V);
  const float sum = row_sum_exp(x, V, max);
  // A target outside the vocabulary (the CPU op refuses it; the data path never gives one) reads
  // and writes nothing outside the row: its loss is NaN, which the step's divergence check names.
  const bool in_vocab = t >= 0 && t < V;
  const float target_logit = in_vocab ? x[t] : NAN;  // read by every thread before the writes
  __syncthreads();
  loss_and_grad_row(x, losses + i, V, max, sum, target_logit, in_vocab ? t : -1, grad_scale);
}

__global__ void max_kernel(float* row_max, const float* logits, std::int64_t V) {
  const float m = row_max_of(logits + blockIdx.x * V, V);
  if (threadIdx.x == 0) row_max[blockIdx.x] = m;
}

__global__ void sum_exp_kernel(float* sum_exp, const float* logits, const float* row_max,
                               std::int64_t V) {
  const float s = row_sum_exp(logits + blockIdx.x * V, V, row_max[blockIdx.x]);
  if (threadIdx.x == 0) sum_exp[blockIdx.x] = s;
}

__global__ void target_logit_kernel(float* target_logit, const float* logits,
                                    const std::int32_t* targets, std::int64_t N, std::int64_t V,
                                    std::int64_t vocab_start) {
  const std::int64_t i = blockIdx.x * std::int64_t{blockDim.x} + threadIdx.x;
  if (i >= N) return;
  const std::int64_t local = static_cast<std::int64_t>(targets[i]) - vocab_start;
  // Zero on ranks that do not own the target, so an all-reduce SUM yields the value.
  target_logit[i] =
      (targets[i] != kIgnoreIndex && local >= 0 && local < V) ? logits[i * V + local] : 0.0f;
}

__global__ void loss_and_grad_kernel(float* logits, float* losses, const std::int32_t* targets,
                                     const float* row_max, const float* sum_exp,
                                     const float* target_logit, std::int64_t V,
                                     std::int64_t vocab_start, float grad_scale) {
  const std::int64_t i = blockIdx.x;
  float* x = logits + i * V;
  if (targets[i] == kIgnoreIndex) return zero_row(x, losses + i, V);
  const std::int64_t local = static_cast<std::int64_t>(targets[i]) - vocab_start;
  loss_and_grad_row(x, losses + i, V, row_max[i], sum_exp[i], target_logit[i],
                    (local >= 0 && local < V) ? local : -1, grad_scale);
}

}  // namespace

void cross_entropy_fused(const Stream& s, float* logits, float* losses, const std::int32_t* targets,
                         std::int64_t N, std::int64_t V, float grad_scale) {
  if (N <= 0) return;
  fused_kernel<<<static_cast<unsigned>(N), kBlock, 0, s.impl().stream>>>(logits, losses, targets, V,
                                                                         grad_scale);
  T3D_CUDA_LAUNCHED();
}

void ce_local_max(const Stream& s, float* row_max, const float* logits, std::int64_t N,
                  std::int64_t V) {
  if (N <= 0) return;
  max_kernel<<<static_cast<unsigned>(N), kBlock, 0, s.impl().stream>>>(row_max, logits, V);
  T3D_CUDA_LAUNCHED();
}

void ce_local_sum_exp(const Stream& s, float* sum_exp, const float* logits, const float* row_max,
                      std::int64_t N, std::int64_t V) {
  if (N <= 0) return;
  sum_exp_kernel<<<static_cast<unsigned>(N), kBlock, 0, s.impl().stream>>>(sum_exp, logits, row_max,
                                                                           V);
  T3D_CUDA_LAUNCHED();
}

void ce_local_target_logit(const Stream& s, float* target_logit, const float* logits,
                           const std::int32_t* targets, std::int64_t N, std::int64_t V,
                           std::int64_t vocab_start) {
  if (N <= 0) return;
  target_logit_kernel<<<static_cast<unsigned>((N + kBlock - 1) / kBlock), kBlock, 0,
                        s.impl().stream>>>(target_logit, logits, targets, N, V, vocab_start);
  T3D_CUDA_LAUNCHED();
}

void ce_loss_and_grad(const Stream& s, float* logits, float* losses, const std::int32_t* targets,
                      const float* row_max, const float* sum_exp, const float* target_logit,
                      std::int64_t N, std::int64_t V, std::int64_t vocab_start, float grad_scale) {
  if (N <= 0) return;
  loss_and_grad_kernel<<<static_cast<unsigned>(N), kBlock, 0, s.impl().stream>>>(
      logits, losses, targets, row_max, sum_exp, target_logit, V, vocab_start, grad_scale);
  T3D_CUDA_LAUNCHED();
}

}  // namespace t3d::kernels::cuda
