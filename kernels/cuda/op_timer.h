// GPU time per op, for the step-time breakdown of a GPU run (runtime/train/gpu_op_times.h): while
// timing is on (set_op_timing), every op an Exec dispatches to its CUDA twin (T3D_ON_GPU,
// kernels/exec.h) and every host crossing is bracketed by two CUDA events on its stream, and
// take_op_seconds sums their elapsed times by op name. Off (the default) it costs one test of a
// flag per op. On, each op costs two event records on the host (a few microseconds), and where
// the host falls behind the GPU the gap before an op's launch counts in that op's time. Host code:
// no CUDA type here.
#pragma once

#include <map>
#include <string>

namespace t3d::kernels::cuda {

class Stream;

// The process's switch (off at the start).
bool op_timing_enabled();
void set_op_timing(bool on);

// Times the ops enqueued on `s` while it lives (nothing when timing is off), under `op`, a
// string that outlives the stream's next take_op_seconds (__func__).
class OpTimer {
 public:
  OpTimer(const Stream& s, const char* op) : stream_(op_timing_enabled() ? &s : nullptr), op_(op) {
    if (stream_) start();
  }
  ~OpTimer() {
    if (stream_) stop();
  }
  OpTimer(const OpTimer&) = delete;
  OpTimer& operator=(const OpTimer&) = delete;

 private:
  void start();
  void stop() noexcept;
  const Stream* stream_;
  const char* op_;
  unsigned long slot_ = 0;  // its place in the stream's timed ops
  unsigned long list_ = 0;  // the stream's timed_lists_taken at its start
};

// Waits for `s`, then returns the GPU seconds of the ops timed on it since the last call, summed
// by op name, and forgets them.
std::map<std::string, double> take_op_seconds(const Stream& s);

}  // namespace t3d::kernels::cuda
