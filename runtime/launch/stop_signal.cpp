#include "runtime/launch/stop_signal.h"

#include <unistd.h>

#include <atomic>
#include <cstdint>
#include <cstdio>
#include <ctime>

namespace t3d::runtime {

namespace {

volatile std::sig_atomic_t g_stop = 0;
std::atomic<std::int64_t> g_first_stop_s{0};  // CLOCK_MONOTONIC seconds of the first stop signal
static_assert(std::atomic<std::int64_t>::is_always_lock_free, "read in a signal handler");

bool is_interrupt(int sig) { return sig == SIGINT || sig == kInterruptSignal; }

void on_stop(int sig) {
  timespec now{};
  clock_gettime(CLOCK_MONOTONIC, &now);  // async-signal-safe
  if (g_stop == 0) {
    g_first_stop_s = now.tv_sec;
    g_stop = sig;
    return;
  }
  if (now.tv_sec - g_first_stop_s >= kStopEchoSeconds) _exit(128 + sig);  // a second signal: now
  // The first one, by another route. Ctrl-C reaching the ranks beside a preemption signal (mpirun
  // turns its own SIGINT into SIGTERM) makes the stop an interrupt: the user stopped the run.
  if (is_interrupt(sig)) g_stop = sig;
}

std::string stop_record(const std::string& pid_dir) { return pid_dir + "/stopped"; }

}  // namespace

void install_stop_signals() {
  struct sigaction sa {};
  sa.sa_handler = on_stop;
  sigemptyset(&sa.sa_mask);
  sa.sa_flags = SA_RESTART;
  sigaction(SIGTERM, &sa, nullptr);
  sigaction(SIGUSR1, &sa, nullptr);
  sigaction(kInterruptSignal, &sa, nullptr);
  sigaction(SIGINT, &sa, nullptr);
}

int stop_requested() { return static_cast<int>(g_stop); }

bool stop_is_interrupt() { return is_interrupt(g_stop); }

void record_stop(const std::string& pid_dir, int exit_code) {
  // Best effort, as the pid files beside it: without it the launcher goes by mpirun's code.
  if (std::FILE* f = std::fopen(stop_record(pid_dir).c_str(), "w")) {
    std::fprintf(f, "%d\n", exit_code);
    std::fclose(f);
  }
}

int recorded_stop(const std::string& pid_dir) {
  int code = 0;
  if (std::FILE* f = std::fopen(stop_record(pid_dir).c_str(), "r")) {
    if (std::fscanf(f, "%d", &code) != 1) code = 0;
    std::fclose(f);
  }
  return code;
}

void forget_stop(const std::string& pid_dir) { std::remove(stop_record(pid_dir).c_str()); }

}  // namespace t3d::runtime
