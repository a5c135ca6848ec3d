#include "kernels/blas.h"

#include <cblas.h>

#include <algorithm>
#include <chrono>
#include <climits>
#include <cmath>
#include <cstdint>
#include <random>
#include <vector>

#include "kernels/check.h"

namespace t3d::kernels {
namespace {

blasint to_blasint(std::int64_t v, const char* what) {
  T3D_ASSERT(v >= 0 && v <= INT_MAX, what, " = ", v, " does not fit the BLAS integer (32-bit)");
  return static_cast<blasint>(v);
}

CBLAS_TRANSPOSE cblas_trans(Trans t) { return t == Trans::kYes ? CblasTrans : CblasNoTrans; }

// Naive C = op(A) op(B) in double, for verification.
std::vector<double> gemm_reference(Trans ta, Trans tb, int M, int N, int K,
                                   const std::vector<float>& A, const std::vector<float>& B) {
  std::vector<double> C(static_cast<std::size_t>(M) * N, 0.0);
  for (int i = 0; i < M; ++i) {
    for (int j = 0; j < N; ++j) {
      double s = 0.0;
      for (int k = 0; k < K; ++k) {
        const double a = ta == Trans::kNo ? A[i * K + k] : A[k * M + i];
        const double b = tb == Trans::kNo ? B[k * N + j] : B[j * K + k];
        s += a * b;
      }
      C[i * N + j] = s;
    }
  }
  return C;
}

}  // namespace

void sgemm(Trans trans_a, Trans trans_b, std::int64_t M, std::int64_t N, std::int64_t K,
           float alpha, const float* A, std::int64_t lda, const float* B, std::int64_t ldb,
           float beta, float* C, std::int64_t ldc) {
  // Row-major: op(A) is M x K, so A's stored row length is K (no trans) or M (trans).
  T3D_ASSERT(lda >= std::max<std::int64_t>(1, trans_a == Trans::kNo ? K : M), "lda ", lda);
  T3D_ASSERT(ldb >= std::max<std::int64_t>(1, trans_b == Trans::kNo ? N : K), "ldb ", ldb);
  T3D_ASSERT(ldc >= std::max<std::int64_t>(1, N), "ldc ", ldc);
  if (M == 0 || N == 0) return;
  cblas_sgemm(CblasRowMajor, cblas_trans(trans_a), cblas_trans(trans_b), to_blasint(M, "M"),
              to_blasint(N, "N"), to_blasint(K, "K"), alpha, A, to_blasint(lda, "lda"), B,
              to_blasint(ldb, "ldb"), beta, C, to_blasint(ldc, "ldc"));
}

void sgemm(Trans trans_a, Trans trans_b, std::int64_t M, std::int64_t N, std::int64_t K,
           float alpha, const float* A, const float* B, float beta, float* C) {
  sgemm(trans_a, trans_b, M, N, K, alpha, A, trans_a == Trans::kNo ? K : M, B,
        trans_b == Trans::kNo ? N : K, beta, C, N);
}

void set_blas_threads(int n) {
  T3D_USER_CHECK(n >= 1, "BLAS threads must be >= 1, got ", n);
  openblas_set_num_threads(n);
}

int blas_threads() { return openblas_get_num_threads(); }

CpuFeatures detect_cpu_features() {
  // __builtin_cpu_supports reads cpuid once (and checks the OS enables the AVX-512 state).
  __builtin_cpu_init();
  CpuFeatures f;
  f.avx2 = __builtin_cpu_supports("avx2");
  f.fma = __builtin_cpu_supports("fma");
  f.avx512f = __builtin_cpu_supports("avx512f");
  f.avx512bw = __builtin_cpu_supports("avx512bw");
  f.avx512vl = __builtin_cpu_supports("avx512vl");
  f.avx512dq = __builtin_cpu_supports("avx512dq");
  return f;
}

std::string recommended_openblas_coretype(const CpuFeatures& f) {
  if (f.avx512f && f.avx512bw && f.avx512vl && f.avx512dq) return "SkylakeX";
  if (f.avx2 && f.fma) return "Haswell";
  return "";
}

std::string recommended_openblas_coretype() {
  return recommended_openblas_coretype(detect_cpu_features());
}

std::string openblas_config_string() {
  std::string s = openblas_get_config();
  // get_config prints the compile-time target; the core actually dispatched is separate.
  s += " core=" + openblas_corename();
  s += " threads=" + std::to_string(blas_threads());
  return s;
}

std::string openblas_corename() { return openblas_get_corename(); }

void verify_gemm() {
  // Odd sizes exercise the kernels' edge handling; 67 x 45 x 129 spans several register blocks.
  struct Shape {
    int M, N, K;
  };
  const Shape shapes[] = {{1, 1, 1}, {7, 5, 3}, {67, 45, 129}, {33, 130, 17}};
  std::mt19937 rng(1234);
  std::uniform_real_distribution<float> dist(-1.0f, 1.0f);
  double worst = 0.0;
  std::string worst_case;
  for (const auto& s : shapes) {
    for (Trans ta : {Trans::kNo, Trans::kYes}) {
      for (Trans tb : {Trans::kNo, Trans::kYes}) {
        std::vector<float> A(static_cast<std::size_t>(s.M) * s.K);
        std::vector<float> B(static_cast<std::size_t>(s.K) * s.N);
        std::vector<float> C(static_cast<std::size_t>(s.M) * s.N, 0.0f);
        for (auto& x : A) x = dist(rng);
        for (auto& x : B) x = dist(rng);
        sgemm(ta, tb, s.M, s.N, s.K, 1.0f, A.data(), B.data(), 0.0f, C.data());
        const auto ref = gemm_reference(ta, tb, s.M, s.N, s.K, A, B);
        // Error relative to the scale of the products: fp32 accumulation of K terms of size
        // ~1 gives ~sqrt(K) * 6e-8; 1e-4 is far above that and far below any wrong kernel.
        double num = 0.0, den = 0.0;
        for (std::size_t i = 0; i < C.size(); ++i) {
          num = std::max(num, std::abs(C[i] - ref[i]));
          den = std::max(den, std::abs(ref[i]));
        }
        const double rel = num / std::max(den, 1e-30);
        if (!(rel <= worst)) {  // also catches NaN
          worst = std::isnan(rel) ? INFINITY : rel;
          worst_case = detail::concat(s.M, "x", s.N, "x", s.K, " trans_a=", ta == Trans::kYes,
                                      " trans_b=", tb == Trans::kYes);
        }
      }
    }
  }
  const std::string rec = recommended_openblas_coretype();
  T3D_USER_CHECK(worst <= 1e-4, "OpenBLAS GEMM check failed: relative error ", worst, " at ",
                 worst_case, " (", openblas_config_string(),
                 "). Refusing to train on a wrong result; set OPENBLAS_CORETYPE=",
                 rec.empty() ? "<a core type your CPU supports>" : rec,
                 " (or another core type your CPU supports) before starting titan3d");
}

double measure_sgemm_gflops(std::int64_t M, std::int64_t N, std::int64_t K, int threads,
                            int repeats) {
  T3D_USER_CHECK(M > 0 && N > 0 && K > 0 && repeats > 0, "bad sgemm benchmark shape ", M, "x", N,
                 "x", K, " repeats ", repeats);
  const int saved = blas_threads();
  set_blas_threads(threads);
  std::vector<float> A(static_cast<std::size_t>(M * K), 0.5f),
      B(static_cast<std::size_t>(K * N), 0.25f), C(static_cast<std::size_t>(M * N));
  sgemm(Trans::kNo, Trans::kNo, M, N, K, 1.0f, A.data(), B.data(), 0.0f, C.data());  // warm-up
  std::vector<double> rates;
  for (int r = 0; r < repeats; ++r) {
    const auto t0 = std::chrono::steady_clock::now();
    sgemm(Trans::kNo, Trans::kNo, M, N, K, 1.0f, A.data(), B.data(), 0.0f, C.data());
    const std::chrono::duration<double> dt = std::chrono::steady_clock::now() - t0;
    rates.push_back(2.0 * M * N * K / dt.count() * 1e-9);
  }
  set_blas_threads(saved);
  std::nth_element(rates.begin(), rates.begin() + repeats / 2, rates.end());
  return rates[static_cast<std::size_t>(repeats / 2)];
}

}  // namespace t3d::kernels
