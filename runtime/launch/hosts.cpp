#include "runtime/launch/hosts.h"

#include <fcntl.h>
#include <signal.h>
#include <sys/wait.h>
#include <unistd.h>

#include <cerrno>
#include <chrono>
#include <cstdlib>
#include <cstring>
#include <fstream>
#include <sstream>
#include <thread>

#include "kernels/check.h"

namespace t3d::runtime {

std::vector<HostEntry> read_hostfile(const std::string& path, const std::string& key) {
  std::ifstream f(path);
  T3D_USER_CHECK(f.good(), "`", key, "`: cannot read the hostfile `", path,
                 "`; give the path of an Open MPI hostfile (`host slots=N` per line)");
  std::vector<HostEntry> hosts;
  int number = 0;
  for (std::string line; std::getline(f, line);) {
    ++number;
    const std::string text = line.substr(0, line.find('#'));
    std::istringstream words(text);
    HostEntry e;
    if (!(words >> e.host)) continue;
    e.line = line;
    for (std::string w; words >> w;) {
      if (w.rfind("slots=", 0) != 0) continue;
      char* end = nullptr;
      const long n = std::strtol(w.c_str() + 6, &end, 10);
      T3D_USER_CHECK(end && *end == '\0' && n > 0 && n < 1 << 20, "`", key, "`: ", path, ":",
                     number, ": `", w, "` is not a positive number of slots");
      e.slots = static_cast<int>(n);
    }
    hosts.push_back(e);
  }
  T3D_USER_CHECK(!hosts.empty(), "`", key, "`: the hostfile `", path, "` names no host");
  return hosts;
}

void write_hostfile(const std::string& path, const std::vector<HostEntry>& hosts) {
  std::ofstream f(path);
  f << "# Written by titan3d's restart loop: run.hostfile without the hosts it could not reach.\n";
  for (const auto& h : hosts) f << h.line << "\n";
  T3D_USER_CHECK(f.good(), "cannot write the hostfile `", path, "`");
}

int total_slots(const std::vector<HostEntry>& hosts) {
  int total = 0;
  for (const auto& h : hosts) {
    if (h.slots == 0) return 0;
    total += h.slots;
  }
  return total;
}

bool probe_host(const std::string& host, bool as_root, double timeout_s, std::string* why) {
  return run_on_host(host, as_root, timeout_s, {"true"}, why);
}

bool run_on_host(const std::string& host, bool as_root, double timeout_s,
                 const std::vector<std::string>& command, std::string* why) {
  std::vector<std::string> argv = {"mpirun", "-np", "1", "--host", host};
  if (as_root) argv.push_back("--allow-run-as-root");
  argv.insert(argv.end(), command.begin(), command.end());
  const pid_t child = fork();
  T3D_ASSERT(child >= 0, "fork: ", std::strerror(errno));
  if (child == 0) {
    // A group of its own, so that the deadline ends the probe's agent and daemon with it.
    setpgid(0, 0);
    const int null = ::open("/dev/null", O_WRONLY);
    if (null >= 0) dup2(null, STDOUT_FILENO), dup2(null, STDERR_FILENO);
    std::vector<char*> args;
    for (auto& a : argv) args.push_back(a.data());
    args.push_back(nullptr);
    execvp(args[0], args.data());
    _exit(127);
  }
  setpgid(child, child);  // also here: the deadline may come before the child ran setpgid
  const auto deadline = std::chrono::steady_clock::now() + std::chrono::duration<double>(timeout_s);
  int status = 0;
  for (;;) {
    const pid_t done = waitpid(child, &status, WNOHANG);
    if (done == child) break;
    if (done < 0 && errno != EINTR) {
      *why = std::string("waitpid: ") + std::strerror(errno);
      return false;
    }
    if (std::chrono::steady_clock::now() >= deadline) {
      kill(-child, SIGKILL);
      while (waitpid(child, &status, 0) < 0 && errno == EINTR) {
      }
      *why = "mpirun could not start a process there within " +
             std::to_string(static_cast<int>(timeout_s)) + " s";
      return false;
    }
    std::this_thread::sleep_for(std::chrono::milliseconds(100));
  }
  if (WIFEXITED(status) && WEXITSTATUS(status) == 0) return true;
  *why = WIFEXITED(status) ? "mpirun failed to start a process there (exit " +
                                 std::to_string(WEXITSTATUS(status)) + ")"
                           : "mpirun was killed by signal " + std::to_string(WTERMSIG(status));
  return false;
}

}  // namespace t3d::runtime
