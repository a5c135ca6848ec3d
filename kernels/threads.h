// Threads for the kernels (GEMMs, attention tiles, element-wise ops). Internal to kernels/.
//
// One rank owns `blas_threads()` cores (the trainer sets it to threads_per_rank). Every kernel
// uses them through an OpenMP parallel for (GEMMs too: kernels/gemm.h), only when the rank has
// more than one thread and the work is large: a one-thread rank runs exactly the serial loops.
// Between regions the workers spin a while where the rank owns its cores, and sleep where ranks
// share them (the launcher's openmp_wait_env).
// Every parallel loop writes disjoint outputs per iteration (no shared float accumulators), so
// results do not depend on which thread ran what.
#pragma once

#include <algorithm>
#include <cstdint>

namespace t3d::kernels::detail {

// Threads for a loop of `work` floats touched (1 below the size where a fork/join pays off).
int op_threads(std::int64_t work);

// Element-wise work over [0, n): fn(lo, hi) on contiguous ranges, one per thread (op_threads),
// their boundaries on multiples of 16 floats (a cache line). Each element is computed alone, so
// the results do not depend on the split.
template <class Fn>
void split_range(std::int64_t n, Fn&& fn) {
  const int nt = op_threads(n);
  if (nt <= 1) return fn(std::int64_t{0}, n);
#pragma omp parallel for num_threads(nt) schedule(static)
  for (int t = 0; t < nt; ++t) {
    const std::int64_t chunk = (n / nt + 15) / 16 * 16;
    const std::int64_t lo = std::min(n, t * chunk), hi = t == nt - 1 ? n : std::min(n, lo + chunk);
    if (lo < hi) fn(lo, hi);
  }
}

// Row-wise work over N rows of C floats: fn(lo, hi) on contiguous row ranges, one per thread.
template <class Fn>
void split_rows(std::int64_t N, std::int64_t C, Fn&& fn) {
  const int nt = op_threads(N * C);
  if (nt <= 1) return fn(std::int64_t{0}, N);
#pragma omp parallel for num_threads(nt) schedule(static)
  for (int t = 0; t < nt; ++t) {
    const std::int64_t lo = N * t / nt, hi = N * (t + 1) / nt;
    if (lo < hi) fn(lo, hi);
  }
}

// While alive, OpenBLAS runs single-threaded: for GEMMs called from inside a parallel region
// (each thread its own small GEMMs; OpenBLAS's pool must not be entered from two threads).
class BlasSingleThreaded {
 public:
  BlasSingleThreaded();
  ~BlasSingleThreaded();
  BlasSingleThreaded(const BlasSingleThreaded&) = delete;
  BlasSingleThreaded& operator=(const BlasSingleThreaded&) = delete;

 private:
  int saved_;
};

}  // namespace t3d::kernels::detail
