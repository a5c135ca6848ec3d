#include "runtime/machine/machine.h"

#include <algorithm>
#include <cstdlib>
#include <thread>

#include "kernels/gemm.h"

namespace t3d::runtime {

std::string cache_dir() {
  if (const char* xdg = std::getenv("XDG_CACHE_HOME"); xdg && *xdg)
    return std::string(xdg) + "/titan3d";
  if (const char* home = std::getenv("HOME"); home && *home)
    return std::string(home) + "/.cache/titan3d";
  return "/tmp/titan3d-cache";
}

int setup_rank_threads(const Recipe& r, const LaunchEnv& env, bool report) {
  const int cores = static_cast<int>(std::max(1u, std::thread::hardware_concurrency()));
  const int threads = threads_per_rank(static_cast<int>(r.hardware.threads_per_rank), cores,
                                       std::max(1, env.local_size));
  kernels::set_rank_threads(threads);
  if (report) report_cpu_binding(threads, env);
  return threads;
}

}  // namespace t3d::runtime
