// The shared experts' sigmoid gate on the GPU (kernels/ops_gate.h): the CPU's element arithmetic
// (kernels/row_math.h) in the CPU's order, so the same bits (compiled with -fmad=false). A row's
// dot is one thread's loop (gate_row_dot's 16 lanes in registers), the weight gradient one
// thread per column over the rows in order: no atomics, an order fixed by the shapes.
#include "kernels/cuda/cuda_internal.cuh"
#include "kernels/row_math.h"

namespace t3d::kernels::cuda {
namespace {

__global__ void gate_forward_kernel(float* g, const float* x, const float* w, std::int64_t N,
                                    std::int64_t C) {
  for (std::int64_t t = blockIdx.x * std::int64_t{blockDim.x} + threadIdx.x; t < N;
       t += std::int64_t{gridDim.x} * blockDim.x)
    g[t] = detail::gate_value(detail::gate_row_dot(x + t * C, w, C));
}

// One thread per element, after gate_forward_kernel wrote g.
__global__ void gate_apply_kernel(float* out, const float* g, const float* shared, std::int64_t N,
                                  std::int64_t C) {
  for (std::int64_t e = blockIdx.x * std::int64_t{blockDim.x} + threadIdx.x; e < N * C;
       e += std::int64_t{gridDim.x} * blockDim.x)
    out[e] = detail::gate_apply(out[e], g[e / C], shared[e]);
}

__global__ void gate_dot_kernel(float* dg, const float* dy, const float* shared, std::int64_t N,
                                std::int64_t C) {
  for (std::int64_t t = blockIdx.x * std::int64_t{blockDim.x} + threadIdx.x; t < N;
       t += std::int64_t{gridDim.x} * blockDim.x)
    dg[t] = static_cast<float>(detail::gate_row_dot(dy + t * C, shared + t * C, C));
}

__global__ void gate_scale_kernel(float* dshared, const float* g, const float* dy, std::int64_t N,
                                  std::int64_t C) {
  for (std::int64_t e = blockIdx.x * std::int64_t{blockDim.x} + threadIdx.x; e < N * C;
       e += std::int64_t{gridDim.x} * blockDim.x)
    dshared[e] = g[e / C] * dy[e];
}

__global__ void gate_input_kernel(float* dx, const float* dz, const float* w, std::int64_t N,
                                  std::int64_t C) {
  for (std::int64_t e = blockIdx.x * std::int64_t{blockDim.x} + threadIdx.x; e < N * C;
       e += std::int64_t{gridDim.x} * blockDim.x)
    dx[e] = detail::gate_apply(dx[e], dz[e / C], w[e % C]);
}

// One thread per row; dz may be dg itself (each thread reads its own element first).
__global__ void gate_dlogit_kernel(float* dz, const float* dg, const float* g, std::int64_t N) {
  for (std::int64_t t = blockIdx.x * std::int64_t{blockDim.x} + threadIdx.x; t < N;
       t += std::int64_t{gridDim.x} * blockDim.x)
    dz[t] = detail::gate_dlogit(dg[t], g[t]);
}

__global__ void gate_dweight_kernel(float* dw, const float* dz, const float* x, std::int64_t rows,
                                    std::int64_t C) {
  const std::int64_t c = blockIdx.x * std::int64_t{blockDim.x} + threadIdx.x;
  if (c < C) dw[c] = detail::gate_dweight(dw[c], dz, x, rows, C, c);
}

}  // namespace

void shared_gate_forward(const Stream& s, float* out, float* g, const float* x, const float* w,
                         const float* shared, std::int64_t N, std::int64_t C) {
  if (N <= 0) return;
  gate_forward_kernel<<<grid_for(N), kBlock, 0, s.impl().stream>>>(g, x, w, N, C);
  T3D_CUDA_LAUNCHED();
  gate_apply_kernel<<<grid_for(N * C), kBlock, 0, s.impl().stream>>>(out, g, shared, N, C);
  T3D_CUDA_LAUNCHED();
}

void shared_gate_backward_dot(const Stream& s, float* dg, const float* dy, const float* shared,
                              std::int64_t N, std::int64_t C) {
  if (N <= 0) return;
  gate_dot_kernel<<<grid_for(N), kBlock, 0, s.impl().stream>>>(dg, dy, shared, N, C);
  T3D_CUDA_LAUNCHED();
}

void shared_gate_backward(const Stream& s, float* dshared, float* dz, const float* dg,
                          const float* g, const float* dy, std::int64_t N, std::int64_t C) {
  if (N <= 0) return;
  gate_scale_kernel<<<grid_for(N * C), kBlock, 0, s.impl().stream>>>(dshared, g, dy, N, C);
  T3D_CUDA_LAUNCHED();
  gate_dlogit_kernel<<<grid_for(N), kBlock, 0, s.impl().stream>>>(dz, dg, g, N);
  T3D_CUDA_LAUNCHED();
}

void shared_gate_backward_input(const Stream& s, float* dx, const float* dz, const float* w,
                                std::int64_t N, std::int64_t C) {
  if (N <= 0) return;
  gate_input_kernel<<<grid_for(N * C), kBlock, 0, s.impl().stream>>>(dx, dz, w, N, C);
  T3D_CUDA_LAUNCHED();
}

void shared_gate_backward_weight(const Stream& s, float* dw, const float* dz, const float* x,
                                 std::int64_t rows, std::int64_t C) {
  if (C <= 0) return;
  gate_dweight_kernel<<<(C + kBlock - 1) / kBlock, kBlock, 0, s.impl().stream>>>(dw, dz, x, rows,
                                                                                 C);
  T3D_CUDA_LAUNCHED();
}

}  // namespace t3d::kernels::cuda
