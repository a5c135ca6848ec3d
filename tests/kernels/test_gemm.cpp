// The GEMM kinds of kernels/gemm.h against a double-precision reference.
//
// Tolerances, stated per element with S = sum_k |a_k b_k| (the scale of the sum's rounding):
//   - fp32 kinds: |C - ref| <= 1e-5 S. K <= 129 terms of fp32 accumulation: ~sqrt(K) 6e-8 S.
//   - bf16 against the reference of its own rounded inputs: the same fp32 bound. This shows the
//     path is exactly "bf16 inputs, fp32 accumulation", nothing coarser.
//   - bf16 against the fp32 (unrounded) reference: each input is rounded to 8 significant bits,
//     relative error <= 2^-8 (half a unit in the last place), so each product is off by
//     <= (1 + 2^-8)^2 - 1 < 2^-7 + 2^-16 of itself and the sum by less than that times S, plus
//     the fp32 term. The test also requires the error to be well above
//     the fp32 level somewhere, or the "bf16" path would not be rounding at all.
#include <gtest/gtest.h>

#include <algorithm>
#include <bit>
#include <cmath>
#include <cstdint>
#include <cstdio>
#include <random>
#include <string>
#include <vector>

#include "kernels/bf16_round.h"
#include "kernels/check.h"
#include "kernels/gemm.h"
#include "kernels/ops.h"
#include "kernels/precision.h"
#include "kernels/simd_rows.h"
#include "reference.h"

