#include "kernels/precision.h"

#include "kernels/simd_rows.h"

namespace t3d::kernels {

// The widest SIMD version this CPU runs (kernels/simd_rows.h), bit-identical to the scalar ones.
void float_to_bf16(bf16* out, const float* in, std::int64_t n) {
  detail::simd_rows().to_bf16(out, in, n);
}

void bf16_to_float(float* out, const bf16* in, std::int64_t n) {
  detail::simd_rows().from_bf16(out, in, n);
}

}  // namespace t3d::kernels
