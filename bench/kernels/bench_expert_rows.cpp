// What a mixture of experts' changing row counts cost the GEMMs (docs/moe.md): every expert's
// GEMMs take its row count as M, and kernels/gemm.cpp keeps one oneDNN primitive per shape, so
// each count not seen before compiles a new one. For each GEMM kind and the experts' two M-row
// products (forward x·Wᵀ, input gradient dy·W) at the bench's expert shape, over a sequence of
// row counts such as a balanced router gives (ROWS_MEAN ± ROWS_SPREAD), three ways:
//   (forward: x (M, C) · Wᵀ, W (Fe, C); input-grad: dy (M, Fe) · W)
//   exact   one GEMM of M rows (what titan3d does)
//   split   a GEMM of M rounded down to BUCKET rows, then one of the M mod BUCKET last rows:
//           at most max/BUCKET + BUCKET shapes
//   padded  one GEMM of M rounded up to BUCKET rows (the extra rows' inputs zero): at most
//           max/BUCKET shapes, rows computed in vain
// Prints, per way: the first pass over the counts (shapes compiled on the way) and a second pass
// over the same counts (all compiled), ms per GEMM, the compile cost per new shape, and whether
// the rows of C are bit for bit those of `exact` (only then is the way a free change).
//
// Run: OMP_NUM_THREADS=2 build/bench/kernels/bench_expert_rows [C FE COUNTS]
#include <omp.h>

#include <algorithm>
#include <chrono>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <random>
#include <set>
#include <string>
#include <vector>

#include "kernels/check.h"
#include "kernels/gemm.h"

namespace {

using t3d::kernels::GemmKind;
using t3d::kernels::Trans;
using Clock = std::chrono::steady_clock;

int env_int(const char* name, int fallback) {
  const char* v = std::getenv(name);
  return v ? std::atoi(v) : fallback;
}

struct Product {
  const char* name;
  Trans tb;
  std::int64_t N, K;  // C (M, N) = A (M, K) · op(B)
};

enum class Way { kExact, kSplit, kPadded };
const char* way_name(Way w) {
  return w == Way::kExact ? "exact" : w == Way::kSplit ? "split" : "padded";
}

// C's first M rows = A's first M rows · op(B), the way `w` does it. A and C have room for M
// rounded up to `bucket` rows; A's rows from M on are zero.
void run(GemmKind kind, Way w, const Product& p, std::int64_t M, std::int64_t bucket,
         const float* A, const float* B, float* C) {
  const std::int64_t ldb = p.tb == Trans::kNo ? p.N : p.K;
  const auto gemm_rows = [&](std::int64_t r0, std::int64_t rows) {
    t3d::kernels::gemm(kind, Trans::kNo, p.tb, rows, p.N, p.K, A + r0 * p.K, p.K, B, ldb, false,
                       C + r0 * p.N, p.N);
  };
  if (w == Way::kExact) return gemm_rows(0, M);
  if (w == Way::kPadded) return gemm_rows(0, (M + bucket - 1) / bucket * bucket);
  const std::int64_t main = M / bucket * bucket;
  if (main > 0) gemm_rows(0, main);
  if (M > main) gemm_rows(main, M - main);
}

}  // namespace

