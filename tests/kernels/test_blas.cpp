#include <gtest/gtest.h>

#include <string>

#include "kernels/blas.h"
#include "kernels/check.h"
#include "kernels/gemm.h"
#include "reference.h"

namespace t3d::kernels {
namespace {

// C = alpha op(A) op(B) + beta C on strided sub-matrices (ld > row length), every transpose
// combination, odd sizes. Tolerance: fp32 GEMM with K <= 37 terms of size <= 1, 1e-5 absolute.
TEST(kernels_blas, SgemmMatchesNaiveForAllTransposesAndStrides) {
  const int M = 13, N = 7, K = 37, pad = 3;
  for (Trans ta : {Trans::kNo, Trans::kYes}) {
    for (Trans tb : {Trans::kNo, Trans::kYes}) {
      const int a_rows = ta == Trans::kNo ? M : K, a_cols = ta == Trans::kNo ? K : M;
      const int b_rows = tb == Trans::kNo ? K : N, b_cols = tb == Trans::kNo ? N : K;
      const int lda = a_cols + pad, ldb = b_cols + pad, ldc = N + pad;
      auto A = ref::random_floats((std::size_t)a_rows * lda, 1);
      auto B = ref::random_floats((std::size_t)b_rows * ldb, 2);
      auto C = ref::random_floats((std::size_t)M * ldc, 3);
      const float alpha = 0.75f, beta = -0.5f;
      ref::Vec expected(C.begin(), C.end());
      for (int i = 0; i < M; ++i)
        for (int j = 0; j < N; ++j) {
          double s = 0;
          for (int k = 0; k < K; ++k) {
            const double a = ta == Trans::kNo ? A[i * lda + k] : A[k * lda + i];
            const double b = tb == Trans::kNo ? B[k * ldb + j] : B[j * ldb + k];
            s += a * b;
          }
          expected[i * ldc + j] = alpha * s + beta * C[i * ldc + j];
        }
      sgemm(ta, tb, M, N, K, alpha, A.data(), lda, B.data(), ldb, beta, C.data(), ldc);
      // Padding columns of C must be untouched: expected keeps the original values there.
      ref::expect_close(C, expected, 0, 1e-5, "C");
    }
  }
}

TEST(kernels_blas, PackedOverloadUsesShapeLeadingDimensions) {
  const int M = 5, N = 9, K = 11;
  auto A = ref::random_floats(K * M, 4);  // stored (K, M): used transposed
  auto B = ref::random_floats(N * K, 5);  // stored (N, K): used transposed
  std::vector<float> C(M * N, 0.0f);
  sgemm(Trans::kYes, Trans::kYes, M, N, K, 1.0f, A.data(), B.data(), 0.0f, C.data());
  ref::Vec expected(M * N);
  for (int i = 0; i < M; ++i)
    for (int j = 0; j < N; ++j) {
      double s = 0;
      for (int k = 0; k < K; ++k) s += (double)A[k * M + i] * B[j * K + k];
      expected[i * N + j] = s;
    }
  ref::expect_close(C, expected, 0, 1e-5, "C");
}

TEST(kernels_blas, VerifyGemmPassesOnThisMachine) {
  EXPECT_NO_THROW(verify_gemm_kind(GemmKind::kOpenBlasF32));
}

TEST(kernels_blas, CoretypeRecommendation) {
  CpuFeatures f;
  EXPECT_EQ(recommended_openblas_coretype(f), "");
  f.avx2 = f.fma = true;
  EXPECT_EQ(recommended_openblas_coretype(f), "Haswell");
  f.avx512f = f.avx512bw = f.avx512vl = true;
  EXPECT_EQ(recommended_openblas_coretype(f), "Haswell");  // DQ missing
  f.avx512dq = true;
  EXPECT_EQ(recommended_openblas_coretype(f), "SkylakeX");
  // Consistent with the compiler's own view of this CPU.
  const std::string here = recommended_openblas_coretype();
  if (__builtin_cpu_supports("avx512f") && __builtin_cpu_supports("avx512dq") &&
      __builtin_cpu_supports("avx512bw") && __builtin_cpu_supports("avx512vl")) {
    EXPECT_EQ(here, "SkylakeX");
  }
}

TEST(kernels_blas, ConfigStringNamesCoreAndThreads) {
  set_blas_threads(1);
  EXPECT_EQ(blas_threads(), 1);
  const std::string cfg = openblas_config_string();
  EXPECT_NE(cfg.find("OpenBLAS"), std::string::npos) << cfg;
  EXPECT_NE(cfg.find("core=" + openblas_corename()), std::string::npos) << cfg;
  EXPECT_NE(cfg.find("threads=1"), std::string::npos) << cfg;
  EXPECT_FALSE(openblas_corename().empty());
  EXPECT_THROW(set_blas_threads(0), UserError);
}

}  // namespace
}  // namespace t3d::kernels
