#include "kernels/gpu_specs.h"

#include <algorithm>
#include <cctype>

namespace t3d::kernels {

const std::vector<GpuSpec>& gpu_specs() {
  // key, label, bf16 dense TFLOP/s, fp32 TFLOP/s, HBM GiB, HBM TB/s.
  static const std::vector<GpuSpec> specs = {
      {"h100-sxm", "NVIDIA H100 SXM 80 GB", 989.4, 66.9, 80, 3.35},
      {"h100-pcie", "NVIDIA H100 PCIe 80 GB", 756.5, 51.2, 80, 2.0},
      {"h100-nvl", "NVIDIA H100 NVL 94 GB", 835.5, 59.8, 94, 3.9},
      {"h200", "NVIDIA H200 SXM 141 GB", 989.4, 66.9, 141, 4.8},
      {"h200-nvl", "NVIDIA H200 NVL 141 GB", 835.5, 60.3, 141, 4.8},
      {"gh200", "NVIDIA GH200 (H100-class GPU) 96 GB", 989.4, 66.9, 96, 4.0},
      {"a100-sxm-80", "NVIDIA A100 SXM 80 GB", 312, 19.5, 80, 2.039},
      {"a100-sxm-40", "NVIDIA A100 SXM 40 GB", 312, 19.5, 40, 1.555},
      {"a100-pcie-80", "NVIDIA A100 PCIe 80 GB", 312, 19.5, 80, 1.935},
      {"a100-pcie-40", "NVIDIA A100 PCIe 40 GB", 312, 19.5, 40, 1.555},
      {"l40s", "NVIDIA L40S 48 GB", 362.05, 91.6, 48, 0.864},
  };
  return specs;
}

const GpuSpec* gpu_spec_by_key(std::string_view key) {
  for (const auto& s : gpu_specs())
    if (s.key == key) return &s;
  return nullptr;
}

std::string gpu_spec_keys() {
  std::string keys;
  for (const auto& s : gpu_specs()) keys += (keys.empty() ? "" : ", ") + std::string(s.key);
  return keys;
}

const GpuSpec* gpu_spec_of_device(std::string_view name, double total_gib) {
  std::string up(name);
  std::transform(up.begin(), up.end(), up.begin(),
                 [](unsigned char c) { return static_cast<char>(std::toupper(c)); });
  const auto has = [&](const char* part) { return up.find(part) != std::string::npos; };
  const bool pcie = has("PCIE"), nvl = has("NVL");
  const char* key = nullptr;
  if (has("GH200"))  // before H200, which its name contains
    key = "gh200";
  else if (has("H200"))
    key = nvl ? "h200-nvl" : "h200";
  else if (has("H100"))
    key = nvl ? "h100-nvl" : pcie ? "h100-pcie" : "h100-sxm";  // "H100 80GB HBM3": the SXM
  else if (has("A100"))
    key = total_gib > 60 ? (pcie ? "a100-pcie-80" : "a100-sxm-80")
                         : (pcie ? "a100-pcie-40" : "a100-sxm-40");
  else if (has("L40S"))
    key = "l40s";
  return key ? gpu_spec_by_key(key) : nullptr;
}

}  // namespace t3d::kernels
