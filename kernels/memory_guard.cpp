#include "kernels/memory_guard.h"

#include <execinfo.h>
#include <signal.h>
#include <sys/mman.h>
#include <unistd.h>

#include <array>
#include <atomic>
#include <cerrno>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <mutex>
#include <string>

#include "kernels/check.h"

namespace t3d::kernels {
namespace {

// A fixed table, read by the signal handler without a lock: a range is published (its bytes set)
// after its base, and a removed one has its bytes cleared first.
struct Guarded {
  std::atomic<std::uintptr_t> base{0};
  std::atomic<std::size_t> bytes{0};
};
constexpr int kMaxGuarded = 1024;  // the arenas, and a Buffer each (the executor's hand-overs)
std::array<Guarded, kMaxGuarded> guarded;
std::mutex guard_mutex;  // the table's writers, and the open count with the protection it implies
int open_count = 0;

void protect_all(int prot) {
  for (const Guarded& g : guarded) {
    const std::size_t bytes = g.bytes.load();
    if (bytes == 0) continue;
    T3D_ASSERT(mprotect(reinterpret_cast<void*>(g.base.load()), bytes, prot) == 0,
               "mprotect of guarded device memory failed: ", std::strerror(errno));
  }
}

void write_text(const char* text) {
  const ssize_t ignored = write(STDERR_FILENO, text, std::strlen(text));
  (void)ignored;
}

// SIGSEGV: a touch of guarded memory names it and its backtrace and aborts; any other fault is
// re-raised with the default action (the crash it would have been).
void on_fault(int sig, siginfo_t* info, void*) {
  const auto at = reinterpret_cast<std::uintptr_t>(info->si_addr);
  for (const Guarded& g : guarded) {
    const std::uintptr_t base = g.base.load();
    const std::size_t bytes = g.bytes.load();
    if (bytes == 0 || at < base || at >= base + bytes) continue;
    char line[512];
    std::snprintf(line, sizeof line,
                  "\ntitan3d: device memory touched outside an op (T3D_GUARD_DEVICE_MEMORY=1): "
                  "address %#lx, byte %lu of the device memory at %#lx (%lu bytes). On a GPU "
                  "this would read or write the GPU's memory from the host. Backtrace "
                  "(addr2line -f -C -e titan3d OFFSET):\n",
                  static_cast<unsigned long>(at), static_cast<unsigned long>(at - base),
                  static_cast<unsigned long>(base), static_cast<unsigned long>(bytes));
    write_text(line);
    void* frames[64];
    backtrace_symbols_fd(frames, backtrace(frames, 64), STDERR_FILENO);
    signal(SIGABRT, SIG_DFL);
    abort();
  }
  signal(sig, SIG_DFL);  // returning re-runs the faulting access, which now takes the default
}

void install_handler() {
  static std::once_flag once;
  std::call_once(once, [] {
    void* warm[1];
    backtrace(warm, 1);  // loads libgcc's unwinder now, not inside the handler
    struct sigaction sa {};
    sa.sa_sigaction = on_fault;
    sa.sa_flags = SA_SIGINFO;
    sigemptyset(&sa.sa_mask);
    T3D_ASSERT(sigaction(SIGSEGV, &sa, nullptr) == 0, "cannot install the memory guard's handler");
  });
}

}  // namespace

bool memory_guard_asked() {
  const char* v = std::getenv("T3D_GUARD_DEVICE_MEMORY");
  return v && std::string(v) == "1";
}

void guard_memory(void* base, std::size_t bytes) {
  if (bytes == 0) return;
  install_handler();
  const std::lock_guard<std::mutex> lock(guard_mutex);
  for (Guarded& g : guarded) {
    if (g.bytes.load() != 0) continue;
    g.base.store(reinterpret_cast<std::uintptr_t>(base));
    g.bytes.store(bytes);
    guarded_memories.fetch_add(1);
    if (open_count == 0)
      T3D_ASSERT(mprotect(base, bytes, PROT_NONE) == 0,
                 "mprotect of guarded device memory failed: ", std::strerror(errno));
    return;
  }
  T3D_ASSERT(false, "more than ", kMaxGuarded, " guarded device memories at once");
}

void unguard_memory(void* base) {
  const std::lock_guard<std::mutex> lock(guard_mutex);
  for (Guarded& g : guarded) {
    if (g.bytes.load() == 0 || g.base.load() != reinterpret_cast<std::uintptr_t>(base)) continue;
    const std::size_t bytes = g.bytes.exchange(0);
    guarded_memories.fetch_sub(1);
    T3D_ASSERT(mprotect(base, bytes, PROT_READ | PROT_WRITE) == 0,
               "mprotect of guarded device memory failed: ", std::strerror(errno));
    return;
  }
}

void GuardedMemoryOpen::open() {
  const std::lock_guard<std::mutex> lock(guard_mutex);
  if (open_count++ == 0) protect_all(PROT_READ | PROT_WRITE);
}

void GuardedMemoryOpen::close() {
  const std::lock_guard<std::mutex> lock(guard_mutex);
  if (--open_count == 0) protect_all(PROT_NONE);
}

}  // namespace t3d::kernels
