// SimdRows for avx2 (flags in kernels/CMakeLists.txt).
#define T3D_SIMD_ROWS_NAME kSimdRowsAvx2
#define T3D_SIMD_ROWS_ISA "avx2"
#include "kernels/simd_rows.inc"
