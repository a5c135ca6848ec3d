#include "kernels/threads.h"

#include "kernels/blas.h"

namespace t3d::kernels::detail {

int op_threads(std::int64_t work) {
  // Below ~64k floats a loop takes a few microseconds: less than waking a sleeping thread.
  constexpr std::int64_t kMinWork = 1 << 16;
  if (work < kMinWork) return 1;
  return blas_threads();
}

BlasSingleThreaded::BlasSingleThreaded() : saved_(blas_threads()) {
  if (saved_ != 1) set_blas_threads(1);
}

BlasSingleThreaded::~BlasSingleThreaded() {
  if (saved_ != 1) set_blas_threads(saved_);
}

}  // namespace t3d::kernels::detail
