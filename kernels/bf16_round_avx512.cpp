// Compiled with AVX-512 F/BW/VL and AVX512-BF16 (kernels/CMakeLists.txt); called only where
// bf16_round_supported() (kernels/bf16_round.h).
// GCC 12 warns about the deliberately undefined vectors inside its own intrinsics (GCC bug
// 105593, fixed in 13).
#pragma GCC diagnostic ignored "-Wuninitialized"
#pragma GCC diagnostic ignored "-Wmaybe-uninitialized"
#include <immintrin.h>

#include "kernels/bf16_round.h"

namespace t3d::kernels::detail {

void round_bf16_avx512(std::uint16_t* out, const float* in, std::int64_t n) {
  std::int64_t i = 0;
  for (; i + 32 <= n; i += 32) {
    const __m512bh x = _mm512_cvtne2ps_pbh(_mm512_loadu_ps(in + i + 16), _mm512_loadu_ps(in + i));
    _mm512_storeu_si512(out + i, (__m512i)x);
  }
  for (; i < n; i += 16) {
    const std::int64_t left = n - i;
    const __mmask16 m = left >= 16 ? 0xFFFF : static_cast<__mmask16>((1u << left) - 1);
    const __m256bh x = _mm512_cvtneps_pbh(_mm512_maskz_loadu_ps(m, in + i));
    _mm256_mask_storeu_epi16(out + i, m, (__m256i)x);
  }
}

}  // namespace t3d::kernels::detail
