// Guarded device memory: a test mode of the CPU backend that stands in for a GPU's memory
// (T3D_GUARD_DEVICE_MEMORY=1 in a rank's environment). On a GPU, code outside the ops cannot read
// or write what the ops compute on: a host loop over the arena, an arena pointer handed to MPI, to
// a file or to a CPU-only helper crashes there (or reads garbage). On the CPU that code works, so
// without a GPU nothing would find it. In this mode the device's memory (Memory::kGuardedHost:
// the rank's arena, its Buffers, the decoder's arena; kernels/arena.h) is host memory mprotect'd
// PROT_NONE while no op runs; an op's CPU path opens it (T3D_ON_GPU, kernels/exec.h; the copies
// between host and device are ops too) and closes it when it returns. A touch outside an op ends
// the process with SIGSEGV's handler naming the address, its memory and a backtrace (addresses
// for addr2line -f -C -e titan3d). Tensor collectives are staged through host memory in this
// mode, as a GPU's are (runtime/stage/stage.h).
// Opens count process-wide (a snapshot's copy thread may open it while the main thread
// computes): a stray touch while another thread is in an op is missed, never a false alarm. Any
// guarded memory (a test may guard an Arena of its own without the variable) makes the ops open
// and defers the copies started to the host as a GPU's copy stream may (kernels/ops.h).
// Slow (two mprotect calls an op): for tests only.
#pragma once

#include <atomic>
#include <cstddef>

namespace t3d::kernels {

bool memory_guard_asked();  // T3D_GUARD_DEVICE_MEMORY=1 in the environment

// Whether this process guards its device memory, read once.
inline bool memory_guard_on() {
  static const bool on = memory_guard_asked();
  return on;
}

// Guards [base, base + bytes) (page-aligned, e.g. from mmap) until unguard_memory: closed unless
// an op is open. Installs the SIGSEGV handler on first use.
void guard_memory(void* base, std::size_t bytes);
void unguard_memory(void* base);

// How many memories are guarded now (0 unless memory_guard_on(), or a test guards its own).
inline std::atomic<int> guarded_memories{0};

// Opens the guarded memory for its lifetime (an op's CPU path): nested and concurrent opens
// count; the last to end closes it. Costs one load and branch where nothing is guarded.
class GuardedMemoryOpen {
 public:
  GuardedMemoryOpen() : opened_(guarded_memories.load(std::memory_order_relaxed) > 0) {
    if (opened_) open();
  }
  ~GuardedMemoryOpen() {
    if (opened_) close();
  }
  GuardedMemoryOpen(const GuardedMemoryOpen&) = delete;
  GuardedMemoryOpen& operator=(const GuardedMemoryOpen&) = delete;

 private:
  static void open();
  static void close();
  bool opened_;
};

}  // namespace t3d::kernels
