#include "kernels/gemm.h"

#include <omp.h>

#include <algorithm>
#include <chrono>
#include <cmath>
#include <map>
#include <memory>
#include <mutex>
#include <oneapi/dnnl/dnnl.hpp>
#include <random>
#include <tuple>
#include <vector>

#include "kernels/blas.h"
#include "kernels/check.h"
#include "kernels/precision.h"
#include "kernels/threads.h"

namespace t3d::kernels {
namespace {

// One primitive per shape, layout, accumulation, input type and thread count: oneDNN splits the
// work when the primitive is created, so a primitive is only valid for the threads it was made for.
using PrimitiveKey = std::tuple<std::int64_t, std::int64_t, std::int64_t, bool, bool, std::int64_t,
                                std::int64_t, std::int64_t, bool, bool, int>;

struct OneDnn {
  dnnl::engine engine{dnnl::engine::kind::cpu, 0};
  dnnl::stream stream{engine};
  std::map<PrimitiveKey, dnnl::matmul> primitives;
  std::vector<bf16> a16, b16;  // bf16 copies of the inputs (the workspace)
};

// Per thread, so that nothing here is shared should two threads call gemm() at once.
OneDnn& onednn() {
  thread_local OneDnn state;
  return state;
}

std::size_t g_workspace_bytes = 0;

dnnl::memory::dims strides_of(Trans t, std::int64_t ld) {
  // Row-major (rows, cols) view of op(X): X itself (stride ld, 1) or its transpose (1, ld).
  return t == Trans::kNo ? dnnl::memory::dims{ld, 1} : dnnl::memory::dims{1, ld};
}

// A stored matrix to round to bf16: rows × cols at stride ld, written packed (stride cols).
struct Rounding {
  bf16* out;
  const float* in;
  std::int64_t rows, cols, ld;
};

// Rows [lo, hi) of the matrices' rows taken one after the other (x's rows, then y's).
void round_rows(const Rounding& x, const Rounding& y, std::int64_t lo, std::int64_t hi) {
  for (const Rounding* m : {&x, &y}) {
    const std::int64_t a = std::min(lo, m->rows), b = std::min(hi, m->rows);
    if (a < b && m->ld == m->cols)  // packed: one run
      float_to_bf16(m->out + a * m->cols, m->in + a * m->cols, (b - a) * m->cols);
    else
      for (std::int64_t r = a; r < b; ++r)
        float_to_bf16(m->out + r * m->cols, m->in + r * m->ld, m->cols);
    lo = std::max<std::int64_t>(0, lo - m->rows), hi = std::max<std::int64_t>(0, hi - m->rows);
  }
}

// Rounds both inputs of a GEMM in one parallel region (one fork and join instead of two), each
// thread a contiguous range of rows weighted by their length. Element-wise, so the bits do not
// depend on the split.
void round_to_bf16(const Rounding& a, const Rounding& b) {
  const std::int64_t total = a.rows * a.cols + b.rows * b.cols;
  const int nt = detail::op_threads(total);
  if (nt <= 1) return round_rows(a, b, 0, a.rows + b.rows);
#pragma omp parallel for num_threads(nt) schedule(static)
  for (int t = 0; t < nt; ++t) {
    // Thread t's share of the elements, in rows of a then rows of b.
    const auto row_at = [&](std::int64_t elem) {
      const std::int64_t in_a = a.rows * a.cols;
      if (elem <= in_a) return (elem + a.cols - 1) / a.cols;
      return a.rows + (elem - in_a + b.cols - 1) / b.cols;
    };
    const std::int64_t chunk = (total + nt - 1) / nt;
    round_rows(a, b, row_at(std::min(total, t * chunk)), row_at(std::min(total, (t + 1) * chunk)));
  }
}

void onednn_gemm(bool bf16_inputs, Trans ta, Trans tb, std::int64_t M, std::int64_t N,
                 std::int64_t K, const GemmOperand& A, const GemmOperand& B, bool accumulate,
                 float* C, std::int64_t ldc) {
  using dt = dnnl::memory::data_type;
  OneDnn& s = onednn();
  const void* a = A.data;
  const void* b = B.data;
  std::int64_t lda = A.ld, ldb = B.ld;
  if (bf16_inputs) {
    // Stored shapes: A is (M, K) or, transposed, (K, M); likewise B. Packed, the stride is the
    // stored row length. An operand that comes rounded is read as it is (rounding it: 0 rows).
    const std::int64_t a_rows = ta == Trans::kNo ? M : K, a_cols = ta == Trans::kNo ? K : M;
    const std::int64_t b_rows = tb == Trans::kNo ? K : N, b_cols = tb == Trans::kNo ? N : K;
    if (s.a16.size() < static_cast<std::size_t>(M * K) ||
        s.b16.size() < static_cast<std::size_t>(K * N)) {
      s.a16.resize(std::max(s.a16.size(), static_cast<std::size_t>(M * K)));
      s.b16.resize(std::max(s.b16.size(), static_cast<std::size_t>(K * N)));
      g_workspace_bytes = std::max(g_workspace_bytes, (s.a16.size() + s.b16.size()) * sizeof(bf16));
    }
    round_to_bf16({s.a16.data(), A.data, A.rounded ? 0 : a_rows, a_cols, lda},
                  {s.b16.data(), B.data, B.rounded ? 0 : b_rows, b_cols, ldb});
    a = A.rounded ? A.rounded : s.a16.data();
    b = B.rounded ? B.rounded : s.b16.data();
    lda = a_cols, ldb = b_cols;
  }
  const int threads = omp_get_max_threads();
  const PrimitiveKey key{M,      N,   K,   ta == Trans::kYes, tb == Trans::kYes,
                         lda,    ldb, ldc, accumulate,        bf16_inputs,
                         threads};
  auto it = s.primitives.find(key);
  if (it == s.primitives.end()) {
    const dt in = bf16_inputs ? dt::bf16 : dt::f32;
    const dnnl::memory::desc ad({M, K}, in, strides_of(ta, lda));
    const dnnl::memory::desc bd({K, N}, in, strides_of(tb, ldb));
    const dnnl::memory::desc cd({M, N}, dt::f32, dnnl::memory::dims{ldc, 1});
    dnnl::primitive_attr attr;
    if (accumulate) {
      dnnl::post_ops ops;
      ops.append_sum(1.0f);
      attr.set_post_ops(ops);
    }
    try {
      const dnnl::matmul::primitive_desc pd(dnnl::matmul::desc(ad, bd, cd), attr, s.engine);
      it = s.primitives.emplace(key, dnnl::matmul(pd)).first;
    } catch (const dnnl::error& e) {
      // oneDNN has no matmul for this input type on this CPU (bf16 needs AVX-512).
      throw GemmUnavailable(
          ::t3d::detail::concat("oneDNN cannot run a ", bf16_inputs ? "bf16" : "fp32",
                                " GEMM on this CPU (", onednn_version_string(), "): ", e.what()),
          "Set hardware.gemm = \"openblas\" or train.precision = \"fp32\"");
    }
  }
  const dt in = bf16_inputs ? dt::bf16 : dt::f32;
  dnnl::memory am({{M, K}, in, strides_of(ta, lda)}, s.engine, const_cast<void*>(a));
  dnnl::memory bm({{K, N}, in, strides_of(tb, ldb)}, s.engine, const_cast<void*>(b));
  dnnl::memory cm({{M, N}, dt::f32, dnnl::memory::dims{ldc, 1}}, s.engine, C);
  it->second.execute(s.stream, {{DNNL_ARG_SRC, am}, {DNNL_ARG_WEIGHTS, bm}, {DNNL_ARG_DST, cm}});
  s.stream.wait();
}

// OpenBLAS on the rank's OpenMP threads: a GEMM worth splitting is cut into one contiguous block
// of C's rows per thread (on multiples of 16 rows), each thread running single-threaded OpenBLAS
// on its block with all of N and K. One pool for every kernel of the rank, whose idle threads may
// then spin briefly (the launcher's GOMP_SPINCOUNT): OpenBLAS's own pool is never woken. The split
// is static, so a thread count gives the same bits every run; another count may differ in the
// last bits (OpenBLAS's kernels tile rows near a block's edge their own way), as OpenBLAS's own
// threading does.
void openblas_gemm(Trans ta, Trans tb, std::int64_t M, std::int64_t N, std::int64_t K,
                   const float* A, std::int64_t lda, const float* B, std::int64_t ldb,
                   bool accumulate, float* C, std::int64_t ldc) {
  // Blocks below ~4M multiply-adds are not worth a fork and join.
  constexpr std::int64_t kRowAlign = 16, kMinBlockMacs = std::int64_t{1} << 22;
  const float beta = accumulate ? 1.0f : 0.0f;
  const int nt = static_cast<int>(std::min(
      {M * N * K / kMinBlockMacs, M / kRowAlign, static_cast<std::int64_t>(blas_threads())}));
  const detail::BlasSingleThreaded one_blas_thread;
  if (nt <= 1) return sgemm(ta, tb, M, N, K, 1.0f, A, lda, B, ldb, beta, C, ldc);
#pragma omp parallel for num_threads(nt) schedule(static)
  for (int t = 0; t < nt; ++t) {
    const std::int64_t lo = M * t / nt / kRowAlign * kRowAlign;
    const std::int64_t hi = t == nt - 1 ? M : M * (t + 1) / nt / kRowAlign * kRowAlign;
    if (lo < hi)  // rows [lo, hi) of op(A) and of C
      sgemm(ta, tb, hi - lo, N, K, 1.0f, ta == Trans::kNo ? A + lo * lda : A + lo, lda, B, ldb,
            beta, C + lo * ldc, ldc);
  }
}

// Naive C = op(A) op(B) in double, for verification.
std::vector<double> gemm_reference(Trans ta, Trans tb, int M, int N, int K,
                                   const std::vector<float>& A, const std::vector<float>& B) {
  std::vector<double> C(static_cast<std::size_t>(M) * N, 0.0);
  for (int i = 0; i < M; ++i)
    for (int j = 0; j < N; ++j) {
      double sum = 0.0;
      for (int k = 0; k < K; ++k)
        sum += double(ta == Trans::kNo ? A[i * K + k] : A[k * M + i]) *
               double(tb == Trans::kNo ? B[k * N + j] : B[j * K + k]);
      C[i * N + j] = sum;
    }
  return C;
}

// Sets the threads of the pool `kind` runs on; restores the previous count when destroyed.
class GemmThreads {
 public:
  GemmThreads(GemmKind kind, int threads) : blas_(kind == GemmKind::kOpenBlasF32) {
    saved_ = blas_ ? blas_threads() : omp_get_max_threads();
    blas_ ? set_blas_threads(threads) : omp_set_num_threads(threads);
  }
  ~GemmThreads() { blas_ ? set_blas_threads(saved_) : omp_set_num_threads(saved_); }
  GemmThreads(const GemmThreads&) = delete;
  GemmThreads& operator=(const GemmThreads&) = delete;

