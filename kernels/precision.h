// fp32 <-> bf16 conversion: bf16 stored activations, bytes on the wire, and the inputs of bf16
// GEMMs (kernels/gemm.h).
#pragma once

#include <cstdint>
#include <cstring>

namespace t3d::kernels {

using bf16 = std::uint16_t;  // raw bits: the upper half of an IEEE fp32

// Round to nearest, ties to even; NaN stays NaN (quiet), infinities stay infinities.
inline bf16 float_to_bf16(float f) {
  std::uint32_t u;
  std::memcpy(&u, &f, sizeof u);
  const std::uint32_t rounded = (u + 0x7FFFu + ((u >> 16) & 1u)) >> 16;
  // Rounding a NaN could carry into the exponent and produce an infinity: force a quiet NaN.
  const bool nan = (u & 0x7FFFFFFFu) > 0x7F800000u;
  return static_cast<bf16>(nan ? ((u >> 16) | 0x40u) : rounded);
}

inline float bf16_to_float(bf16 h) {
  const std::uint32_t u = static_cast<std::uint32_t>(h) << 16;
  float f;
  std::memcpy(&f, &u, sizeof f);
  return f;
}

// Arrays: the widest SIMD version this CPU runs, bit-identical to the scalar functions above.
void float_to_bf16(bf16* out, const float* in, std::int64_t n);  // out (n), in (n)
void bf16_to_float(float* out, const bf16* in, std::int64_t n);  // out (n), in (n)
// The same with the rank's threads (kernels/threads.h): activations, GEMM inputs.
void float_to_bf16_threads(bf16* out, const float* in, std::int64_t n);
void bf16_to_float_threads(float* out, const bf16* in, std::int64_t n);

}  // namespace t3d::kernels
