// Compiled with -mavx512f -mavx512bf16; called only where cpuid says the CPU has them.
#include <immintrin.h>

#include "kernels/peak_loops.h"

namespace t3d::kernels::detail {

// 12 chains: FMA latency 4 cycles × 2 pipes needs at least 8 in flight; 12 leaves margin.
double fma_loop_avx512(std::int64_t iterations, float* sink) {
  __m512 acc[12];
  for (int i = 0; i < 12; ++i) acc[i] = _mm512_set1_ps(0.0f + i);
  const __m512 a = _mm512_set1_ps(0.999999f), b = _mm512_set1_ps(1e-7f);
  for (std::int64_t it = 0; it < iterations; ++it)
    for (int i = 0; i < 12; ++i) acc[i] = _mm512_fmadd_ps(acc[i], a, b);
  __m512 s = acc[0];
  for (int i = 1; i < 12; ++i) s = _mm512_add_ps(s, acc[i]);
  *sink = _mm512_reduce_add_ps(s);
  return iterations * 12.0 * 16 * 2;  // 16 lanes, multiply + add
}

double bf16_dot_loop_avx512(std::int64_t iterations, float* sink) {
  __m512 acc[12];
  for (int i = 0; i < 12; ++i) acc[i] = _mm512_set1_ps(0.0f + i);
  const __m512bh a = _mm512_cvtne2ps_pbh(_mm512_set1_ps(1e-3f), _mm512_set1_ps(1e-3f));
  const __m512bh b = _mm512_cvtne2ps_pbh(_mm512_set1_ps(1e-3f), _mm512_set1_ps(1e-3f));
  for (std::int64_t it = 0; it < iterations; ++it)
    for (int i = 0; i < 12; ++i) acc[i] = _mm512_dpbf16_ps(acc[i], a, b);
  __m512 s = acc[0];
  for (int i = 1; i < 12; ++i) s = _mm512_add_ps(s, acc[i]);
  *sink = _mm512_reduce_add_ps(s);
  return iterations * 12.0 * 16 * 4;  // 16 lanes, two products and two additions each
}

}  // namespace t3d::kernels::detail
