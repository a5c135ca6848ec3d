// Guarded device memory (kernels/memory_guard.h), the CPU's stand-in for a GPU's memory: outside
// an op no code may touch it (the process ends naming the byte), an op's CPU path opens it, opens
// nest, and the guard ends with its arena. The death tests re-run their test in a fresh process
// ("threadsafe"): the rank's OpenMP threads make a bare fork unsafe.
#include <gtest/gtest.h>

#include <atomic>
#include <chrono>
#include <cmath>
#include <cstdlib>
#include <thread>
#include <vector>

#include "kernels/arena.h"
#include "kernels/memory_guard.h"
#include "kernels/ops.h"

namespace t3d::kernels {
namespace {

constexpr const char* kNamed = "device memory touched outside an op";

TEST(kernels_memory_guard, ATouchOutsideAnOpEndsTheProcessNamingTheByte) {
  GTEST_FLAG_SET(death_test_style, "threadsafe");
  Arena arena(1 << 20, Memory::kGuardedHost);
  volatile float* x = arena.alloc_floats("x", 1024);
  EXPECT_DEATH(x[5] = 1.0f, "device memory touched outside an op.*byte 20 of the device memory at");
  EXPECT_DEATH((void)x[1000], kNamed);
}

TEST(kernels_memory_guard, OpsOpenItNestedOpensCountAndItClosesAfter) {
  GTEST_FLAG_SET(death_test_style, "threadsafe");
  Arena arena(1 << 20, Memory::kGuardedHost);
  float* x = arena.alloc_floats("x", 256);
  float* y = arena.alloc_floats("y", 256);
  std::vector<float> host(256), back(256);
  for (int i = 0; i < 256; ++i) host[i] = static_cast<float>(i) - 7.5f;
  copy_from_host(kCpu, x, host.data(), sizeof(float) * host.size());  // ops: open while they run
  add(kCpu, y, x, x, 256);
  copy_to_host(kCpu, back.data(), y, sizeof(float) * back.size());
  for (int i = 0; i < 256; ++i) EXPECT_EQ(back[i], 2 * host[i]) << i;
  {
    const GuardedMemoryOpen outer;
    {
      const GuardedMemoryOpen inner;  // an op inside an op
    }
    EXPECT_EQ(x[3], host[3]);  // still open: the outer op runs
  }
  volatile float* closed = x;
  EXPECT_DEATH((void)closed[3], kNamed);
}

TEST(kernels_memory_guard, TheGuardEndsWithItsArena) {
  const int before = guarded_memories.load();
  {
    Arena arena(1 << 16, Memory::kGuardedHost);
    EXPECT_EQ(guarded_memories.load(), before + 1);
  }
  EXPECT_EQ(guarded_memories.load(), before);
  Arena plain(1 << 16, Memory::kHost);  // host staging and the CPU's arena are never guarded
  EXPECT_EQ(guarded_memories.load(), before);
  float* p = plain.alloc_floats("p", 4);
  p[0] = 1.0f;
  EXPECT_EQ(p[0], 1.0f);
}

// With device memory guarded, a started copy is made as late as a GPU's copy stream may: at its
// thread's next compute_after_copies or wait_for_copies, which another thread's wait_for_copies
// (a snapshot's I/O thread) waits for. Its host bytes are NaN until then, and an op that
// overwrites the source before compute_after_copies shows in the copy, as it may on a GPU.
TEST(kernels_memory_guard, AStartedCopyIsMadeAtItsThreadsNextComputeAfterCopies) {
  Arena arena(1 << 20, Memory::kGuardedHost);
  constexpr int kN = 64;
  float* x = arena.alloc_floats("x", kN);
  std::vector<float> ones(kN, 1.0f), copied(kN, 0.0f);
  copy_from_host(kCpu, x, ones.data(), sizeof(float) * kN);
  copy_to_host_started(kCpu, copied.data(), x, sizeof(float) * kN);
  EXPECT_TRUE(std::isnan(copied[0])) << "the host bytes before the copy is waited for";
  std::atomic<bool> waited{false};
  std::thread io([&] {
    wait_for_copies(kCpu);
    waited = true;
  });
  std::this_thread::sleep_for(std::chrono::milliseconds(200));
  EXPECT_FALSE(waited.load()) << "the other thread's wait made the copy before its thread asked";
  add(kCpu, x, x, x, kN);  // overwrites the copied source without compute_after_copies first
  compute_after_copies(kCpu);
  io.join();
  EXPECT_TRUE(waited.load());
  for (int i = 0; i < kN; ++i) EXPECT_EQ(copied[i], 2.0f) << i;
  // Started and waited for on one thread: made at the wait.
  copy_to_host_started(kCpu, copied.data(), x, sizeof(float) * kN);
  wait_for_copies(kCpu);
  EXPECT_EQ(copied[kN - 1], 2.0f);
}

TEST(kernels_memory_guard, TheCpusDeviceMemoryIsGuardedOnlyWhereAsked) {
  const bool asked = memory_guard_asked();
  EXPECT_EQ(device_memory(kCpu), asked ? Memory::kGuardedHost : Memory::kHost);
  EXPECT_EQ(host_shares_device_memory(kCpu), !asked);
}

}  // namespace
}  // namespace t3d::kernels
