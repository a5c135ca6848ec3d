// Branch-free float math that GCC vectorises inside `omp simd` loops. Internal to kernels/.
#pragma once

#include <bit>
#include <cstdint>

namespace t3d::kernels::detail {
// Anonymous: kernels/simd_rows_<isa>.cpp compile these with AVX2/AVX-512 flags; internal linkage
// keeps those copies out of the baseline code (no ODR merging of inline functions).
namespace {

// exp for x <= 0 (scores minus their max), branch-free so the row loops vectorise; libm's expf
// does not, and the T^2/2 exponentials would otherwise cost more than the GEMMs.
// Cephes expf polynomial: rel. error ~2e-7 on the range used here; exp(-inf) -> ~1e-38, which
// callers never rely on (masked entries are set to 0 explicitly).
inline float exp_neg(float x) {
  x = x > -87.0f ? x : -87.0f;
  // floor(x log2 e + 0.5) via truncation of a positive number (cvttps vectorises on SSE2).
  const float fn = static_cast<float>(static_cast<int>(x * 1.44269504088896341f + 128.5f)) - 128.0f;
  const float r = x - fn * 0.693359375f + fn * 2.12194440e-4f;
  float p = 1.9875691500e-4f;
  p = p * r + 1.3981999507e-3f;
  p = p * r + 8.3334519073e-3f;
  p = p * r + 4.1665795894e-2f;
  p = p * r + 1.6666665459e-1f;
  p = p * r + 5.0000001201e-1f;
  p = p * r * r + r + 1.0f;
  // 2^fn built in the exponent field; bit_cast (not memcpy) keeps the loop vectorisable.
  return p * std::bit_cast<float>((static_cast<std::int32_t>(fn) + 127) << 23);
}

// sigmoid(x) = 1 / (1 + exp(-x)), from exp_neg(-|x|) so it never overflows; both branches are
// computed and selected, so it vectorises.
inline float sigmoid(float x) {
  const float e = exp_neg(x > 0.0f ? -x : x);
  const float inv = 1.0f / (1.0f + e);
  return x > 0.0f ? inv : e * inv;
}

}  // namespace
}  // namespace t3d::kernels::detail
