// What the GPU kernel tests compare with: device copies of host vectors (Dev), bit-for-bit and
// tolerance comparisons of a GPU op's output with its CPU twin's. For the test binaries that hold
// GPU tests (tests/kernels/test_cuda_*.cpp).
#pragma once

#include <gtest/gtest.h>

#include <cmath>
#include <cstring>
#include <type_traits>
#include <vector>

#include "kernels/cuda/cuda_ops.h"
#include "tests/kernels/reference.h"
#include "tests/kernels/the_gpu.h"

namespace t3d::kernels::cuda::testing {

// The test binary's stream (REQUIRE_GPU first).
inline const Stream& S() { return *the_gpu().stream; }

// A device copy of a host vector, read back with host().
template <class T>
struct Dev {
  DeviceMemory mem;
  std::size_t n = 0;
  explicit Dev(const std::vector<T>& h) : mem(h.size() * sizeof(T), "test"), n(h.size()) {
    copy_to_device(S(), mem.data(), h.data(), n * sizeof(T));
  }
  explicit Dev(std::size_t count) : Dev(std::vector<T>(count)) {}
  T* p() const { return mem.as<T>(); }
  std::vector<T> host() const {
    std::vector<T> h(n);
    copy_to_host(S(), h.data(), mem.data(), n * sizeof(T));
    S().synchronize();
    return h;
  }
};

// Bit for bit, except that any NaN equals any NaN: a GPU's arithmetic returns its canonical NaN
// where the CPU passes an operand's payload on (the bf16 casts, integer code, keep payloads).
template <class T>
bool same_bits(const T& a, const T& b) {
  if constexpr (std::is_floating_point_v<T>)
    if (std::isnan(a) && std::isnan(b)) return true;
  return std::memcmp(&a, &b, sizeof(T)) == 0;
}

template <class T>
void expect_same_bits(const std::vector<T>& gpu_out, const std::vector<T>& cpu_out,
                      const char* what) {
  ASSERT_EQ(gpu_out.size(), cpu_out.size()) << what;
  int bad = 0;
  for (std::size_t i = 0; i < gpu_out.size(); ++i) {
    if (!same_bits(gpu_out[i], cpu_out[i])) {
      ADD_FAILURE() << what << "[" << i << "]: GPU " << +gpu_out[i] << ", CPU " << +cpu_out[i];
      if (++bad == 5) return;
    }
  }
}

inline void expect_close(const std::vector<float>& gpu_out, const std::vector<float>& cpu_out,
                         double rtol, double atol, const char* what) {
  ref::expect_close(gpu_out, ref::to_double(cpu_out), rtol, atol, what);
}

}  // namespace t3d::kernels::cuda::testing
