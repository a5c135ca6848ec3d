// Compiled with AVX-512 F/BW/VL and AVX512-BF16 (kernels/CMakeLists.txt); called only where
// bf16_round_supported() (kernels/bf16_round.h).
// GCC 12 warns about the deliberately undefined vectors inside its own intrinsics (GCC bug
// 105593, fixed in 13).
#pragma GCC diagnostic ignored "-Wuninitialized"
#pragma GCC diagnostic ignored "-Wmaybe-uninitialized"
#include <immintrin.h>

#include "kernels/bf16_round.h"

namespace t3d::kernels::detail {
namespace {

// Lanes holding a denormal (exponent bits 0, mantissa not): the instruction flushes those to zero.
inline __mmask16 denormals(__m512i u) {
  return _mm512_mask_test_epi32_mask(_mm512_testn_epi32_mask(u, _mm512_set1_epi32(0x7F800000)), u,
                                     _mm512_set1_epi32(0x007FFFFF));
}

// float_to_bf16's formula in integers (ties to even; used for denormals only, so no NaN case).
inline __m256i round_int(__m512i u) {
  const __m512i odd = _mm512_and_si512(_mm512_srli_epi32(u, 16), _mm512_set1_epi32(1));
  return _mm512_cvtepi32_epi16(
      _mm512_srli_epi32(_mm512_add_epi32(_mm512_add_epi32(u, _mm512_set1_epi32(0x7FFF)), odd), 16));
}

// The lanes of `m` of 16 floats.
inline __m256i convert16(const float* in, __mmask16 m) {
  const __m512 x = _mm512_maskz_loadu_ps(m, in);
  const __m256i h = (__m256i)_mm512_cvtneps_pbh(x);
  const __mmask16 tiny = denormals(_mm512_castps_si512(x));
  return tiny == 0 ? h : _mm256_mask_blend_epi16(tiny, h, round_int(_mm512_castps_si512(x)));
}

}  // namespace

void round_bf16_avx512(std::uint16_t* out, const float* in, std::int64_t n) {
  std::int64_t i = 0;
  for (; i + 32 <= n; i += 32) {
    const __m512 lo = _mm512_loadu_ps(in + i), hi = _mm512_loadu_ps(in + i + 16);
    __m512i h = (__m512i)_mm512_cvtne2ps_pbh(hi, lo);
    const __mmask16 tl = denormals(_mm512_castps_si512(lo)),
                    th = denormals(_mm512_castps_si512(hi));
    if ((tl | th) != 0) {  // rare: redo the denormal lanes in integers
      const __m512i r =
          _mm512_inserti64x4(_mm512_castsi256_si512(round_int(_mm512_castps_si512(lo))),
                             round_int(_mm512_castps_si512(hi)), 1);
      h = _mm512_mask_blend_epi16(static_cast<__mmask32>(tl) | static_cast<__mmask32>(th) << 16, h,
                                  r);
    }
    _mm512_storeu_si512(out + i, h);
  }
  for (; i < n; i += 16) {
    const std::int64_t left = n - i;
    const __mmask16 m = left >= 16 ? 0xFFFF : static_cast<__mmask16>((1u << left) - 1);
    _mm256_mask_storeu_epi16(out + i, m, convert16(in + i, m));
  }
}

}  // namespace t3d::kernels::detail
