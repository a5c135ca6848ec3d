// Threads for the non-GEMM kernels (attention tiles, element-wise ops). Internal to kernels/.
//
// One rank owns `blas_threads()` cores (the trainer sets it to threads_per_rank). GEMMs use them
// through OpenBLAS's pool; the non-GEMM kernels use them through an OpenMP parallel for, only
// when the rank has more than one thread and the work is large: a one-thread rank runs exactly
// the serial loops. The launcher exports OMP_WAIT_POLICY=PASSIVE, so OpenMP's workers sleep
// between regions instead of spinning against OpenBLAS's pool on the same cores.
// Every parallel loop writes disjoint outputs per iteration (no shared float accumulators), so
// results do not depend on which thread ran what.
#pragma once

#include <cstdint>

namespace t3d::kernels::detail {

// Threads for a loop of `work` floats touched (1 below the size where a fork/join pays off).
int op_threads(std::int64_t work);

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
