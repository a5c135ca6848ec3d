#include "kernels/simd_rows.h"

#include <cstdlib>
#include <string>

#include "kernels/blas.h"
#include "kernels/check.h"

namespace t3d::kernels::detail {
namespace {

const SimdRows& pick() {
  const CpuFeatures f = detect_cpu_features();
  const bool avx512 = f.avx512f && f.avx512dq && f.avx512bw && f.avx512vl && f.avx2 && f.fma;
  const bool avx2 = f.avx2 && f.fma;
  if (const char* env = std::getenv("T3D_SIMD"); env != nullptr && *env != '\0') {
    const std::string want = env;
    if (want == "sse2") return kSimdRowsSse2;
    if (want == "avx2" && avx2) return kSimdRowsAvx2;
    if (want == "avx512" && avx512) return kSimdRowsAvx512;
    T3D_USER_CHECK(want == "avx2" || want == "avx512", "T3D_SIMD=", want,
                   " is not one of sse2, avx2, avx512; unset it or pick one");
    T3D_USER_CHECK(false, "T3D_SIMD=", want, " but this CPU does not support it; unset it");
  }
  if (avx512) return kSimdRowsAvx512;
  if (avx2) return kSimdRowsAvx2;
  return kSimdRowsSse2;
}

}  // namespace

const SimdRows& simd_rows() {
  static const SimdRows& rows = pick();
  return rows;
}

}  // namespace t3d::kernels::detail
