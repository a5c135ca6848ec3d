// Where and how an op runs: the execution context every op that computes takes first (llm.c's
// launchers take a stream the same way). Ops dispatch on it inside kernels/; nothing above
// kernels/ switches on a backend.
//   - kCpu: host memory, the rank's OpenMP threads, GEMMs of `gemm` (kernels/gemm.h);
//   - kCuda: device memory, enqueued on `stream` (kernels/cuda/cuda_ops.h), GEMMs through cuBLAS
//     in the precision `gemm` implies (bf16 inputs with fp32 sums for a bf16 kind, else fp32).
// The pointers an op is given must be of the Exec's memory (an Arena of that Memory).
#pragma once

#include "kernels/check.h"
#include "kernels/gemm.h"

namespace t3d::kernels {

namespace cuda {
class Stream;
}

enum class Backend : std::uint8_t { kCpu, kCuda };

struct Exec {
  Backend backend = Backend::kCpu;
  GemmKind gemm = GemmKind::kOpenBlasF32;
  const cuda::Stream* stream = nullptr;  // kCuda only

  // A CPU execution with GEMMs of `kind`: what every CPU caller means by a GEMM kind.
  constexpr Exec(GemmKind kind) : gemm(kind) {}  // NOLINT: implicit on purpose
  // A GPU execution on `s`, its GEMM precision that of `kind`.
  Exec(GemmKind kind, const cuda::Stream& s) : backend(Backend::kCuda), gemm(kind), stream(&s) {}
  bool on_gpu() const { return backend == Backend::kCuda; }
};

// The CPU, for an op that runs no GEMM, where its caller has no Exec of its own yet: each use above
// kernels/ is a place the seam has still to reach (the runtime's state outside the Model: the
// optimizer's shards, the gradient reducer, decoding).
inline constexpr Exec kCpu{GemmKind::kOpenBlasF32};

}  // namespace t3d::kernels

// T3D_ON_GPU(exec, call): the first line of an op that has a CUDA twin: returns `call` (the twin,
// kernels/cuda/cuda_ops.h) when `exec` is a GPU execution. In a build without the CUDA backend no
// GPU Exec can exist (no cuda::Stream can be made), and the line only checks that.
// On a GPU the call is timed while op timing is on (T3D_GPU_OP_TIMES, kernels/cuda/op_timer.h),
// under the op's name.
#ifdef T3D_HAVE_CUDA
#include "kernels/cuda/op_timer.h"
#define T3D_ON_GPU(exec, call)                                                   \
  if ((exec).on_gpu()) {                                                         \
    const ::t3d::kernels::cuda::OpTimer t3d_op_timer_(*(exec).stream, __func__); \
    return call;                                                                 \
  }
#else
#define T3D_ON_GPU(exec, call) \
  T3D_ASSERT(!(exec).on_gpu(), "a GPU execution in a build without the CUDA backend")
#endif
