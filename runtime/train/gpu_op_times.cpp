#include "runtime/train/gpu_op_times.h"

#include <fmt/format.h>
#include <spdlog/spdlog.h>

#include <algorithm>
#include <chrono>
#include <cstdlib>
#include <utility>

namespace t3d::runtime {

namespace {

bool starts_with(const std::string& s, const char* prefix) { return s.rfind(prefix, 0) == 0; }

// (name, seconds) largest first, ties by name.
std::vector<std::pair<std::string, double>> largest_first(const std::map<std::string, double>& m) {
  std::vector<std::pair<std::string, double>> v(m.begin(), m.end());
  std::stable_sort(v.begin(), v.end(),
                   [](const auto& a, const auto& b) { return a.second > b.second; });
  return v;
}

}  // namespace

std::string gpu_op_kind(const std::string& op) {
  if (starts_with(op, "linear_") || starts_with(op, "moe_experts_") || op == "swiglu_mlp_forward")
    return "GEMM";
  if (starts_with(op, "attention_")) return "attention";
  if (starts_with(op, "cross_entropy") || starts_with(op, "ce_")) return "loss";
  if (starts_with(op, "adamw") || starts_with(op, "sum_of_squares") || op == "count_nonfinite" ||
      starts_with(op, "clip") || starts_with(op, "scale"))
    return "optimizer";
  if (starts_with(op, "moe_")) return "MoE routing";
  if (starts_with(op, "copy_to_host") || op == "copy_from_host" || op == "wait_for_copies")
    return "host crossings";
  return "element-wise";
}

std::string gpu_op_breakdown(const std::map<std::string, double>& op_seconds, int64_t steps,
                             double step_seconds, int top) {
  if (steps <= 0) return {};
  const double per_step = step_seconds / static_cast<double>(steps);
  std::map<std::string, double> kinds;
  double covered = 0;
  for (const auto& [op, s] : op_seconds) {
    kinds[gpu_op_kind(op)] += s / static_cast<double>(steps);
    covered += s / static_cast<double>(steps);
  }
  const auto share = [&](double s) { return per_step > 0 ? 100 * s / per_step : 0.0; };
  std::string line =
      fmt::format("GPU time per step by kind over {} steps of {:.2f} ms:", steps, 1e3 * per_step);
  for (const auto& [kind, s] : largest_first(kinds))
    line += fmt::format(" {} {:.2f} ms ({:.1f}%),", kind, 1e3 * s, share(s));
  const double rest = std::max(0.0, per_step - covered);
  line += fmt::format(" in no GPU op (communication, host, idle) {:.2f} ms ({:.1f}%); largest ops:",
                      1e3 * rest, share(rest));
  int shown = 0;
  for (const auto& [op, s] : largest_first(op_seconds)) {
    if (shown++ == top) break;
    line += fmt::format(" {} {:.2f} ms", op, 1e3 * s / static_cast<double>(steps));
  }
  return line;
}

GpuOpTimes::GpuOpTimes(const kernels::Device& device, int64_t first_step, int64_t last_step)
    : device_(device), last_step_(last_step) {
  const char* v = std::getenv("T3D_GPU_OP_TIMES");
  const int64_t wanted = device.on_gpu() && v ? std::max<int64_t>(0, std::atoll(v)) : 0;
  first_timed_ = wanted > 0 ? std::max(first_step + 2, last_step - wanted + 1) : last_step + 1;
  time_step(first_step + 1);
}

void GpuOpTimes::time_step(int64_t step) {
  timing_ = step >= first_timed_ && step <= last_step_;
  device_.set_op_timing(timing_);
}

void GpuOpTimes::after_step(int64_t step, double step_seconds) {
  if (timing_) {
    // Waiting here for the step's last GPU work (the optimizer's, enqueued after the step's last
    // host wait) counts in its time: without timing the next step would wait for it.
    const auto t0 = std::chrono::steady_clock::now();
    const std::map<std::string, double> s = device_.take_op_seconds();
    const std::chrono::duration<double> waited = std::chrono::steady_clock::now() - t0;
    for (const auto& [op, seconds] : s) seconds_[op] += seconds;
    ++steps_;
    step_seconds_ += step_seconds + waited.count();
  }
  time_step(step + 1);
}

void GpuOpTimes::report() const {
  if (steps_ > 0)
    spdlog::info("{} (T3D_GPU_OP_TIMES)", gpu_op_breakdown(seconds_, steps_, step_seconds_));
}

}  // namespace t3d::runtime