int main(int argc, char** argv) {
  const std::int64_t C = argc > 1 ? std::atoll(argv[1]) : 512;
  const std::int64_t Fe = argc > 2 ? std::atoll(argv[2]) : 704;
  const int counts = argc > 3 ? std::atoi(argv[3]) : 200;
  const std::int64_t mean = env_int("ROWS_MEAN", 512), spread = env_int("ROWS_SPREAD", 160);
  const std::int64_t bucket = env_int("BUCKET", 32);
  std::mt19937 rng(11);
  std::uniform_int_distribution<std::int64_t> draw(std::max<std::int64_t>(1, mean - spread),
                                                   mean + spread);
  std::vector<std::int64_t> rows(static_cast<std::size_t>(counts));
  for (auto& r : rows) r = draw(rng);
  const std::int64_t max_rows = *std::max_element(rows.begin(), rows.end());
  const std::int64_t room = (max_rows + bucket - 1) / bucket * bucket;
  const std::size_t distinct = std::set<std::int64_t>(rows.begin(), rows.end()).size();
  std::printf(
      "%s; %d OpenMP threads; expert C = %lld, Fe = %lld; %d row counts in [%lld, %lld] "
      "(%zu distinct); bucket %lld\n",
      t3d::kernels::onednn_version_string().c_str(), omp_get_max_threads(),
      static_cast<long long>(C), static_cast<long long>(Fe), counts,
      static_cast<long long>(mean - spread), static_cast<long long>(mean + spread), distinct,
      static_cast<long long>(bucket));
  const Product products[] = {{"forward", Trans::kYes, Fe, C}, {"input-grad", Trans::kNo, C, Fe}};
  std::uniform_real_distribution<float> u(-1.0f, 1.0f);
  std::printf("%-14s %-16s %-7s %12s %12s %14s %s\n", "kind", "product", "way", "pass 1 ms",
              "pass 2 ms", "ms per shape", "rows bit for bit");
  for (const GemmKind kind :
       {GemmKind::kOneDnnBf16, GemmKind::kOneDnnF32, GemmKind::kOpenBlasF32}) {
    try {
      t3d::kernels::verify_gemm_kind(kind);
    } catch (const std::exception& e) {
      std::printf("%-14s unavailable here\n", t3d::kernels::gemm_kind_name(kind));
      continue;
    }
    for (const Product& p : products) {
      std::vector<float> A0(static_cast<std::size_t>(room * p.K)), A(A0.size()),
          B(static_cast<std::size_t>(p.N * p.K));
      for (auto& v : A0) v = u(rng);
      for (auto& v : B) v = u(rng);
      std::vector<float> want(static_cast<std::size_t>(room * p.N)), got(want.size());
      // Each way on its own shapes: the ways' pass-1 costs are their own compiles (a shape an
      // earlier way compiled would be free). Exact goes first and is the reference.
      std::vector<std::vector<float>> exact_rows;
      for (const Way w : {Way::kExact, Way::kSplit, Way::kPadded}) {
        double pass[2] = {0, 0};
        bool same = true;
        for (int k = 0; k < 2; ++k)
          for (std::size_t i = 0; i < rows.size(); ++i) {
            const std::int64_t M = rows[i];
            // A's first M rows, then zeros (padded reads them, as a caller's slack would hold).
            std::copy(A0.begin(), A0.begin() + M * p.K, A.begin());
            std::fill(A.begin() + M * p.K, A.end(), 0.0f);
            const auto t0 = Clock::now();
            run(kind, w, p, M, bucket, A.data(), B.data(), got.data());
            pass[k] += std::chrono::duration<double>(Clock::now() - t0).count();
            if (k == 1) {
              if (w == Way::kExact)
                exact_rows.emplace_back(got.begin(), got.begin() + M * p.N);
              else
                same = same && std::memcmp(exact_rows[i].data(), got.data(),
                                           static_cast<std::size_t>(M * p.N) * sizeof(float)) == 0;
            }
          }
        std::set<std::int64_t> shapes;
        for (const std::int64_t M : rows) {
          if (w == Way::kExact) shapes.insert(M);
          if (w == Way::kPadded) shapes.insert((M + bucket - 1) / bucket * bucket);
          if (w == Way::kSplit) {
            if (M / bucket > 0) shapes.insert(M / bucket * bucket);
            if (M % bucket) shapes.insert(M % bucket);
          }
        }
        std::printf("%-14s %-16s %-7s %12.2f %12.2f %14.3f %s (%zu shapes)\n",
                    t3d::kernels::gemm_kind_name(kind), p.name, way_name(w), pass[0] * 1e3 / counts,
                    pass[1] * 1e3 / counts,
                    (pass[0] - pass[1]) * 1e3 / static_cast<double>(shapes.size()),
                    w == Way::kExact ? "(reference)"
                    : same           ? "yes"
                                     : "NO",
                    shapes.size());
      }
    }
  }
}
