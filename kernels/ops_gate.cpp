// The shared experts' sigmoid gate on the CPU (kernels/ops_gate.h): each element through
// kernels/row_math.h, rows or columns split over the rank's threads, each computed alone, so the
// bits do not depend on the split (and equal the CUDA twins', kernels/cuda/ops_gate.cu). This file
// is compiled for baseline x86-64, which has no FMA: nothing contracts.
#include "kernels/ops_gate.h"

#include <algorithm>

#include "kernels/cuda/cuda_ops.h"
#include "kernels/row_math.h"
#include "kernels/threads.h"

namespace t3d::kernels {

void shared_gate_forward(const Exec& exec, float* out, float* g, const float* x, const float* w,
                         const float* shared, std::int64_t N, std::int64_t C) {
  T3D_ON_GPU(exec, cuda::shared_gate_forward(*exec.stream, out, g, x, w, shared, N, C));
  detail::split_rows(N, C, [&](std::int64_t lo, std::int64_t hi) {
    for (std::int64_t t = lo; t < hi; ++t) {
      const float gt = detail::gate_value(detail::gate_row_dot(x + t * C, w, C));
      g[t] = gt;
      for (std::int64_t c = 0; c < C; ++c)
        out[t * C + c] = detail::gate_apply(out[t * C + c], gt, shared[t * C + c]);
    }
  });
}

void shared_gate_backward_dot(const Exec& exec, float* dg, const float* dy, const float* shared,
                              std::int64_t N, std::int64_t C) {
  T3D_ON_GPU(exec, cuda::shared_gate_backward_dot(*exec.stream, dg, dy, shared, N, C));
  detail::split_rows(N, C, [&](std::int64_t lo, std::int64_t hi) {
    for (std::int64_t t = lo; t < hi; ++t)
      dg[t] = static_cast<float>(detail::gate_row_dot(dy + t * C, shared + t * C, C));
  });
}

void shared_gate_backward(const Exec& exec, float* dshared, float* dz, const float* dg,
                          const float* g, const float* dy, std::int64_t N, std::int64_t C) {
  T3D_ON_GPU(exec, cuda::shared_gate_backward(*exec.stream, dshared, dz, dg, g, dy, N, C));
  detail::split_rows(N, C, [&](std::int64_t lo, std::int64_t hi) {
    for (std::int64_t t = lo; t < hi; ++t) {
      for (std::int64_t c = 0; c < C; ++c) dshared[t * C + c] = g[t] * dy[t * C + c];
      dz[t] = detail::gate_dlogit(dg[t], g[t]);
    }
  });
}

void shared_gate_backward_input(const Exec& exec, float* dx, const float* dz, const float* w,
                                std::int64_t N, std::int64_t C) {
  T3D_ON_GPU(exec, cuda::shared_gate_backward_input(*exec.stream, dx, dz, w, N, C));
  detail::split_rows(N, C, [&](std::int64_t lo, std::int64_t hi) {
    for (std::int64_t t = lo; t < hi; ++t)
      for (std::int64_t c = 0; c < C; ++c)
        dx[t * C + c] = detail::gate_apply(dx[t * C + c], dz[t], w[c]);
  });
}

// By columns, each summed over the rows in order: blocks of 64 columns (a cache line multiple),
// so no two threads write one line.
void shared_gate_backward_weight(const Exec& exec, float* dw, const float* dz, const float* x,
                                 std::int64_t rows, std::int64_t C) {
  T3D_ON_GPU(exec, cuda::shared_gate_backward_weight(*exec.stream, dw, dz, x, rows, C));
  const std::int64_t blocks = (C + 63) / 64;
#pragma omp parallel for num_threads(detail::op_threads(rows* C)) schedule(static)
  for (std::int64_t cb = 0; cb < blocks; ++cb)
    for (std::int64_t c = cb * 64; c < std::min(C, cb * 64 + 64); ++c)
      dw[c] = detail::gate_dweight(dw[c], dz, x, rows, C, c);
}

}  // namespace t3d::kernels
