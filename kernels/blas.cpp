#include "kernels/blas.h"

#include <cblas.h>
#include <cpuid.h>

#include <algorithm>
#include <cctype>
#include <chrono>
#include <climits>
#include <cstdint>
#include <cstdlib>
#include <string>
#include <vector>

#include "kernels/check.h"

namespace t3d::kernels {
namespace {

blasint to_blasint(std::int64_t v, const char* what) {
  T3D_ASSERT(v >= 0 && v <= INT_MAX, what, " = ", v, " does not fit the BLAS integer (32-bit)");
  return static_cast<blasint>(v);
}

CBLAS_TRANSPOSE cblas_trans(Trans t) { return t == Trans::kYes ? CblasTrans : CblasNoTrans; }

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

namespace {

// The cap oneDNN reads, under its own name first.
const char* onednn_max_cpu_isa() {
  const char* cap = std::getenv("ONEDNN_MAX_CPU_ISA");
  return cap ? cap : std::getenv("DNNL_MAX_CPU_ISA");
}

CpuFeatures cpuid_features() {
  // __builtin_cpu_supports reads cpuid once (and checks the OS enables the AVX-512 state).
  __builtin_cpu_init();
  CpuFeatures f;
  f.avx2 = __builtin_cpu_supports("avx2");
  f.fma = __builtin_cpu_supports("fma");
  f.avx512f = __builtin_cpu_supports("avx512f");
  f.avx512bw = __builtin_cpu_supports("avx512bw");
  f.avx512vl = __builtin_cpu_supports("avx512vl");
  f.avx512dq = __builtin_cpu_supports("avx512dq");
  unsigned a = 0, b = 0, c = 0, d = 0;
  // CPUID leaf 7 sub-leaf 1, EAX bit 5: AVX512_BF16 (usable only with the AVX-512 state, above).
  f.avx512_bf16 = __get_cpuid_count(7, 1, &a, &b, &c, &d) && (a >> 5 & 1u) && f.avx512f;
  // Leaf 7 sub-leaf 0, EDX bits 22 (AMX-BF16) and 24 (AMX-TILE); usable where the OS enables the
  // tile state (XCR0 bits 17 and 18, read with xgetbv where OSXSAVE says it may be).
  unsigned a1 = 0, b1 = 0, c1 = 0, d1 = 0, a7 = 0, b7 = 0, c7 = 0, d7 = 0;
  const bool osxsave = __get_cpuid(1, &a1, &b1, &c1, &d1) && (c1 >> 27 & 1u);
  if (osxsave && __get_cpuid_count(7, 0, &a7, &b7, &c7, &d7) && (d7 >> 22 & 1u) &&
      (d7 >> 24 & 1u)) {
    unsigned lo = 0, hi = 0;
    __asm__("xgetbv" : "=a"(lo), "=d"(hi) : "c"(0));
    f.amx_bf16 = (lo >> 17 & 3u) == 3u;
  }
  return f;
}

bool same_features(const CpuFeatures& x, const CpuFeatures& y) {
  return x.avx2 == y.avx2 && x.fma == y.fma && x.avx512f == y.avx512f && x.avx512bw == y.avx512bw &&
         x.avx512vl == y.avx512vl && x.avx512dq == y.avx512dq && x.avx512_bf16 == y.avx512_bf16 &&
         x.amx_bf16 == y.amx_bf16;
}

}  // namespace

CpuFeatures detect_cpu_features() {
  return cap_cpu_features(cpuid_features(), onednn_max_cpu_isa());
}

std::string cpu_isa_cap() {
  const CpuFeatures all = cpuid_features();
  const char* cap = onednn_max_cpu_isa();
  return same_features(all, cap_cpu_features(all, cap)) ? "" : cap;
}

CpuFeatures cap_cpu_features(CpuFeatures f, const char* max_isa) {
  std::string isa = max_isa ? max_isa : "";
  std::transform(isa.begin(), isa.end(), isa.begin(),
                 [](unsigned char ch) { return static_cast<char>(std::toupper(ch)); });
  const bool below_avx2 = isa == "SSE41" || isa == "AVX";
  const bool below_avx512 = below_avx2 || isa == "AVX2" || isa == "AVX2_VNNI";
  const bool below_bf16 = below_avx512 || isa == "AVX512_CORE" || isa == "AVX512_CORE_VNNI";
  if (below_avx2) f.avx2 = f.fma = false;
  if (below_avx512) f.avx512f = f.avx512bw = f.avx512vl = f.avx512dq = false;
  const bool below_amx = below_bf16 || isa == "AVX512_CORE_BF16" || isa == "AVX512_CORE_FP16";
  if (below_bf16) f.avx512_bf16 = false;
  if (below_amx) f.amx_bf16 = false;
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
