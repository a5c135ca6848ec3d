#include <gtest/gtest.h>

#include <cstdlib>
#include <string>

#include "kernels/blas.h"
#include "kernels/check.h"
#include "kernels/gemm.h"
#include "kernels/peak.h"
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
  // Consistent with the compiler's own view of this CPU, unless ONEDNN_MAX_CPU_ISA caps it.
  const std::string here = recommended_openblas_coretype();
  if (__builtin_cpu_supports("avx512f") && __builtin_cpu_supports("avx512dq") &&
      __builtin_cpu_supports("avx512bw") && __builtin_cpu_supports("avx512vl") &&
      cpu_isa_cap().empty()) {
    EXPECT_EQ(here, "SkylakeX");
  }
}

// oneDNN's ISA names (any case) take away what the ISA lacks; ALL and unknown names nothing.
TEST(kernels_blas, OneDnnIsaCapTakesAwayWhatTheIsaLacks) {
  CpuFeatures all;
  all.avx2 = all.fma = all.avx512f = all.avx512bw = all.avx512vl = all.avx512dq = true;
  all.avx512_bf16 = all.amx_bf16 = true;
  const auto has = [](const CpuFeatures& f) {
    return std::string(f.avx2 && f.fma ? "avx2 " : "") +
           (f.avx512f && f.avx512bw && f.avx512vl && f.avx512dq ? "avx512 " : "") +
           (f.avx512_bf16 ? "bf16" : "") + (f.amx_bf16 ? " amx" : "");
  };
  EXPECT_EQ(has(cap_cpu_features(all, nullptr)), "avx2 avx512 bf16 amx");
  EXPECT_EQ(has(cap_cpu_features(all, "ALL")), "avx2 avx512 bf16 amx");
  EXPECT_EQ(has(cap_cpu_features(all, "AVX512_CORE_AMX")), "avx2 avx512 bf16 amx");
  EXPECT_EQ(has(cap_cpu_features(all, "no such isa")), "avx2 avx512 bf16 amx");
  EXPECT_EQ(has(cap_cpu_features(all, "AVX512_CORE_BF16")), "avx2 avx512 bf16");
  EXPECT_EQ(has(cap_cpu_features(all, "avx512_core_fp16")), "avx2 avx512 bf16");
  EXPECT_EQ(has(cap_cpu_features(all, "AVX512_CORE_VNNI")), "avx2 avx512 ");
  EXPECT_EQ(has(cap_cpu_features(all, "avx512_core")), "avx2 avx512 ");
  EXPECT_EQ(has(cap_cpu_features(all, "AVX2")), "avx2 ");
  EXPECT_EQ(has(cap_cpu_features(all, "avx2_vnni")), "avx2 ");
  EXPECT_EQ(has(cap_cpu_features(all, "SSE41")), "");
  CpuFeatures none;
  EXPECT_EQ(has(cap_cpu_features(none, "ALL")), "");  // a cap adds nothing
}

// ONEDNN_MAX_CPU_ISA=AVX2 makes this process a CPU without AVX-512 (AMD Zen 3) for titan3d's own
// kernels as it does for oneDNN's: no AVX-512, no bf16 dot product, OpenBLAS's Haswell kernels.
TEST(kernels_blas, OneDnnMaxCpuIsaSimulatesACpuWithoutAvx512) {
  const char* before = std::getenv("ONEDNN_MAX_CPU_ISA");
  const std::string saved = before ? before : "";
  setenv("ONEDNN_MAX_CPU_ISA", "AVX2", 1);
  const CpuFeatures f = detect_cpu_features();
  EXPECT_FALSE(f.avx512f || f.avx512bw || f.avx512vl || f.avx512dq || f.avx512_bf16);
  EXPECT_FALSE(cpu_has_bf16_dot());
  if (__builtin_cpu_supports("avx2") && __builtin_cpu_supports("fma")) {
    EXPECT_TRUE(f.avx2 && f.fma);
    EXPECT_EQ(recommended_openblas_coretype(), "Haswell");
  }
  if (__builtin_cpu_supports("avx512f")) {
    EXPECT_EQ(cpu_isa_cap(), "AVX2");
  }
  if (before)
    setenv("ONEDNN_MAX_CPU_ISA", saved.c_str(), 1);
  else
    unsetenv("ONEDNN_MAX_CPU_ISA");
}

// What titan3d's features say agrees with the ISA oneDNN itself runs (both read the cap).
TEST(kernels_blas, FeaturesAgreeWithOneDnnsIsa) {
  const std::string onednn = onednn_version_string();
  const CpuFeatures f = detect_cpu_features();
  if (onednn.find("(cpu isa avx2") != std::string::npos) {
    EXPECT_FALSE(f.avx512f) << onednn;
    EXPECT_FALSE(f.avx512_bf16) << onednn;
  }
  if (onednn.find("(cpu isa avx512_core)") != std::string::npos ||
      onednn.find("(cpu isa avx512_core_vnni)") != std::string::npos) {
    EXPECT_FALSE(f.avx512_bf16) << onednn;
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

namespace t3d::kernels {
namespace {

// On a CPU with AMX the bf16 peak MFU is measured against is the tile product's, which beats the
// AVX512-BF16 dot product by several times (a GEMM measured against the dot product read 165%
// MFU on a Sapphire Rapids-class Xeon); without AMX it stays 0.
TEST(kernels_peak, AmxTilesOutrunTheDotProductWhereTheCpuHasThem) {
  if (!cpu_runs_amx_bf16()) {
    EXPECT_EQ(measure_core_peak(1).amx_bf16_gflops, 0.0);
    GTEST_SKIP() << "no AMX bf16 tiles here (or the OS did not grant the tile state)";
  }
  const CorePeak p = measure_core_peak(3);
  EXPECT_GT(p.bf16_gflops, 0.0);
  EXPECT_GT(p.amx_bf16_gflops, 2 * p.bf16_gflops)
      << "AMX " << p.amx_bf16_gflops << " GFLOP/s, dot product " << p.bf16_gflops;
}

}  // namespace
}  // namespace t3d::kernels