namespace t3d::kernels {
namespace {

using ref::Vec;

struct Product {
  Vec value, scale;  // sum_k a_k b_k and sum_k |a_k b_k|
};

// op(A) (M, K) · op(B) (K, N) of strided row-major storage, in double.
Product reference(Trans ta, Trans tb, int M, int N, int K, const std::vector<float>& A, int lda,
                  const std::vector<float>& B, int ldb, bool round_inputs) {
  const auto in = [&](float x) {
    return round_inputs ? double(bf16_to_float(float_to_bf16(x))) : double(x);
  };
  Product p{Vec(static_cast<std::size_t>(M) * N, 0.0), Vec(static_cast<std::size_t>(M) * N, 0.0)};
  for (int i = 0; i < M; ++i)
    for (int j = 0; j < N; ++j)
      for (int k = 0; k < K; ++k) {
        const double a = in(ta == Trans::kNo ? A[i * lda + k] : A[k * lda + i]);
        const double b = in(tb == Trans::kNo ? B[k * ldb + j] : B[j * ldb + k]);
        p.value[i * N + j] += a * b;
        p.scale[i * N + j] += std::abs(a * b);
      }
  return p;
}

// Every kind runs on an x86-64 CPU with AVX-512; oneDNN's bf16 needs it. Where a kind cannot run,
// its tests skip with oneDNN's reason (and training leaves the kind out,
// runtime/machine/gemm_choice.h).
class GemmKinds : public ::testing::TestWithParam<GemmKind> {
 protected:
  void SetUp() override {
    try {
      verify_gemm_kind(GetParam());
    } catch (const UserError& e) {
      if (std::string(e.what()).find("oneDNN cannot run") == std::string::npos) throw;
      GTEST_SKIP() << e.what();
    }
  }
};

TEST_P(GemmKinds, EveryTransposeStrideAndAccumulationAgainstReference) {
  const GemmKind kind = GetParam();
  const bool bf16 = gemm_kind_is_bf16(kind);
  struct Shape {
    int M, N, K;
  };
  double worst_rounding = 0;  // bf16: largest error against the unrounded reference, in units of S
  std::uint32_t seed = 1;
  for (const Shape s : {Shape{1, 1, 1}, Shape{7, 5, 3}, Shape{67, 45, 129}, Shape{33, 130, 17}})
    for (Trans ta : {Trans::kNo, Trans::kYes})
      for (Trans tb : {Trans::kNo, Trans::kYes})
        for (bool accumulate : {false, true}) {
          // Leading dimensions 3 wider than the stored rows: strided views, as attention heads are.
          const int lda = (ta == Trans::kNo ? s.K : s.M) + 3,
                    ldb = (tb == Trans::kNo ? s.N : s.K) + 3;
          const int ldc = s.N + 2;
          const auto A = ref::random_floats(
              static_cast<std::size_t>(ta == Trans::kNo ? s.M : s.K) * lda, seed++);
          const auto B = ref::random_floats(
              static_cast<std::size_t>(tb == Trans::kNo ? s.K : s.N) * ldb, seed++);
          auto C = ref::random_floats(static_cast<std::size_t>(s.M) * ldc, seed++);
          const auto C0 = C;
          gemm(kind, ta, tb, s.M, s.N, s.K, A.data(), lda, B.data(), ldb, accumulate, C.data(),
               ldc);
          const Product own = reference(ta, tb, s.M, s.N, s.K, A, lda, B, ldb, bf16);
          const Product exact = reference(ta, tb, s.M, s.N, s.K, A, lda, B, ldb, false);
          for (int i = 0; i < s.M; ++i) {
            for (int j = s.N; j < ldc; ++j) {  // padding columns untouched
              ASSERT_EQ(C[i * ldc + j], C0[i * ldc + j]);
            }
            for (int j = 0; j < s.N; ++j) {
              const double base = accumulate ? C0[i * ldc + j] : 0.0;
              const double got = C[i * ldc + j], S = own.scale[i * s.N + j] + 1e-30;
              ASSERT_LE(std::abs(got - base - own.value[i * s.N + j]),
                        1e-5 * S + 1e-6 * std::abs(base))
                  << gemm_kind_name(kind) << " " << s.M << "x" << s.N << "x" << s.K << " ta "
                  << int(ta) << " tb " << int(tb) << " acc " << accumulate << " at " << i << ","
                  << j;
              if (bf16) {  // the fp32 term of base + product, as above
                const double err = std::abs(got - base - exact.value[i * s.N + j]);
                ASSERT_LE(err, (std::ldexp(1.0, -7) + 3e-5) * S + 1e-6 * std::abs(base));
                if (!accumulate) worst_rounding = std::max(worst_rounding, err / S);
              }
            }
          }
        }
  if (bf16) {
    EXPECT_GT(worst_rounding, 1e-4) << "bf16 results as exact as fp32: inputs not rounded";
  }
}

// With two threads the inputs are rounded in one parallel region split by rows across both
// matrices: large enough inputs (over op_threads' 64k floats) in every layout, packed and strided,
// against the reference of the rounded inputs with the fp32 bound above.
TEST_P(GemmKinds, TwoThreadsLargeInputsAgainstReference) {
  const GemmKind kind = GetParam();
  const int M = 300, N = 130, K = 257;
  std::uint32_t seed = 50;
  struct TwoThreads {
    int saved = blas_threads();
    TwoThreads() { set_rank_threads(2); }
    ~TwoThreads() { set_rank_threads(saved); }
  } two;
  for (Trans ta : {Trans::kNo, Trans::kYes})
    for (Trans tb : {Trans::kNo, Trans::kYes})
      for (int pad : {0, 5}) {
        const int lda = (ta == Trans::kNo ? K : M) + pad, ldb = (tb == Trans::kNo ? N : K) + pad;
        const auto A =
            ref::random_floats(static_cast<std::size_t>(ta == Trans::kNo ? M : K) * lda, seed++);
        const auto B =
            ref::random_floats(static_cast<std::size_t>(tb == Trans::kNo ? K : N) * ldb, seed++);
        std::vector<float> C(static_cast<std::size_t>(M) * N);
        gemm(kind, ta, tb, M, N, K, A.data(), lda, B.data(), ldb, false, C.data(), N);
        const Product own = reference(ta, tb, M, N, K, A, lda, B, ldb, gemm_kind_is_bf16(kind));
        for (int i = 0; i < M * N; ++i)
          ASSERT_LE(std::abs(C[i] - own.value[i]), 1e-5 * own.scale[i] + 1e-30)
              << gemm_kind_name(kind) << " ta " << int(ta) << " tb " << int(tb) << " pad " << pad
              << " at " << i;
      }
}

// OpenBLAS on two OpenMP threads (a block of C's rows per thread): the same bits every run, and
// the one-thread result within fp32 rounding (1e-6 of sum |a·b| per element; the blocks' edge
// rows may be tiled otherwise). Shapes: split with a ragged last block, split with few columns,
// and too small to split.
TEST(kernels_gemm_openblas, SplitOverThreadsIsRepeatableAndTheOneThreadResult) {
  struct Shape {
    int M, N, K;
  };
  std::uint32_t seed = 70;
  const int saved = blas_threads();
  for (const Shape& sh : {Shape{300, 130, 257}, Shape{1000, 20, 450}, Shape{517, 40, 100}})
    for (Trans ta : {Trans::kNo, Trans::kYes})
      for (Trans tb : {Trans::kNo, Trans::kYes})
        for (bool accumulate : {false, true}) {
          const int M = sh.M, N = sh.N, K = sh.K;
          const int lda = (ta == Trans::kNo ? K : M) + 3, ldb = (tb == Trans::kNo ? N : K) + 1;
          const auto A =
              ref::random_floats(static_cast<std::size_t>(ta == Trans::kNo ? M : K) * lda, seed++);
          const auto B =
              ref::random_floats(static_cast<std::size_t>(tb == Trans::kNo ? K : N) * ldb, seed++);
          const auto C0 = ref::random_floats(static_cast<std::size_t>(M) * (N + 2), seed++);
          const auto run = [&](int threads) {
            std::vector<float> C(C0);
            set_rank_threads(threads);
            gemm(GemmKind::kOpenBlasF32, ta, tb, M, N, K, A.data(), lda, B.data(), ldb, accumulate,
                 C.data(), N + 2);
            EXPECT_EQ(blas_threads(), threads) << "OpenBLAS's thread count is restored";
            return C;
          };
          const auto one = run(1), two = run(2);
          EXPECT_EQ(run(2), two) << "repeats at two threads";
          const Product p = reference(ta, tb, M, N, K, A, lda, B, ldb, false);
          for (int i = 0; i < M; ++i)
            for (int j = 0; j < N; ++j) {
              const std::size_t at = static_cast<std::size_t>(i) * (N + 2) + j;
              ASSERT_LE(std::abs(two[at] - one[at]), 1e-6 * p.scale[i * N + j] + 1e-30)
                  << M << "x" << N << "x" << K << " ta " << int(ta) << " tb " << int(tb)
                  << " accumulate " << accumulate << " at " << i << "," << j;
            }
        }
  set_rank_threads(saved);
}

TEST_P(GemmKinds, RepeatsAreBitIdentical) {
  const GemmKind kind = GetParam();
  const int M = 96, N = 80, K = 200;
  const auto A = ref::random_floats(M * K, 3), B = ref::random_floats(N * K, 4);
  std::vector<float> first(M * N), second(M * N);
  gemm(kind, Trans::kNo, Trans::kYes, M, N, K, A.data(), K, B.data(), K, false, first.data(), N);
  gemm(kind, Trans::kNo, Trans::kYes, M, N, K, A.data(), K, B.data(), K, false, second.data(), N);
  EXPECT_EQ(first, second);
}

TEST_P(GemmKinds, VerifyAcceptsTheKind) { EXPECT_NO_THROW(verify_gemm_kind(GetParam())); }

TEST_P(GemmKinds, MeasuresAPositiveRate) {
  EXPECT_GT(measure_gemm_gflops(GetParam(), 64, 48, 40, 1, 3), 0.0);
}

// The linear layers run on the kind they are given: the same checks as test_layers.cpp's,
// with the kind's tolerance (relative to the largest |value|, as a bf16 GEMM's error scales).
TEST_P(GemmKinds, LinearLayerUsesTheChosenKind) {
  const GemmKind kind = GetParam();
  const int N = 9, in = 33, out = 17;
  const auto x = ref::random_floats(N * in, 40), w = ref::random_floats(out * in, 41);
  const auto dy = ref::random_floats(N * out, 42);
  std::vector<float> y(N * out, 5.0f), dx(N * in, 99.0f), dw(out * in, 0.25f);
  linear_forward(kind, y.data(), x.data(), w.data(), N, in, out);
  linear_backward_input(kind, dx.data(), dy.data(), w.data(), N, in, out);
  linear_backward_weight(kind, dw.data(), dy.data(), x.data(), N, in, out);
  const double tol = gemm_kind_is_bf16(kind) ? std::ldexp(1.0, -7) + 1e-5 : 1e-5;
  const Vec yref = ref::linear(ref::to_double(x), ref::to_double(w), N, in, out);
  Vec dxref(N * in, 0.0), dwref(out * in, 0.25);
  for (int n = 0; n < N; ++n)
    for (int o = 0; o < out; ++o)
      for (int i = 0; i < in; ++i) {
        dxref[n * in + i] += double(dy[n * out + o]) * w[o * in + i];
        dwref[o * in + i] += double(dy[n * out + o]) * x[n * in + i];
      }
  // Each output sums `in` (or N, out) products of inputs in [-1, 1]: S <= the term count.
  ref::expect_close(y, yref, 0, tol * in, "y");
  ref::expect_close(dx, dxref, 0, tol * out, "dx");
  ref::expect_close(dw, dwref, 0, tol * N, "dw");
}

// A LinearInput (rounded once, read by several GEMMs) gives the same bits as each GEMM rounding
// its own inputs, for every kind, with the pool's buffers reused and nested; with a bf16 kind it
// holds exactly the bf16 of every float, and the fp32 kinds round nothing.
TEST_P(GemmKinds, LinearInputIsTheSameBitsAsRoundingPerGemm) {
  const GemmKind kind = GetParam();
  set_rank_threads(2);  // the rounding's parallel split must not matter either
  const int N = 70, in = 48, out = 36;
  const auto x = ref::random_floats(N * in, 50), w = ref::random_floats(out * in, 51);
  const auto w2 = ref::random_floats(out * in, 52), dy = ref::random_floats(N * out, 53);
  std::vector<float> y(N * out), y2(N * out), dx(N * in), dw(out * in, 0.5f);
  std::vector<float> e_y(N * out), e_y2(N * out), e_dx(N * in), e_dw(out * in, 0.5f);
  linear_forward(kind, e_y.data(), x.data(), w.data(), N, in, out);
  linear_forward(kind, e_y2.data(), x.data(), w2.data(), N, in, out);
  linear_backward_input(kind, e_dx.data(), dy.data(), w.data(), N, in, out);
  linear_backward_weight(kind, e_dw.data(), dy.data(), x.data(), N, in, out);
  for (int round = 0; round < 2; ++round) {  // the second round reuses the pool's buffers
    const LinearInput xi(kind, x.data(), N, in);
    {
      const LinearInput dyi(kind, dy.data(), N, out);
      linear_forward(y.data(), xi, w.data(), out);
      linear_forward(y2.data(), xi, w2.data(), out);
      linear_backward_input(dx.data(), dyi, w.data(), in);
      std::fill(dw.begin(), dw.end(), 0.5f);
      linear_backward_weight(dw.data(), dyi, xi);
      ASSERT_EQ(dyi.rounded() != nullptr, gemm_kind_is_bf16(kind));
      if (dyi.rounded()) {
        for (int i = 0; i < N * out; ++i) ASSERT_EQ(dyi.rounded()[i], float_to_bf16(dy[i])) << i;
      }
    }
    EXPECT_EQ(y, e_y) << round;
    EXPECT_EQ(y2, e_y2) << round;
    EXPECT_EQ(dx, e_dx) << round;
    EXPECT_EQ(dw, e_dw) << round;
  }
  set_rank_threads(1);
}

// gemm_row_bucket's promise: where a kind pads (bucket > 1), the rows of an M-row product are bit
// for bit those of the same rows in a GEMM of M rounded up to the bucket, whatever the extra rows
// hold, and of the rows split at a multiple of the bucket (the experts' two ways,
// kernels/ops_moe.cpp), at the experts' two products and 1 and 2 threads. A kind whose rows
// depend on the others (oneDNN's AVX2 kernels, AMD Zen 3) must not pad.
TEST_P(GemmKinds, RowBucketKeepsTheRows) {
  const GemmKind kind = GetParam();
  const std::int64_t bucket = gemm_row_bucket(kind);
  ASSERT_GE(bucket, 1);
  const int probe = bucket > 1 ? static_cast<int>(bucket) : 32;  // what a pad would be
  const int out = 56, in = 72, most = 224;                       // w (out, in)
  const auto w = ref::random_floats(out * in, 60);
  const auto a = ref::random_floats(most * in, 61);  // rows past M: whatever they hold
  std::string first_difference;
  for (const int threads : {1, 2}) {
    set_rank_threads(threads);
    for (const Trans tb : {Trans::kYes, Trans::kNo}) {  // forward x·Wᵀ, input gradient dy·W
      const int N = tb == Trans::kYes ? out : in, K = tb == Trans::kYes ? in : out;
      const auto product = [&](int row0, int rows, float* c) {
        gemm(kind, Trans::kNo, tb, rows, N, K, a.data() + row0 * K, K, w.data(), in, false, c, N);
      };
      for (int M = 1; M <= 200 && first_difference.empty(); M += M < 70 ? 1 : 43) {
        std::vector<float> exact(static_cast<std::size_t>(M) * N),
            padded(static_cast<std::size_t>((M + probe - 1) / probe * probe) * N),
            split(exact.size());
        product(0, M, exact.data());
        product(0, (M + probe - 1) / probe * probe, padded.data());
        const int whole = M / probe * probe;
        if (whole > 0) product(0, whole, split.data());
        if (M > whole) product(whole, M - whole, split.data() + whole * N);
        if (!std::equal(exact.begin(), exact.end(), padded.begin()) || split != exact)
          first_difference = ::t3d::detail::concat("M = ", M, ", ", threads, " thread(s), ",
                                                   tb == Trans::kYes ? "x·Wᵀ" : "dy·W");
      }
    }
  }
  set_rank_threads(1);
  if (bucket > 1) {
    EXPECT_EQ(first_difference, "") << gemm_kind_name(kind) << " pads M to " << bucket
                                    << " rows but a row's bits depend on the other rows";
  } else if (!first_difference.empty()) {
    std::printf("%s: rows depend on the other rows here (%s): M is not padded\n",
                gemm_kind_name(kind), first_difference.c_str());
  }
}

INSTANTIATE_TEST_SUITE_P(kernels_gemm, GemmKinds,
                         ::testing::Values(GemmKind::kOpenBlasF32, GemmKind::kOneDnnF32,
                                           GemmKind::kOneDnnBf16),
                         [](const auto& info) {
                           std::string name = gemm_kind_name(info.param);
                           for (auto& c : name)
                             if (c == '-') c = '_';
                           return name;
                         });

TEST(kernels_gemm, KindNamesRoundTrip) {
  for (GemmKind k : {GemmKind::kOpenBlasF32, GemmKind::kOneDnnF32, GemmKind::kOneDnnBf16})
    EXPECT_EQ(parse_gemm_kind(gemm_kind_name(k)), k);
  EXPECT_FALSE(parse_gemm_kind("onednn"));
}

}  // namespace
}  // namespace t3d::kernels

