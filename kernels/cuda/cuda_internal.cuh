// Internal to kernels/cuda/: error checks, the Stream's state, launch shapes.
#pragma once

#include <cublasLt.h>
#include <cuda_runtime.h>

#include <cstdint>
#include <map>
#include <memory>
#include <vector>

#include "kernels/check.h"
#include "kernels/cuda/cuda_ops.h"

// Every CUDA runtime call is checked: a failure throws InternalError naming the call, the file
// and line and CUDA's own message (a sticky error, e.g. an illegal address, surfaces at the next
// checked call on that device).
#define T3D_CUDA_CHECK(call)                                                                 \
  do {                                                                                       \
    const cudaError_t t3d_err_ = (call);                                                     \
    if (t3d_err_ != cudaSuccess)                                                             \
      throw ::t3d::InternalError(::t3d::detail::concat(                                      \
          __FILE__, ":", __LINE__, ": ", #call, " failed: ", cudaGetErrorString(t3d_err_))); \
  } while (0)

#define T3D_CUBLAS_CHECK(call)                                                                   \
  do {                                                                                           \
    const cublasStatus_t t3d_st_ = (call);                                                       \
    if (t3d_st_ != CUBLAS_STATUS_SUCCESS)                                                        \
      throw ::t3d::InternalError(::t3d::detail::concat(                                          \
          __FILE__, ":", __LINE__, ": ", #call, " failed: ", cublasLtGetStatusString(t3d_st_))); \
  } while (0)

// After a launch: a bad configuration is reported here, not at some later call.
#define T3D_CUDA_LAUNCHED() T3D_CUDA_CHECK(cudaGetLastError())

namespace t3d::kernels::cuda {

// cuBLASLt's workspace per stream: its advice for Hopper. Fixed for the stream's life, since the
// heuristic's answers depend on the workspace they may use.
inline constexpr std::size_t kBlasWorkspaceBytes = 32u << 20;

struct GemmPlan;  // ops_linear.cu: a shape's cuBLASLt descriptors and algorithm

struct Stream::Impl {
  int device = 0;
  cudaStream_t stream = nullptr;
  // Copies in the background of the compute (copy_to_host_behind): their own stream, and the
  // events that order it after the compute (compute_mark) and the compute after it (copies_mark).
  cudaStream_t copy_stream = nullptr;
  cudaEvent_t compute_mark = nullptr, copies_mark = nullptr;
  cublasLtHandle_t lt = nullptr;
  void* blas_workspace = nullptr;  // kBlasWorkspaceBytes
  // The algorithm of every GEMM shape met or given (kernels/cuda/gemm_table.h), and the
  // descriptors made for each (a cache of the table: cleared whenever the table changes).
  GemmTable gemm_table;
  std::map<GemmShape, std::shared_ptr<GemmPlan>> gemm_plans;
  // kernels/cuda/op_timer.h: the events of the ops timed since the last take_op_seconds, in
  // order (stop null: not recorded), and the events free for reuse.
  struct TimedOp {
    const char* op;
    cudaEvent_t start, stop;
  };
  std::vector<TimedOp> timed_ops;
  std::vector<cudaEvent_t> spare_events;
  // The partial sums of sum_of_squares (kSumBlocks doubles), and the step scalars read back to
  // the host: a sum, a count.
  double* partial_sums = nullptr;  // kSumBlocks a range of one launch, grown and kept
  std::size_t partial_sum_elems = 0;
  double* partial_sums_for(std::size_t elems);
  double* scalar_sum = nullptr;
  unsigned long long* scalar_count = nullptr;
  // bf16 copies of GEMM inputs, grown to the largest call and kept (library memory outside the
  // arena, as the CPU's per-thread bf16 buffers are).
  bf16* gemm_inputs = nullptr;
  std::size_t gemm_input_elems = 0;
  bf16* gemm_inputs_for(std::size_t elems);  // at least `elems`, synchronising to grow
  // The MoE auxiliary loss's partial sums (per-sequence fractions, per-token terms, per-sequence
  // losses and the total), grown and kept the same way.
  double* moe_sums = nullptr;
  std::size_t moe_sum_elems = 0;
  double* moe_sums_for(std::size_t elems);
  // Column sums of row chunks (RMSNorm's weight gradient, ops_rows.cu), grown and kept the same
  // way.
  float* row_chunk_sums = nullptr;
  std::size_t row_chunk_sum_elems = 0;
  float* row_chunk_sums_for(std::size_t elems);
  // sum_of_squares_each's per-range results, grown and kept the same way.
  double* range_sums = nullptr;
  std::size_t range_sum_elems = 0;
  double* range_sums_for(std::size_t elems);
  // The embedding backward's sort (ops_rows.cu): bytes, grown and kept the same way.
  unsigned char* sort_scratch = nullptr;
  std::size_t sort_scratch_bytes = 0;
  unsigned char* sort_scratch_for(std::size_t bytes);
  // LinearInput's rounded copies (take_rounded_buffer): buffers grown to their largest use and
  // kept, each taken or free.
  struct RoundedBuffer {
    bf16* data = nullptr;
    std::size_t elems = 0;
    bool taken = false;
  };
  std::vector<RoundedBuffer> rounded_buffers;
};

// Grid-stride launches over n elements: a fixed block size and a grid capped so that a launch
// shape depends on n only.
inline constexpr int kBlock = 256;
inline unsigned grid_for(std::int64_t n) {
  const std::int64_t blocks = (n + kBlock - 1) / kBlock;
  return static_cast<unsigned>(blocks < 65535 * 8 ? (blocks > 0 ? blocks : 1) : 65535 * 8);
}

}  // namespace t3d::kernels::cuda
