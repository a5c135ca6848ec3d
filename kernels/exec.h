// Where and how an op runs: the execution context every op that computes takes first (llm.c's
// launchers take a stream the same way). Ops dispatch on it inside kernels/; nothing above
// kernels/ switches on a backend.
//   - kCpu: host memory, the rank's OpenMP threads, GEMMs of `gemm` (kernels/gemm.h);
//   - kCuda: device memory, enqueued on `stream` (kernels/cuda/cuda_ops.h), GEMMs through cuBLAS
//     in the precision `gemm` implies (bf16 inputs with fp32 sums for a bf16 kind, else fp32).
// The pointers an op is given must be of the Exec's memory (an Arena of that Memory).
#pragma once

#include <algorithm>
#include <iterator>
#include <vector>

#include "kernels/check.h"
#include "kernels/gemm.h"
#include "kernels/memory_guard.h"

namespace t3d::kernels {

namespace cuda {
class Stream;
}

enum class Backend : std::uint8_t { kCpu, kCuda };

// A bf16 copy of the fp32 weights of one region (a model's parameter region), rounded as a bf16
// GEMM rounds its inputs (precision.h's float_to_bf16), in the Exec's memory. While `current`, a
// bf16 GEMM of the linear ops (kernels/ops.h) whose weight lies in one of `tensors` reads the
// copy instead of rounding the weight again: the same bits, one rounding of the weights per
// training step instead of one per GEMM call. Each tensor's copy starts on kAlignment bytes, as
// the tensor does, so that a GEMM's operands keep the alignment its algorithm was chosen for
// (kernels/cuda/gemm_table.h). Its owner (runtime/model/model.h, Model::round_weights) makes it
// current only while nothing writes the weights.
struct WeightCopy {
  struct Tensor {
    std::int64_t begin = 0, end = 0;  // floats from `data`
    std::int64_t at = 0;              // its copy's first element in `rounded`
  };
  const float* data = nullptr;
  std::vector<Tensor> tensors;  // ascending, disjoint
  const bf16* rounded = nullptr;
  bool current = false;
  const bf16* of(const float* w) const {
    if (!current || w < data) return nullptr;
    const std::int64_t i = w - data;
    const auto after =
        std::upper_bound(tensors.begin(), tensors.end(), i,
                         [](std::int64_t v, const Tensor& t) { return v < t.begin; });
    if (after == tensors.begin() || i >= std::prev(after)->end) return nullptr;
    return rounded + std::prev(after)->at + (i - std::prev(after)->begin);
  }
};

struct Exec {
  Backend backend = Backend::kCpu;
  GemmKind gemm = GemmKind::kOpenBlasF32;
  const cuda::Stream* stream = nullptr;  // kCuda only
  // The weights' bf16 copy, or null: its owner outlives every use of this Exec by a linear op.
  const WeightCopy* weight_copy = nullptr;

  // A CPU execution with GEMMs of `kind`: what every CPU caller means by a GEMM kind.
  constexpr Exec(GemmKind kind) : gemm(kind) {}  // NOLINT: implicit on purpose
  // A GPU execution on `s`, its GEMM precision that of `kind`.
  Exec(GemmKind kind, const cuda::Stream& s) : backend(Backend::kCuda), gemm(kind), stream(&s) {}
  bool on_gpu() const { return backend == Backend::kCuda; }
  // The current bf16 copy of weight `w` (a bf16 GEMM kind only), or null.
  const bf16* rounded_weight(const float* w) const {
    return weight_copy && gemm_kind_is_bf16(gemm) ? weight_copy->of(w) : nullptr;
  }
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
// under the op's name. On the CPU the rest of the op's body may touch guarded device memory
// (kernels/memory_guard.h): so it must be the op's first statement, in the op's outermost block.
#ifdef T3D_HAVE_CUDA
#include "kernels/cuda/op_timer.h"
#define T3D_ON_GPU(exec, call)                                                   \
  if ((exec).on_gpu()) {                                                         \
    const ::t3d::kernels::cuda::OpTimer t3d_op_timer_(*(exec).stream, __func__); \
    return call;                                                                 \
  }                                                                              \
  const ::t3d::kernels::GuardedMemoryOpen t3d_guarded_memory_open_
#else
#define T3D_ON_GPU(exec, call)                                                         \
  T3D_ASSERT(!(exec).on_gpu(), "a GPU execution in a build without the CUDA backend"); \
  const ::t3d::kernels::GuardedMemoryOpen t3d_guarded_memory_open_
#endif