namespace t3d::kernels {
namespace {

// Every SIMD version of the array conversions gives the scalar conversion's bits: ties to even,
// NaN quiet, infinities, denormals (kept, not flushed) and signed zeros included.
TEST(kernels_bf16_conversion, EverySimdVersionMatchesTheScalarBits) {
  std::vector<float> in = {0.0f, -0.0f, 1.0f, -1.5f, 1e-40f, -3e-42f, 3.4e38f, -3.4e38f};
  for (std::uint32_t bits : {0x7F800000u, 0xFF800000u, 0x7FC00000u, 0x7F800001u, 0xFFFFFFFFu,
                             0x3F808000u, 0x3F818000u, 0x3F80FFFFu, 0x7F7FFFFFu})
    in.push_back(std::bit_cast<float>(bits));  // inf, NaNs, exact ties (even / odd), max float
  const auto random = ref::random_floats(1003, 9, -1e4f, 1e4f);
  in.insert(in.end(), random.begin(), random.end());
  const CpuFeatures f = detect_cpu_features();
  std::vector<const detail::SimdRows*> versions = {&detail::kSimdRowsSse2};
  if (f.avx2 && f.fma) versions.push_back(&detail::kSimdRowsAvx2);
  if (f.avx512f && f.avx512dq && f.avx512bw && f.avx512vl)
    versions.push_back(&detail::kSimdRowsAvx512);
  for (const auto* v : versions) {
    std::vector<bf16> out(in.size());
    v->to_bf16(out.data(), in.data(), static_cast<std::int64_t>(in.size()));
    for (std::size_t i = 0; i < in.size(); ++i)
      ASSERT_EQ(out[i], float_to_bf16(in[i])) << v->isa << " element " << i << " = " << in[i];
    std::vector<float> back(in.size());
    v->from_bf16(back.data(), out.data(), static_cast<std::int64_t>(in.size()));
    for (std::size_t i = 0; i < in.size(); ++i)
      ASSERT_EQ(std::bit_cast<std::uint32_t>(back[i]),
                std::bit_cast<std::uint32_t>(bf16_to_float(out[i])))
          << v->isa << " element " << i;
  }
}

// The AVX512-BF16 conversion behind precision.h's array float_to_bf16 (kernels/bf16_round.h):
// the scalar function's bits for every input: ties to even, NaN (quiet), infinities, signed zeros
// and denormals (which the instruction alone would flush). 2^20 random bit patterns (every
// exponent) plus the special cases, an odd count so the masked tail runs.
TEST(kernels_bf16_conversion, HardwareConversionMatchesTheScalarBits) {
  if (!detail::bf16_round_supported()) GTEST_SKIP() << "no AVX512-BF16 on this CPU";
  std::vector<float> in = {0.0f, -0.0f, 1.0f, -1.5f, 1e-40f, -3e-42f, 3.4e38f, -3.4e38f};
  for (std::uint32_t bits : {0x7F800000u, 0xFF800000u, 0x7FC00000u, 0x7F800001u, 0xFFFFFFFFu,
                             0x3F808000u, 0x3F818000u, 0x3F80FFFFu, 0x7F7FFFFFu, 0x00800000u})
    in.push_back(std::bit_cast<float>(bits));
  std::mt19937 rng(11);
  for (int i = 0; i < (1 << 20) + 5; ++i)
    in.push_back(std::bit_cast<float>(static_cast<std::uint32_t>(rng())));
  std::vector<bf16> out(in.size());
  detail::round_bf16_avx512(out.data(), in.data(), static_cast<std::int64_t>(in.size()));
  for (std::size_t i = 0; i < in.size(); ++i)
    ASSERT_EQ(out[i], float_to_bf16(in[i]))
        << "element " << i << " = " << in[i] << " bits " << std::bit_cast<std::uint32_t>(in[i]);
  std::vector<bf16> api(in.size());
  float_to_bf16(api.data(), in.data(), static_cast<std::int64_t>(in.size()));
  EXPECT_EQ(api, out);
}

}  // namespace
}  // namespace t3d::kernels
