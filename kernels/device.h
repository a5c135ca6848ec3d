// The device a rank computes on (the recipe's hardware.device): the host's CPU, or one GPU with
// the stream every op of the rank is enqueued on. It owns that stream, so it must outlive the
// arena, the Model and everything else built on its Exec.
#pragma once

#include <cstddef>
#include <cstdint>
#include <map>
#include <memory>
#include <string>
#include <vector>

#include "kernels/arena.h"
#include "kernels/exec.h"
#include "kernels/gpu_specs.h"

namespace t3d::kernels {

namespace cuda {
class Stream;
}

enum class DeviceChoice { kCpu, kCuda, kAuto };

// Host memory [data, data + bytes) page-locked for the GPU's copies while this lives, where `exec`
// is a GPU's (copy_to_host_started into it then runs at the link's rate instead of through
// CUDA's own staging); nothing on the CPU. The memory must outlive it.
class PinnedHostRegion {
 public:
  PinnedHostRegion(const Exec& exec, void* data, std::size_t bytes);
  ~PinnedHostRegion();
  PinnedHostRegion(const PinnedHostRegion&) = delete;
  PinnedHostRegion& operator=(const PinnedHostRegion&) = delete;

 private:
  void* data_ = nullptr;  // registered; null on the CPU
};

class Device {
 public:
  // kCpu: the host. kCuda: the GPU `local_rank` modulo the GPUs this process sees (ranks may
  // share one); a UserError naming `key` and the reason when there is none or the build has no
  // CUDA backend. kAuto: kCuda where a GPU is visible, else kCpu.
  static std::unique_ptr<Device> open(DeviceChoice choice, int local_rank,
                                      const std::string& key = "hardware.device");
  // What open(choice, local_rank) would compute on, without opening it (no stream, no context
  // kept): "cpu", the GPU's description(), or for kCuda where none is usable "cuda (none: why)"
  // (open then refuses it). For the decisions made before the stage is built (the GEMM choice).
  static std::string describe(DeviceChoice choice, int local_rank);
  // Whether a description (describe's or description()) is of a usable GPU.
  static bool is_gpu(const std::string& description) { return description.rfind("cuda:", 0) == 0; }
  ~Device();
  Device(const Device&) = delete;
  Device& operator=(const Device&) = delete;

  bool on_gpu() const { return stream_ != nullptr; }
  // This device's execution with GEMMs of `kind` (on a GPU: cuBLAS in kind's precision).
  Exec exec(GemmKind kind) const;
  // The memory an arena for this device's ops holds.
  Memory memory() const { return device_memory(exec(GemmKind::kOpenBlasF32)); }
  // "cpu", or the GPU: "cuda:0 NVIDIA H100 80GB HBM3, 79.1 GiB (78.5 free), sm_90, ..."
  const std::string& description() const { return description_; }
  // On a GPU: its datasheet row (null when kernels/gpu_specs.h does not know it) and how many
  // GPUs this process sees (the ranks of a host share them). Null and 0 on the CPU.
  const GpuSpec* spec() const { return spec_; }
  int visible_gpus() const { return visible_gpus_; }

  // A GPU's measured rates (selfcheck): cuBLAS GEMM TFLOP/s of an M x K by K x N linear layer in
  // fp32 and bf16 inputs, and pinned host <-> device copies of `bytes`, the best of `rounds`.
  // A GPU's only (InternalError on the CPU).
  struct Rates {
    double gemm_fp32_tflops = 0, gemm_bf16_tflops = 0, h2d_gbps = 0, d2h_gbps = 0;
  };
  Rates measure_rates(std::int64_t M, std::int64_t N, std::int64_t K, std::size_t bytes,
                      int rounds) const;

  // The algorithms a GPU's GEMMs were given or measured (kernels/cuda/gemm_table.h), as the
  // table's text. Empty on the CPU.
  std::string gemm_table() const;
  // "cuBLASLt 130100 on NVIDIA H200 (sm_90)": the library and GPU a table of this GPU holds for
  // (a table's cache key). Empty on the CPU.
  std::string gemm_library() const;
  // Installs a table's text (a job's measurement, or what a snapshot recorded). Returns why not
  // when it cannot (malformed, or made for another cuBLASLt or GPU): the GPU then keeps its own
  // table, whose shapes run cuBLASLt's first heuristic answer. A GPU's only.
  std::string use_gemm_table(const std::string& text) const;
  // Measures the GEMMs of linear layers of `rows` rows, in → out, in `kind`'s precision
  // (kernels::cuda::tune_gemms: cuBLASLt's heuristic answers timed, the first kept unless
  // another beats it clearly), installs them and returns the table's text. A GPU's only.
  struct LinearSize {
    std::int64_t rows = 0, in = 0, out = 0;
  };
  std::string tune_linear_gemms(const std::vector<LinearSize>& layers, GemmKind kind) const;

  // Times a GPU's ops from now on, or stops (kernels/cuda/op_timer.h; nothing on the CPU), and
  // their GPU seconds by op name since the last call (waits for the GPU; empty on the CPU).
  void set_op_timing(bool on) const;
  std::map<std::string, double> take_op_seconds() const;

 private:
  Device() = default;
  std::unique_ptr<cuda::Stream> stream_;
  std::string description_ = "cpu";
  const GpuSpec* spec_ = nullptr;
  int visible_gpus_ = 0;
};

}  // namespace t3d::kernels
