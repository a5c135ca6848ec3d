#include "kernels/precision.h"

namespace t3d::kernels {

void float_to_bf16(bf16* out, const float* in, std::int64_t n) {
  for (std::int64_t i = 0; i < n; ++i) out[i] = float_to_bf16(in[i]);
}

void bf16_to_float(float* out, const bf16* in, std::int64_t n) {
  for (std::int64_t i = 0; i < n; ++i) out[i] = bf16_to_float(in[i]);
}

}  // namespace t3d::kernels
