#include <algorithm>
#include <cmath>

#include "kernels/cuda/cuda_ops.h"
#include "kernels/ops.h"
#include "kernels/simd_rows.h"
#include "kernels/threads.h"

namespace t3d::kernels {

// Rows split over threads; each row's arithmetic is in kernels/simd_rows.inc.
void rmsnorm_forward(const Exec& exec, float* out, float* rstd, const float* inp,
                     const float* weight, std::int64_t N, std::int64_t C, float eps, bf16* out16) {
  T3D_ON_GPU(exec, cuda::rmsnorm_forward(*exec.stream, out, rstd, inp, weight, N, C, eps, out16));
  const auto& simd = detail::simd_rows();
  detail::split_rows(N, C, [&](std::int64_t lo, std::int64_t hi) {
    simd.rmsnorm_fwd(out + lo * C, rstd + lo, inp + lo * C, weight, hi - lo, C, eps);
    if (out16) float_to_bf16(out16 + lo * C, out + lo * C, (hi - lo) * C);  // rows still cached
  });
}

// y_c = x_c r w_c with r = (mean(x^2) + eps)^-1/2, so dr/dx_c = -r^3 x_c / C and
//   dx_c = r w_c dy_c - (r^3 / C) x_c sum_j(dy_j w_j x_j),   dw_c += sum_rows(dy_c x_c r).
void rmsnorm_backward(const Exec& exec, float* dinp, float* dweight, const float* dout,
                      const float* inp, const float* weight, const float* rstd, std::int64_t N,
                      std::int64_t C, Out mode) {
  T3D_ON_GPU(exec, cuda::rmsnorm_backward(*exec.stream, dinp, dweight, dout, inp, weight, rstd, N,
                                          C, mode));
  const auto& simd = detail::simd_rows();
  const bool accumulate = mode == Out::kAccumulate;
  detail::split_rows(N, C, [&](std::int64_t lo, std::int64_t hi) {
    simd.rmsnorm_bwd(dinp + lo * C, dout + lo * C, inp + lo * C, weight, rstd + lo, hi - lo, C,
                     accumulate);
  });
  // dweight by columns, each column summed over the rows in order (the same order as one
  // thread: results do not depend on the thread count). Column blocks of 64 floats (a cache line
  // multiple): no two threads write one line.
  const std::int64_t blocks = (C + 63) / 64;
#pragma omp parallel for num_threads(detail::op_threads(N* C)) schedule(static)
  for (std::int64_t cb = 0; cb < blocks; ++cb)
    simd.rmsnorm_dweight(dweight, dout, inp, rstd, N, C, cb * 64);
}

}  // namespace t3d::kernels
