// Published figures of the data-centre GPUs titan3d plans for and measures MFU against (NVIDIA's
// datasheets; dense, i.e. without 2:4 sparsity): the tensor-core bf16 peak with fp32 sums, the
// fp32 peak without TF32 (the CUDA cores: what train.precision = fp32 runs at), HBM per GPU and
// its bandwidth. A GPU missing here has no MFU (said where it would be), and a cluster file gives
// its figures by hand (docs/planner.md).
#pragma once

#include <string>
#include <string_view>
#include <vector>

namespace t3d::kernels {

struct GpuSpec {
  std::string_view key;    // what a cluster file's device.gpu names: "h100-sxm"
  std::string_view label;  // "NVIDIA H100 SXM 80 GB"
  double bf16_tflops = 0;  // dense tensor-core bf16, fp32 accumulation
  double fp32_tflops = 0;  // fp32 FMA on the CUDA cores, TF32 off
  double hbm_gib = 0;
  double hbm_tbps = 0;  // TB/s
};

const std::vector<GpuSpec>& gpu_specs();
// By cluster-file key; null when unknown.
const GpuSpec* gpu_spec_by_key(std::string_view key);
// "h100-sxm, h100-pcie, ...": the keys, for an error message.
std::string gpu_spec_keys();
// The spec of a GPU as the CUDA runtime names it ("NVIDIA H100 80GB HBM3", "NVIDIA A100-SXM4-40GB",
// "NVIDIA H200") with its memory in GiB (which tells the A100's 40 and 80 GB apart); null when
// unknown.
const GpuSpec* gpu_spec_of_device(std::string_view name, double total_gib);

}  // namespace t3d::kernels
