#include <algorithm>
#include <cmath>
#include <vector>

#include "kernels/check.h"
#include "kernels/cuda/cuda_ops.h"
#include "kernels/ops.h"
#include "kernels/row_math.h"
#include "kernels/threads.h"

namespace t3d::kernels {
namespace {

// Rotates every head of every row by the row's angles; sign = +1 forward, -1 inverse.
void rope_apply(float* out, const float* inp, const float* table, std::int64_t B, std::int64_t T,
                std::int64_t n_heads, std::int64_t D, std::int64_t pos_offset, float sign) {
  T3D_ASSERT(D % 2 == 0, "RoPE needs an even head_dim, got ", D);
  T3D_ASSERT(pos_offset >= 0, "negative RoPE position offset ", pos_offset);
  const std::int64_t half = D / 2;
  const std::int64_t row = n_heads * D;
#pragma omp parallel for num_threads(detail::op_threads(B* T* row)) schedule(static)
  for (std::int64_t bt = 0; bt < B * T; ++bt) {  // rows are independent
    const std::int64_t t = bt % T;
    const float* cos = table + (pos_offset + t) * D;
    const float* sin = cos + half;
    for (std::int64_t h = 0; h < n_heads; ++h) {
      const float* x = inp + bt * row + h * D;
      float* y = out + bt * row + h * D;
      for (std::int64_t i = 0; i < half; ++i) {
        const float x1 = x[i], x2 = x[i + half];  // read both before writing (in place)
        detail::rope_rotate(x1, x2, cos[i], sign * sin[i], y[i], y[i + half]);
      }
    }
  }
}

}  // namespace

void rope_frequencies(double* freq, std::int64_t D, double theta, const RopeScaling& scaling) {
  T3D_USER_CHECK(D % 2 == 0 && D > 0, "RoPE needs an even head_dim, got ", D);
  T3D_USER_CHECK(theta > 0, "rope_theta must be positive, got ", theta);
  using Kind = RopeScaling::Kind;
  T3D_USER_CHECK(scaling.kind == Kind::kNone || scaling.factor > 0,
                 "the RoPE scaling factor must be positive, got ", scaling.factor);
  const bool llama3 = scaling.kind == Kind::kLlama3;
  T3D_USER_CHECK(!llama3 || (scaling.high_freq_factor > scaling.low_freq_factor &&
                             scaling.low_freq_factor > 0 && scaling.original_context > 0),
                 "llama3 RoPE scaling needs 0 < low_freq_factor < high_freq_factor and a positive "
                 "original context, got ",
                 scaling.low_freq_factor, ", ", scaling.high_freq_factor, ", ",
                 scaling.original_context);
  constexpr double kPi = 3.14159265358979323846;
  for (std::int64_t i = 0; i < D / 2; ++i) {
    const double f = std::pow(theta, -2.0 * static_cast<double>(i) / static_cast<double>(D));
    freq[i] = f;
    if (scaling.kind == Kind::kLinear) freq[i] = f / scaling.factor;
    if (!llama3) continue;
    const double wavelength = 2.0 * kPi / f, L = scaling.original_context;
    if (wavelength > L / scaling.low_freq_factor) {
      freq[i] = f / scaling.factor;
    } else if (wavelength >= L / scaling.high_freq_factor) {
      const double s = (L / wavelength - scaling.low_freq_factor) /
                       (scaling.high_freq_factor - scaling.low_freq_factor);
      freq[i] = (1.0 - s) * f / scaling.factor + s * f;
    }
  }
}

void rope_table(float* table, std::int64_t max_pos, std::int64_t D, double theta,
                const RopeScaling& scaling) {
  const std::int64_t half = D / 2;
  std::vector<double> freq(static_cast<std::size_t>(std::max<std::int64_t>(half, 1)));
  rope_frequencies(freq.data(), D, theta, scaling);
  // Angles in double: at position 100k an fp32 angle is off by ~0.004 rad.
  for (std::int64_t p = 0; p < max_pos; ++p) {
    for (std::int64_t i = 0; i < half; ++i) {
      const double a = static_cast<double>(p) * freq[static_cast<std::size_t>(i)];
      table[p * D + i] = static_cast<float>(std::cos(a));
      table[p * D + half + i] = static_cast<float>(std::sin(a));
    }
  }
}

void rope_forward(const Exec& exec, float* out, const float* inp, const float* table,
                  std::int64_t B, std::int64_t T, std::int64_t n_heads, std::int64_t D,
                  std::int64_t pos_offset) {
  T3D_ON_GPU(exec, cuda::rope_forward(*exec.stream, out, inp, table, B, T, n_heads, D, pos_offset));
  rope_apply(out, inp, table, B, T, n_heads, D, pos_offset, 1.0f);
}

void rope_backward(const Exec& exec, float* dinp, const float* dout, const float* table,
                   std::int64_t B, std::int64_t T, std::int64_t n_heads, std::int64_t D,
                   std::int64_t pos_offset) {
  T3D_ON_GPU(exec,
             cuda::rope_backward(*exec.stream, dinp, dout, table, B, T, n_heads, D, pos_offset));
  rope_apply(dinp, dout, table, B, T, n_heads, D, pos_offset, -1.0f);
}

}  // namespace t3d::kernels
