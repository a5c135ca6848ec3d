// kernels/cuda/op_timer.h: the events of the timed ops, kept on their Stream.
#include <atomic>

#include "kernels/cuda/cuda_internal.cuh"
#include "kernels/cuda/op_timer.h"

namespace t3d::kernels::cuda {

namespace {

cudaEvent_t take_event(Stream::Impl& st) {
  if (!st.spare_events.empty()) {
    const cudaEvent_t e = st.spare_events.back();
    st.spare_events.pop_back();
    return e;
  }
  cudaEvent_t e = nullptr;
  T3D_CUDA_CHECK(cudaEventCreate(&e));
  return e;
}

}  // namespace

namespace {
std::atomic<bool> timing{false};
}  // namespace

bool op_timing_enabled() { return timing.load(std::memory_order_relaxed); }

void set_op_timing(bool on) { timing.store(on, std::memory_order_relaxed); }

void OpTimer::start() {
  Stream::Impl& st = stream_->impl();
  const cudaEvent_t e = take_event(st);
  T3D_CUDA_CHECK(cudaEventRecord(e, st.stream));
  slot_ = st.timed_ops.size();
  list_ = st.timed_lists_taken;
  st.timed_ops.push_back({op_, e, nullptr});
}

void OpTimer::stop() noexcept {
  // No throw from a destructor: a failed record leaves the op without a stop (not counted), and
  // a sticky CUDA error surfaces at the stream's next checked call.
  Stream::Impl& st = stream_->impl();
  cudaEvent_t e = nullptr;
  if (!st.spare_events.empty()) {
    e = st.spare_events.back();
    st.spare_events.pop_back();
  } else if (cudaEventCreate(&e) != cudaSuccess) {
    return;
  }
  // A list taken while this op was open (take_op_seconds) no longer has its slot: the slot of
  // that number now belongs to an op started after the take.
  if (list_ != st.timed_lists_taken || cudaEventRecord(e, st.stream) != cudaSuccess) {
    st.spare_events.push_back(e);
    return;
  }
  st.timed_ops[slot_].stop = e;
}

std::map<std::string, double> take_op_seconds(const Stream& s) {
  Stream::Impl& st = s.impl();
  s.synchronize();
  std::map<std::string, double> seconds;
  for (const Stream::Impl::TimedOp& op : st.timed_ops) {
    if (op.stop) {
      float ms = 0;
      T3D_CUDA_CHECK(cudaEventElapsedTime(&ms, op.start, op.stop));
      seconds[op.op] += ms * 1e-3;
      st.spare_events.push_back(op.stop);
    }
    st.spare_events.push_back(op.start);
  }
  st.timed_ops.clear();
  ++st.timed_lists_taken;
  return seconds;
}

}  // namespace t3d::kernels::cuda
