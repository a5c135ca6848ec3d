#include "runtime/launch/stop_signal.h"

#include <unistd.h>

#include <csignal>

namespace t3d::runtime {

namespace {

volatile std::sig_atomic_t g_stop = 0;

void on_stop(int sig) {
  if (g_stop != 0) _exit(128 + sig);  // the second signal: now
  g_stop = sig;
}

}  // namespace

void install_stop_signals() {
  struct sigaction sa {};
  sa.sa_handler = on_stop;
  sigemptyset(&sa.sa_mask);
  sa.sa_flags = SA_RESTART;
  sigaction(SIGTERM, &sa, nullptr);
  sigaction(SIGUSR1, &sa, nullptr);
}

int stop_requested() { return static_cast<int>(g_stop); }

}  // namespace t3d::runtime
