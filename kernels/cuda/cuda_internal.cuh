// Internal to kernels/cuda/: error checks, the Stream's state, launch shapes.
#pragma once

#include <cublasLt.h>
#include <cuda_runtime.h>

#include <cstdint>
#include <deque>
#include <map>
#include <memory>
#include <mutex>
#include <utility>
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

// `bytes` of device memory made in `stream`'s order (cudaMallocAsync), not zeroed: for work
// enqueued on `stream` after it, or on streams ordered after that. UserError naming `what` when
// the GPU lacks them.
void* stream_alloc(cudaStream_t stream, std::size_t bytes, std::string_view what);

// A device buffer a stream keeps for one use (library memory outside the arena, as the CPU's
// per-thread buffers are): at least `elems` on each request, reallocated only to grow, in the
// stream's order (stream_alloc), so that growing synchronises neither the host nor the device.
// Not zeroed: each use writes what it reads. Only work on that stream reads it.
template <class T>
class StreamBuffer {
 public:
  StreamBuffer() = default;
  StreamBuffer(const StreamBuffer&) = delete;
  StreamBuffer& operator=(const StreamBuffer&) = delete;
  ~StreamBuffer() { cudaFree(data_); }  // its Stream has synchronised its streams before
  T* at_least(cudaStream_t stream, std::size_t elems) {
    if (elems > elems_) {
      T* old = std::exchange(data_, nullptr);  // freed after the stream's work that reads it
      elems_ = 0;
      if (old) T3D_CUDA_CHECK(cudaFreeAsync(old, stream));
      data_ = static_cast<T*>(stream_alloc(stream, elems * sizeof(T), "a stream's work buffer"));
      elems_ = elems;
    }
    return data_;
  }

 private:
  T* data_ = nullptr;
  std::size_t elems_ = 0;
};

struct Stream::Impl {
  int device = 0;
  std::size_t smem_per_block = 0;  // the shared memory a block may opt in to (sm_90: 227 KiB)
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
  // The heuristic's first answer per row bucket's shape (ops_linear.cu untabled_algorithm);
  // unbounded but small: a bucket per quarter power of two of rows, per weight shape.
  std::map<GemmShape, GemmAlgorithm> bucket_algorithms;
  // kernels/cuda/op_timer.h: the events of the ops timed since the last take_op_seconds, in
  // order (stop null: not recorded), the events free for reuse, and how many lists were taken
  // (an OpTimer started before a take stops into no later list).
  struct TimedOp {
    const char* op;
    cudaEvent_t start, stop;
  };
  std::vector<TimedOp> timed_ops;
  std::vector<cudaEvent_t> spare_events;
  unsigned long timed_lists_taken = 0;
  // copy_to_device_staged's pinned ring (made with the Stream): kUploadSlots slots of
  // kUnwaitedUploadBytes, each with the event of its last copy; `next` is the slot to take.
  struct UploadRing {
    unsigned char* pinned = nullptr;
    cudaEvent_t copied[kUploadSlots] = {};
    int next = 0;
    std::mutex taking;
  };
  UploadRing uploads;
  // The step scalars read back to the host: a sum, a count.
  double* scalar_sum = nullptr;
  unsigned long long* scalar_count = nullptr;
  StreamBuffer<double> partial_sums;         // sum_of_squares: kSumBlocks a range of one launch
  StreamBuffer<double> range_sums;           // sum_of_squares_each's per-range results
  StreamBuffer<bf16> gemm_inputs;            // bf16 copies of GEMM inputs not given rounded
  StreamBuffer<double> moe_sums;             // the MoE auxiliary loss's partial sums
  StreamBuffer<float> row_chunk_sums;        // RMSNorm's weight gradient: column sums of row chunks
  StreamBuffer<unsigned char> sort_scratch;  // the embedding backward's sort
  // LinearInput's and attention's rounded copies (take_rounded_buffer), each taken or free (a
  // deque: its elements stay where they are as it grows).
  struct RoundedBuffer {
    StreamBuffer<bf16> buffer;
    bool taken = false;
  };
  std::deque<RoundedBuffer> rounded_buffers;
};

// Grid-stride launches over n elements: a fixed block size and a grid capped so that a launch
// shape depends on n only.
inline constexpr int kBlock = 256;
inline unsigned grid_for(std::int64_t n) {
  const std::int64_t blocks = (n + kBlock - 1) / kBlock;
  return static_cast<unsigned>(blocks < 65535 * 8 ? (blocks > 0 ? blocks : 1) : 65535 * 8);
}

}  // namespace t3d::kernels::cuda
