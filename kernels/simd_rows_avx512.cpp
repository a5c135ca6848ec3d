// SimdRows for avx512 (flags in kernels/CMakeLists.txt).
#define T3D_SIMD_ROWS_NAME kSimdRowsAvx512
#define T3D_SIMD_ROWS_ISA "avx512"
#include "kernels/simd_rows.inc"
