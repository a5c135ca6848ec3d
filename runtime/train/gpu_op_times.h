// The step-time breakdown of a GPU rank, for finding where a step's time goes (bench/gpu): with
// T3D_GPU_OP_TIMES=K in the environment the last K steps of a run (never its first: cuBLASLt's
// plans and the kernels' first loads) have every op the rank's GPU runs timed on the GPU
// (kernels/cuda/op_timer.h); this sums those times by op and by kind (GEMMs, attention, ...) and
// logs the per-step means at the end against the timed steps' wall time: what no timed op covers
// is communication, host work and the GPU waiting for either. Only the last K steps, so that a
// benchmark's median step over more steps is an untimed one (timing costs each op two event
// records on the host).
#pragma once

#include <cstdint>
#include <map>
#include <string>
#include <vector>

#include "kernels/device.h"

namespace t3d::runtime {

// The kind of a kernels op by its name (a kernels:: function, as T3D_ON_GPU names it): "GEMM",
// "attention", "loss", "optimizer", "MoE routing", "host crossings", or "element-wise" for the
// rest (norms, RoPE, SwiGLU, embedding, casts, copies in device memory).
std::string gpu_op_kind(const std::string& op);

// The log line of a breakdown: per-step means by kind, largest first, each with its share of the
// mean step time, then what no op covered, then the `top` largest ops.
std::string gpu_op_breakdown(const std::map<std::string, double>& op_seconds, int64_t steps,
                             double step_seconds, int top = 8);

class GpuOpTimes {
 public:
  // For a run of steps first_step + 1 .. last_step; times nothing unless `device` is a GPU and
  // T3D_GPU_OP_TIMES is a positive count.
  GpuOpTimes(const kernels::Device& device, int64_t first_step, int64_t last_step);
  // After each step (waits for the GPU when the step was timed); switches timing on for the
  // next step when it is one of the last K.
  void after_step(int64_t step, double step_seconds);
  // The rank's log line (nothing when it timed nothing).
  void report() const;

 private:
  void time_step(int64_t step);  // switches timing for `step`
  const kernels::Device& device_;
  int64_t first_timed_ = 0, last_step_ = 0;  // none timed when first_timed_ > last_step_
  bool timing_ = false;
  std::map<std::string, double> seconds_;  // by op, over the counted steps
  int64_t steps_ = 0;
  double step_seconds_ = 0;
};

}  // namespace t3d::runtime