 private:
  bool blas_;
  int saved_ = 1;
};

}  // namespace

const char* gemm_kind_name(GemmKind kind) {
  switch (kind) {
    case GemmKind::kOpenBlasF32:
      return "openblas-fp32";
    case GemmKind::kOneDnnF32:
      return "onednn-fp32";
    case GemmKind::kOneDnnBf16:
      return "onednn-bf16";
  }
  return "?";
}

std::optional<GemmKind> parse_gemm_kind(std::string_view name) {
  for (GemmKind k : {GemmKind::kOpenBlasF32, GemmKind::kOneDnnF32, GemmKind::kOneDnnBf16})
    if (name == gemm_kind_name(k)) return k;
  return std::nullopt;
}

void gemm(GemmKind kind, Trans trans_a, Trans trans_b, std::int64_t M, std::int64_t N,
          std::int64_t K, GemmOperand A, GemmOperand B, bool accumulate, float* C,
          std::int64_t ldc) {
  const std::int64_t lda = A.ld, ldb = B.ld;
  if (kind == GemmKind::kOpenBlasF32)
    return openblas_gemm(trans_a, trans_b, M, N, K, A.data, lda, B.data, ldb, accumulate, C, ldc);
  T3D_ASSERT(lda >= std::max<std::int64_t>(1, trans_a == Trans::kNo ? K : M), "lda ", lda);
  T3D_ASSERT(ldb >= std::max<std::int64_t>(1, trans_b == Trans::kNo ? N : K), "ldb ", ldb);
  T3D_ASSERT(ldc >= std::max<std::int64_t>(1, N), "ldc ", ldc);
  if (M == 0 || N == 0) return;
  if (K == 0) {  // oneDNN rejects empty reductions; the product is zero
    if (!accumulate)
      for (std::int64_t i = 0; i < M; ++i) std::fill(C + i * ldc, C + i * ldc + N, 0.0f);
    return;
  }
  onednn_gemm(kind == GemmKind::kOneDnnBf16, trans_a, trans_b, M, N, K, A, B, accumulate, C, ldc);
}

namespace {

constexpr std::int64_t kRowBucket = 32;

// Whether GEMMs of `kind` give the rows of an M-row product the bits of the same rows in a GEMM
// of M rounded up to kRowBucket (other rows after them) and of the rows split at a multiple of
// it, at both of an expert's products, this rank's thread count and one thread, for a spread of
// M: the promise gemm_row_bucket makes, measured where it is made.
bool padding_keeps_the_rows(GemmKind kind) {
  const std::int64_t out = 40, in = 56, most = 128;  // w (out, in)
  std::mt19937 rng(17);
  std::uniform_real_distribution<float> dist(-1.0f, 1.0f);
  std::vector<float> w(static_cast<std::size_t>(out * in)), a(static_cast<std::size_t>(most * in));
  for (auto& v : w) v = dist(rng);
  for (auto& v : a) v = dist(rng);
  const int threads = omp_get_max_threads();
  bool same = true;
  for (const int t : {threads, 1}) {
    omp_set_num_threads(t);
    for (const Trans tb : {Trans::kYes, Trans::kNo}) {  // x·Wᵀ and dy·W
      const std::int64_t N = tb == Trans::kYes ? out : in, K = tb == Trans::kYes ? in : out;
      const auto product = [&](std::int64_t row0, std::int64_t rows, float* c) {
        onednn_gemm(kind == GemmKind::kOneDnnBf16, Trans::kNo, tb, rows, N, K,
                    GemmOperand{a.data() + row0 * K, K}, GemmOperand{w.data(), in}, false, c, N);
      };
      for (const std::int64_t M : {1, 7, 31, 33, 50, 64, 95}) {
        const std::int64_t padded = (M + kRowBucket - 1) / kRowBucket * kRowBucket;
        const std::int64_t whole = M / kRowBucket * kRowBucket;
        std::vector<float> exact(static_cast<std::size_t>(M * N)),
            pad(static_cast<std::size_t>(padded * N)), split(exact.size());
        product(0, M, exact.data());
        product(0, padded, pad.data());
        if (whole > 0) product(0, whole, split.data());
        if (M > whole) product(whole, M - whole, split.data() + whole * N);
        same = same && std::equal(exact.begin(), exact.end(), pad.begin()) && split == exact;
      }
    }
  }
  omp_set_num_threads(threads);
  return same;
}

// oneDNN's AVX-512 kernels other than AMX: the ones whose rows may be padded (gemm.h).
bool avx512_without_amx() {
  switch (dnnl::get_effective_cpu_isa()) {
    case dnnl::cpu_isa::avx512_core:
    case dnnl::cpu_isa::avx512_core_vnni:
    case dnnl::cpu_isa::avx512_core_bf16:
      return true;
    default:
      return false;
  }
}

}  // namespace

std::int64_t gemm_row_bucket(GemmKind kind) {
  if (kind == GemmKind::kOpenBlasF32) return 1;
  // Decided once per kind and process (the kind runs here: its caller verified it).
  static std::once_flag decided[2];
  static bool pads[2];
  const int i = kind == GemmKind::kOneDnnBf16 ? 1 : 0;
  std::call_once(decided[i],
                 [&] { pads[i] = avx512_without_amx() && padding_keeps_the_rows(kind); });
  return pads[i] ? kRowBucket : 1;
}

void set_rank_threads(int n) {
  set_blas_threads(n);
  omp_set_num_threads(n);
}

std::size_t gemm_workspace_bytes() { return g_workspace_bytes; }

bool cpu_has_bf16_dot() { return detect_cpu_features().avx512_bf16; }

std::string onednn_version_string() {
  const dnnl_version_t* v = dnnl_version();
  std::string isa;
  switch (dnnl::get_effective_cpu_isa()) {
    case dnnl::cpu_isa::avx512_core_amx:
      isa = "avx512_core_amx";
      break;
    case dnnl::cpu_isa::avx512_core_bf16:
      isa = "avx512_core_bf16";
      break;
    case dnnl::cpu_isa::avx512_core_vnni:
      isa = "avx512_core_vnni";
      break;
    case dnnl::cpu_isa::avx512_core:
      isa = "avx512_core";
      break;
    case dnnl::cpu_isa::avx2_vnni:
      isa = "avx2_vnni";
      break;
    case dnnl::cpu_isa::avx2:
      isa = "avx2";
      break;
    default:
      isa = "other";
      break;
  }
  return "oneDNN " + std::to_string(v->major) + "." + std::to_string(v->minor) + "." +
         std::to_string(v->patch) + " (cpu isa " + isa + ")";
}

double measure_gemm_gflops(GemmKind kind, std::int64_t rows, std::int64_t in, std::int64_t out,
                           int threads, int repeats) {
  T3D_USER_CHECK(rows > 0 && in > 0 && out > 0 && threads > 0 && repeats > 0,
                 "bad GEMM benchmark shape ", rows, "x", in, "x", out, " threads ", threads);
  GemmThreads pool(kind, threads);
  std::mt19937 rng(7);
  std::uniform_real_distribution<float> dist(-1.0f, 1.0f);
  std::vector<float> x(static_cast<std::size_t>(rows * in)), w(static_cast<std::size_t>(out * in)),
      y(static_cast<std::size_t>(rows * out)), dx(x.size()), dw(w.size(), 0.0f);
  for (auto& v : x) v = dist(rng);
  for (auto& v : w) v = dist(rng);
  for (auto& v : y) v = dist(rng);
  const auto layer = [&] {
    gemm(kind, Trans::kNo, Trans::kYes, rows, out, in, x.data(), in, w.data(), in, false, y.data(),
         out);  // y = x Wᵀ
    gemm(kind, Trans::kNo, Trans::kNo, rows, in, out, y.data(), out, w.data(), in, false, dx.data(),
         in);  // dx = dy W
    gemm(kind, Trans::kYes, Trans::kNo, out, in, rows, y.data(), out, x.data(), in, true, dw.data(),
         in);  // dW += dyᵀ x
  };
  layer();  // warm-up: primitives, packing buffers, workspace
  std::vector<double> rates;
  for (int r = 0; r < repeats; ++r) {
    const auto t0 = std::chrono::steady_clock::now();
    layer();
    const std::chrono::duration<double> dt = std::chrono::steady_clock::now() - t0;
    rates.push_back(3 * 2.0 * rows * in * out / dt.count() * 1e-9);
  }
  std::nth_element(rates.begin(), rates.begin() + repeats / 2, rates.end());
  return rates[static_cast<std::size_t>(repeats / 2)];
}

void verify_gemm_kind(GemmKind kind) {
  struct Shape {
    int M, N, K;
  };
  const Shape shapes[] = {{1, 1, 1}, {7, 5, 3}, {67, 45, 129}, {33, 130, 17}};
  const double tolerance = gemm_kind_is_bf16(kind) ? 1e-2 : 1e-4;
  std::mt19937 rng(1234);
  std::uniform_real_distribution<float> dist(-1.0f, 1.0f);
  double worst = 0.0;
  std::string worst_case;
  for (const auto& s : shapes)
    for (Trans ta : {Trans::kNo, Trans::kYes})
      for (Trans tb : {Trans::kNo, Trans::kYes})
        for (bool accumulate : {false, true}) {
          std::vector<float> A(static_cast<std::size_t>(s.M) * s.K),
              B(static_cast<std::size_t>(s.K) * s.N), C(static_cast<std::size_t>(s.M) * s.N);
          for (auto& x : A) x = dist(rng);
          for (auto& x : B) x = dist(rng);
          for (auto& x : C) x = dist(rng);
          const std::vector<float> C0 = C;
          gemm(kind, ta, tb, s.M, s.N, s.K, A.data(), ta == Trans::kNo ? s.K : s.M, B.data(),
               tb == Trans::kNo ? s.N : s.K, accumulate, C.data(), s.N);
          auto ref = gemm_reference(ta, tb, s.M, s.N, s.K, A, B);
          double num = 0.0, den = 0.0;
          for (std::size_t i = 0; i < C.size(); ++i) {
            if (accumulate) ref[i] += C0[i];
            num = std::max(num, std::abs(C[i] - ref[i]));
            den = std::max(den, std::abs(ref[i]));
          }
          const double rel = num / std::max(den, 1e-30);
          if (!(rel <= worst)) {  // also catches NaN
            worst = std::isnan(rel) ? INFINITY : rel;
            worst_case =
                ::t3d::detail::concat(s.M, "x", s.N, "x", s.K, " trans_a=", ta == Trans::kYes,
                                      " trans_b=", tb == Trans::kYes, " accumulate=", accumulate);
          }
        }
  if (worst <= tolerance) return;
  const std::string rec = recommended_openblas_coretype();
  const std::string fix =
      kind == GemmKind::kOpenBlasF32
          ? "Set OPENBLAS_CORETYPE=" +
                (rec.empty() ? std::string("<a core type your CPU supports>") : rec) +
                " (or another core type your CPU supports) before starting titan3d"
          : std::string("Set hardware.gemm = \"openblas\"");
  throw GemmUnavailable(
      ::t3d::detail::concat(gemm_kind_name(kind), " GEMM check failed: relative error ", worst,
                            " at ", worst_case, " (", onednn_version_string(), "; ",
                            openblas_config_string(), ")"),
      "Refusing to train on a wrong result; " + fix);
}

}  // namespace t3d::kernels
