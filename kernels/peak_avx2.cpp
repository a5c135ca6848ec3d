// Compiled with -mavx2 -mfma; called only where cpuid says the CPU has them.
#include <immintrin.h>

#include "kernels/peak_loops.h"

namespace t3d::kernels::detail {

double fma_loop_avx2(std::int64_t iterations, float* sink) {
  __m256 acc[12];
  for (int i = 0; i < 12; ++i) acc[i] = _mm256_set1_ps(0.0f + i);
  const __m256 a = _mm256_set1_ps(0.999999f), b = _mm256_set1_ps(1e-7f);
  for (std::int64_t it = 0; it < iterations; ++it)
    for (int i = 0; i < 12; ++i) acc[i] = _mm256_fmadd_ps(acc[i], a, b);
  __m256 s = acc[0];
  for (int i = 1; i < 12; ++i) s = _mm256_add_ps(s, acc[i]);
  alignas(32) float lanes[8];
  _mm256_store_ps(lanes, s);
  float total = 0;
  for (float v : lanes) total += v;
  *sink = total;
  return iterations * 12.0 * 8 * 2;  // 8 lanes, multiply + add
}

}  // namespace t3d::kernels::detail
