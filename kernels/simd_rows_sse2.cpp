// SimdRows for sse2 (flags in kernels/CMakeLists.txt).
#define T3D_SIMD_ROWS_NAME kSimdRowsSse2
#define T3D_SIMD_ROWS_ISA "sse2"
#include "kernels/simd_rows.inc"
