// hardware.device's choice (kernels/device.h) on the machine the test runs on: the CPU always,
// auto falling back to the CPU, and cuda refused naming the key where no GPU is visible.
#include <gtest/gtest.h>

#include <string>

#include "kernels/check.h"
#include "kernels/device.h"

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
