#include <algorithm>
#include <cmath>

#include "kernels/ops.h"
#include "kernels/threads.h"

namespace t3d::kernels {

void rmsnorm_forward(float* out, float* rstd, const float* inp, const float* weight, std::int64_t N,
                     std::int64_t C, float eps) {
#pragma omp parallel for num_threads(detail::op_threads(N* C)) schedule(static)
  for (std::int64_t i = 0; i < N; ++i) {
    const float* x = inp + i * C;
    float* y = out + i * C;
    double ss = 0.0;  // double: C can be 8k and the mean feeds every output of the row
    for (std::int64_t c = 0; c < C; ++c) ss += static_cast<double>(x[c]) * x[c];
    const float r = static_cast<float>(1.0 / std::sqrt(ss / static_cast<double>(C) + eps));
    for (std::int64_t c = 0; c < C; ++c) y[c] = x[c] * r * weight[c];
    rstd[i] = r;
  }
}

// y_c = x_c r w_c with r = (mean(x^2) + eps)^-1/2, so dr/dx_c = -r^3 x_c / C and
//   dx_c = r w_c dy_c - (r^3 / C) x_c sum_j(dy_j w_j x_j),   dw_c += sum_rows(dy_c x_c r).
void rmsnorm_backward(float* dinp, float* dweight, const float* dout, const float* inp,
                      const float* weight, const float* rstd, std::int64_t N, std::int64_t C) {
  // With threads: dx by rows, then dweight by columns, each column summed over the rows in order
  // (the same order as one thread: results do not depend on the thread count).
  const int nt = detail::op_threads(N * C);
#pragma omp parallel num_threads(nt)
  {
#pragma omp for schedule(static)
    for (std::int64_t i = 0; i < N; ++i) {
      const float* x = inp + i * C;
      const float* dy = dout + i * C;
      float* dx = dinp + i * C;
      const float r = rstd[i];
      double dot = 0.0;
      for (std::int64_t c = 0; c < C; ++c) dot += static_cast<double>(dy[c]) * weight[c] * x[c];
      const float k = static_cast<float>(dot * r * r * r / static_cast<double>(C));
      for (std::int64_t c = 0; c < C; ++c) dx[c] = r * weight[c] * dy[c] - k * x[c];
    }
    // Column blocks of 64 floats (a cache line multiple): no two threads write one line.
    const std::int64_t blocks = (C + 63) / 64;
#pragma omp for schedule(static)
    for (std::int64_t cb = 0; cb < blocks; ++cb) {
      const std::int64_t c0 = cb * 64, c1 = std::min(C, c0 + 64);
      for (std::int64_t i = 0; i < N; ++i) {
        const float* x = inp + i * C;
        const float* dy = dout + i * C;
        const float r = rstd[i];
        for (std::int64_t c = c0; c < c1; ++c) dweight[c] += dy[c] * x[c] * r;
      }
    }
  }
}

}  // namespace t3d::kernels
