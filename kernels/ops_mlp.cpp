// Linear layers (all GEMMs, through kernels/blas.h with transpose flags, no copies) and SwiGLU.
#include <cmath>

#include "kernels/blas.h"
#include "kernels/ops.h"

namespace t3d::kernels {

void linear_forward(float* y, const float* x, const float* w, std::int64_t N, std::int64_t in,
                    std::int64_t out, Out mode) {
  // y (N, out) = x (N, in) . w^T (in, out): w is [out, in], read transposed in place.
  sgemm(Trans::kNo, Trans::kYes, N, out, in, 1.0f, x, w, mode == Out::kAccumulate ? 1.0f : 0.0f, y);
}

void linear_backward_input(float* dx, const float* dy, const float* w, std::int64_t N,
                           std::int64_t in, std::int64_t out) {
  // dx (N, in) = dy (N, out) . w (out, in)
  sgemm(Trans::kNo, Trans::kNo, N, in, out, 1.0f, dy, w, 0.0f, dx);
}

void linear_backward_weight(float* dw, const float* dy, const float* x, std::int64_t N,
                            std::int64_t in, std::int64_t out) {
  // dw (out, in) += dy^T (out, N) . x (N, in)
  sgemm(Trans::kYes, Trans::kNo, out, in, N, 1.0f, dy, x, 1.0f, dw);
}

void swiglu_forward(float* h, const float* gate, const float* up, std::int64_t n) {
  for (std::int64_t i = 0; i < n; ++i) {
    const float g = gate[i];
    h[i] = g / (1.0f + std::exp(-g)) * up[i];
  }
}

// h = g s(g) u with s the sigmoid: dh/du = g s(g), dh/dg = u s(g) (1 + g (1 - s(g))).
void swiglu_backward(float* dgate, float* dup, const float* dh, const float* gate, const float* up,
                     std::int64_t n) {
  for (std::int64_t i = 0; i < n; ++i) {
    const float g = gate[i];
    const float s = 1.0f / (1.0f + std::exp(-g));
    dup[i] = dh[i] * g * s;
    dgate[i] = dh[i] * up[i] * s * (1.0f + g * (1.0f - s));
  }
}

}  // namespace t3d::kernels
