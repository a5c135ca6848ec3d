#include "kernels/precision.h"

#include "kernels/bf16_round.h"
#include "kernels/simd_rows.h"
#include "kernels/threads.h"

namespace t3d::kernels {

// The AVX512-BF16 instruction where the CPU has it (kernels/bf16_round.h), else the widest SIMD
// version of the integer formula (kernels/simd_rows.h); both bit-identical to the scalar one.
void float_to_bf16(bf16* out, const float* in, std::int64_t n) {
  static const bool hw = detail::bf16_round_supported();
  if (hw) return detail::round_bf16_avx512(out, in, n);
  detail::simd_rows().to_bf16(out, in, n);
}

void bf16_to_float(float* out, const bf16* in, std::int64_t n) {
  detail::simd_rows().from_bf16(out, in, n);
}

void float_to_bf16_threads(bf16* out, const float* in, std::int64_t n) {
  detail::split_range(
      n, [&](std::int64_t lo, std::int64_t hi) { float_to_bf16(out + lo, in + lo, hi - lo); });
}

void bf16_to_float_threads(float* out, const bf16* in, std::int64_t n) {
  detail::split_range(
      n, [&](std::int64_t lo, std::int64_t hi) { bf16_to_float(out + lo, in + lo, hi - lo); });
}

}  // namespace t3d::kernels
