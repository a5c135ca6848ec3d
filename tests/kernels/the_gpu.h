// The one GPU a test binary's GPU tests run on, or the reason there is none (each such test skips
// with it: REQUIRE_GPU()).
#pragma once

#include <gtest/gtest.h>

#include <memory>
#include <string>
#include <vector>

#include "kernels/cuda/cuda_ops.h"

namespace t3d::kernels::cuda::testing {

struct Gpu {
  std::vector<DeviceInfo> devices;
  std::string why;
  std::unique_ptr<Stream> stream;
  Gpu() {
    devices = visible_devices(&why);
    if (!devices.empty()) stream = std::make_unique<Stream>(0);
  }
};

inline Gpu& the_gpu() {
  static Gpu g;
  return g;
}

}  // namespace t3d::kernels::cuda::testing

#define REQUIRE_GPU()                                                             \
  do {                                                                            \
    if (::t3d::kernels::cuda::testing::the_gpu().devices.empty())                 \
      GTEST_SKIP() << "no GPU: " << ::t3d::kernels::cuda::testing::the_gpu().why; \
  } while (0)
