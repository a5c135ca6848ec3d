// hardware.device's choice (kernels/device.h) on the machine the test runs on: the CPU always,
// auto falling back to the CPU, and cuda refused naming the key where no GPU is visible.
#include <gtest/gtest.h>

#include <string>

#include "kernels/check.h"
#include "kernels/device.h"
#include "kernels/gpu_specs.h"

namespace t3d::kernels {
namespace {

TEST(Device, TheCpuIsTheHostWithItsGemmKind) {
  const auto d = Device::open(DeviceChoice::kCpu, 3);
  EXPECT_FALSE(d->on_gpu());
  EXPECT_EQ(d->description(), "cpu");
  EXPECT_EQ(d->memory(), Memory::kHost);
  const Exec e = d->exec(GemmKind::kOneDnnBf16);
  EXPECT_FALSE(e.on_gpu());
  EXPECT_EQ(e.gemm, GemmKind::kOneDnnBf16);
}

TEST(Device, AutoIsAGpuWhereOneIsVisibleElseTheCpu) {
  const auto d = Device::open(DeviceChoice::kAuto, 0);
  if (d->on_gpu()) {
    EXPECT_EQ(d->memory(), Memory::kDevice);
    EXPECT_EQ(d->description().rfind("cuda:", 0), 0u) << d->description();
    EXPECT_TRUE(d->exec(GemmKind::kOpenBlasF32).on_gpu());
  } else {
    EXPECT_EQ(d->description(), "cpu");
    EXPECT_EQ(d->memory(), Memory::kHost);
  }
}

// describe() says what open() would compute on, without opening it: the same description.
TEST(Device, DescribeSaysWhatOpenWouldGive) {
  EXPECT_EQ(Device::describe(DeviceChoice::kCpu, 5), "cpu");
  EXPECT_EQ(Device::describe(DeviceChoice::kAuto, 1),
            Device::open(DeviceChoice::kAuto, 1)->description());
  const std::string cuda = Device::describe(DeviceChoice::kCuda, 0);
  const bool gpu = Device::open(DeviceChoice::kAuto, 0)->on_gpu();
  EXPECT_EQ(Device::is_gpu(cuda), gpu) << cuda;
  EXPECT_FALSE(Device::is_gpu("cpu"));
  if (!gpu) {
    EXPECT_EQ(cuda.rfind("cuda (none: ", 0), 0u) << cuda;  // the reason, as open's
  }
}

TEST(Device, CudaWithoutAGpuIsRefusedNamingTheKey) {
  if (Device::open(DeviceChoice::kAuto, 0)->on_gpu()) GTEST_SKIP() << "this machine has a GPU";
  try {
    Device::open(DeviceChoice::kCuda, 0, "hardware.device");
    FAIL() << "cuda opened without a GPU";
  } catch (const UserError& e) {
    EXPECT_NE(std::string(e.what()).find("hardware.device = \"cuda\", but this"), std::string::npos)
        << e.what();
  }
}

}  // namespace
}  // namespace t3d::kernels

namespace t3d::kernels {
namespace {

// The names the CUDA runtime gives (as nvidia-smi shows them) find their datasheet rows; the
// figures are the datasheets' dense ones.
TEST(GpuSpecs, DeviceNamesFindTheirDatasheet) {
  struct Named {
    const char* name;  // as the CUDA runtime gives it
    double gib;        // its memory
    const char* key;   // "none": not in the table
  };
  for (const Named& g :
       {Named{"NVIDIA H100 80GB HBM3", 79.1, "h100-sxm"},
        Named{"NVIDIA H100 PCIe", 79.6, "h100-pcie"}, Named{"NVIDIA H100 NVL", 93.1, "h100-nvl"},
        Named{"NVIDIA H200", 139.8, "h200"}, Named{"NVIDIA H200 NVL", 139.8, "h200-nvl"},
        Named{"NVIDIA GH200 480GB", 94.5, "gh200"},
        Named{"NVIDIA A100-SXM4-80GB", 79.2, "a100-sxm-80"},
        Named{"NVIDIA A100-SXM4-40GB", 39.4, "a100-sxm-40"},
        Named{"NVIDIA A100 80GB PCIe", 79.2, "a100-pcie-80"},
        Named{"NVIDIA A100-PCIE-40GB", 39.4, "a100-pcie-40"}, Named{"NVIDIA L40S", 44.4, "l40s"},
        Named{"NVIDIA GeForce RTX 4090", 23.6, "none"}}) {
    const GpuSpec* s = gpu_spec_of_device(g.name, g.gib);
    EXPECT_EQ(s ? std::string(s->key) : std::string("none"), g.key) << g.name;
  }
  const GpuSpec* h100 = gpu_spec_by_key("h100-sxm");
  ASSERT_NE(h100, nullptr);
  EXPECT_DOUBLE_EQ(h100->bf16_tflops, 989.4);
  EXPECT_DOUBLE_EQ(h100->hbm_gib, 80);
  EXPECT_EQ(gpu_spec_by_key("h100"), nullptr);
  EXPECT_NE(gpu_spec_keys().find("h200, h200-nvl"), std::string::npos) << gpu_spec_keys();
}

}  // namespace
}  // namespace t3d::kernels
