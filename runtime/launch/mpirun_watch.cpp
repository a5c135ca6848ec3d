#include "runtime/launch/mpirun_watch.h"

#include <dirent.h>
#include <poll.h>
#include <sys/prctl.h>
#include <sys/wait.h>
#include <unistd.h>

#include <algorithm>
#include <array>
#include <chrono>
#include <csignal>
#include <cstdio>
#include <cstring>
#include <map>
#include <optional>
#include <regex>

#include "kernels/check.h"
#include "runtime/launch/job.h"
#include "runtime/launch/stop_signal.h"

namespace t3d::runtime {

namespace {

bool is_rule(const std::string& line) {
  return line.size() >= 20 && line.find_first_not_of('-') == std::string::npos;
}

// Banners that only repeat what the ranks reported themselves.
bool is_echo(const std::string& text) {
  for (const char* known : {"Primary job", "exited with non-zero status", "MPI_ABORT was invoked",
                            "exited on signal 15"})
    if (text.find(known) != std::string::npos) return true;
  return false;
}

}  // namespace

std::vector<std::string> MpirunStderrFilter::close_banner() {
  std::vector<std::string> lines;
  lines.swap(banner_);
  std::string text;
  for (const auto& l : lines) text += l + " ";
  static const std::regex dead(
      R"(process rank (\d+) with PID (\d+) on node (\S+) (exited on signal (\d+) \(([^)]*)\)|exiting improperly))");
  std::smatch m;
  if (std::regex_search(text, m, dead)) {
    const std::string pid = m[2] == "0" ? "" : "pid " + m[2].str() + " ";
    const std::string how = m[5].matched ? "died: signal " + m[5].str() + " (" + m[6].str() + ")"
                                         : "exited without finishing MPI (a crash or exit())";
    // Ended by the launcher (mpirun's end of the job, or an interrupt to ranks without a stop
    // handler): an echo.
    if (m[5].matched &&
        (std::stoi(m[5].str()) == SIGTERM || std::stoi(m[5].str()) == kInterruptSignal))
      return {};
    dead_rank_ = std::stoi(m[1].str());
    dead_signal_ = m[5].matched ? std::stoi(m[5].str()) : 0;
    dead_host_ = m[3].str();
    return {"titan3d: rank " + m[1].str() + " (" + pid + "on host " + m[3].str() + ") " + how +
            "; Open MPI ended the job. Its log: " + log_dir_ + "/rank" + m[1].str() + ".log"};
  }
  if (is_echo(text)) return {};
  lines.insert(lines.begin(), std::string(74, '-'));
  return lines;
}

std::vector<std::string> MpirunStderrFilter::feed(const std::string& line) {
  if (is_rule(line)) {
    in_banner_ = !in_banner_;
    if (!in_banner_) return close_banner();
    return {};
  }
  if (in_banner_) {
    banner_.push_back(line);
    return {};
  }
  // mpirun's note of a signal it forwards to the ranks: the launcher said what it passed on.
  if (line.rfind("mpirun: Forwarding signal", 0) == 0) return {};
  return {line};
}

std::vector<std::string> MpirunStderrFilter::finish() {
  if (!in_banner_) return {};
  in_banner_ = false;
  return close_banner();
}

std::string watchdog_waited_host(const std::string& line) {
  if (line.find("watchdog: ") == std::string::npos) return "";
  const std::string key = "waiting on host ";
  const size_t at = line.find(key);
  if (at == std::string::npos) return "";
  const size_t from = at + key.size();
  return line.substr(from, line.find_first_of(" (,;", from) - from);
}

std::string standard_output_lost(int err) {
  return std::string("writing to standard output failed: ") + std::strerror(err) +
         "; the output is lost. Redirect it where there is space.";
}

char process_state(int pid) {
  std::FILE* f = std::fopen(("/proc/" + std::to_string(pid) + "/stat").c_str(), "r");
  if (!f) return 0;
  char buf[512] = {};
  const size_t n = std::fread(buf, 1, sizeof(buf) - 1, f);
  std::fclose(f);
  // "pid (comm) S ...": comm may hold spaces and parentheses, so the state follows the last ')'.
  const char* close = std::strrchr(buf, ')');
  return close && close + 2 < buf + n ? close[2] : 0;
}

namespace {

// "rank12.pid" -> 12, anything else -> -1.
int pid_file_rank(const char* name) {
  int rank = -1, end = 0;
  if (std::sscanf(name, "rank%d.pid%n", &rank, &end) == 1 && name[end] == '\0' && rank >= 0)
    return rank;
  return -1;
}

// The ranks of this host, from their pid files ("PID HOST", job.cpp): rank -> pid. A rank of
// another host names a pid of that host, which means nothing here.
std::map<int, int> local_rank_pids(const std::string& pid_dir) {
  std::map<int, int> pids;
  DIR* d = pid_dir.empty() ? nullptr : opendir(pid_dir.c_str());
  if (!d) return pids;
  const std::string here = host_name();
  while (const dirent* e = readdir(d)) {
    const int rank = pid_file_rank(e->d_name);
    if (rank < 0) continue;
    std::FILE* f = std::fopen((pid_dir + "/" + e->d_name).c_str(), "r");
    if (!f) continue;
    int pid = 0;
    char host[256] = {};
    if (std::fscanf(f, "%d %255s", &pid, host) == 2 && pid > 0 && here == host) pids[rank] = pid;
    std::fclose(f);
  }
  closedir(d);
  return pids;
}

// The stall watch of run_mpirun_watched: ranks stopped since when, and what was said.
class StallWatch {
 public:
  StallWatch(std::string log_dir, std::string pid_dir, double stall_s)
      : log_dir_(std::move(log_dir)), pid_dir_(std::move(pid_dir)), stall_s_(stall_s) {
    // Pid files of an earlier job in this run directory name processes that are gone (or reused).
    if (DIR* d = opendir(pid_dir_.c_str())) {
      while (const dirent* e = readdir(d))
        if (pid_file_rank(e->d_name) >= 0) unlink((pid_dir_ + "/" + e->d_name).c_str());
      closedir(d);
    }
  }
  bool fired() const { return fired_; }
  int killed_rank() const { return killed_rank_; }

  // Once a second: lines to print. Kills a rank stopped for stall_s.
  std::vector<std::string> poll() {
    std::vector<std::string> out;
    if (stall_s_ <= 0 || pid_dir_.empty()) return out;
    const auto now = Clock::now();
    const std::map<int, int> pids = local_rank_pids(pid_dir_);
    const size_t ranks = pids.size();
    for (const auto& [rank, pid] : pids) {
      const char state = process_state(pid);
      if (state != 'T' && state != 't') {
        stopped_.erase(rank);
        continue;
      }
      auto [it, fresh] = stopped_.try_emplace(rank, Stopped{pid, now, false});
      const double s = std::chrono::duration<double>(now - it->second.since).count();
      const std::string who = "rank " + std::to_string(rank) + " (pid " + std::to_string(pid) + ")";
      if (!it->second.named && s >= stall_s_ / 2) {
        it->second.named = true;
        out.push_back("titan3d: stall watchdog: " + who +
                      " is stopped (SIGSTOP or a debugger) and makes no progress" +
                      (ranks > 1 ? "; the other ranks wait on it" : "") + ". Its log: " + log_dir_ +
                      "/rank" + std::to_string(rank) + ".log. `kill -CONT " + std::to_string(pid) +
                      "` resumes it");
      }
      if (s >= stall_s_ && !fired_) {
        fired_ = true;
        killed_rank_ = rank;
        out.push_back("titan3d: stall watchdog: " + who + " stayed stopped for more than " +
                      fmt_seconds(stall_s_) + " s (parallel.timeout_s); ending the job");
        kill(pid, SIGKILL);
      }
    }
    return out;
  }

 private:
  using Clock = std::chrono::steady_clock;
  struct Stopped {
    int pid;
    Clock::time_point since;
    bool named;
  };
  static std::string fmt_seconds(double s) {
    char buf[32];
    std::snprintf(buf, sizeof(buf), "%g", s);
    return buf;
  }
  std::string log_dir_, pid_dir_;
  double stall_s_;
  bool fired_ = false;
  int killed_rank_ = -1;
  std::map<int, Stopped> stopped_;
};

volatile std::sig_atomic_t g_received = 0;    // the last signal, consumed by the watch loop
volatile std::sig_atomic_t g_held_twice = 0;  // a signal came while another waited to be passed on
void on_signal(int sig) {
  if (g_received != 0) g_held_twice = 1;
  g_received = sig;
}

// Installs on_signal for the signals the launcher passes on; restores the old handlers on exit.
class ForwardedSignals {
 public:
  ForwardedSignals() {
    struct sigaction sa {};
    sa.sa_handler = on_signal;
    sigemptyset(&sa.sa_mask);
    for (size_t i = 0; i < kSignals.size(); ++i) sigaction(kSignals[i], &sa, &old_[i]);
  }
  ~ForwardedSignals() {
    for (size_t i = 0; i < kSignals.size(); ++i) sigaction(kSignals[i], &old_[i], nullptr);
  }

 private:
  static constexpr std::array<int, 4> kSignals = {SIGINT, SIGTERM, SIGHUP, SIGUSR1};
  std::array<struct sigaction, 4> old_{};
};

// Passes a received signal on to mpirun (see mpirun_watch.h); returns a line to print.
std::string forward(int sig, pid_t child, MpirunOutcome& out) {
  // The ranks of a stop request already have their stop signal: an interrupt is a second one.
  const bool again = out.signal != 0 || (sig == SIGINT && out.stop_asked);
  if (out.signal == -1) return "";  // already ending every rank
  out.signal = sig;
  if (again) {
    kill(child, SIGTERM);  // mpirun ends every rank: SIGTERM (their second stop signal), SIGKILL
    out.signal = -1;
    return "titan3d: second signal: ending every rank now (the last complete snapshot stays as it "
           "is)";
  }
  if (sig == SIGINT) {
    kill(child, kInterruptSignal);  // mpirun forwards it to every rank
    return "titan3d: interrupted: stopping every rank (a second Ctrl-C ends them now)";
  }
  if (out.stop_asked)  // the ranks already got SIGUSR1: a second would end them at once
    return "titan3d: signal " + std::to_string(sig) +
           ": every rank is already finishing its step to snapshot it and stop";
  kill(child, SIGUSR1);  // mpirun forwards SIGUSR1 to every rank
  return "titan3d: signal " + std::to_string(sig) +
         ": every rank finishes its step, snapshots it and stops (a second signal ends them now)";
}

// mpirun's standard output (the ranks' console: rank 0's logs and results), passed on to this
// process's own. The first write that fails (a full disk, /dev/full, a closed pipe: SIGPIPE is
// ignored meanwhile, so it is EPIPE) is remembered and the rest is read and dropped, so that no
// rank blocks on a pipe that is no longer emptied. A reader that is slow holds the job back, as
// it would any program writing to it.
class StdoutRelay {
 public:
  StdoutRelay() {
    struct sigaction ignore {};
    ignore.sa_handler = SIG_IGN;
    sigemptyset(&ignore.sa_mask);
    sigaction(SIGPIPE, &ignore, &old_pipe_);
  }
  ~StdoutRelay() { sigaction(SIGPIPE, &old_pipe_, nullptr); }
  StdoutRelay(const StdoutRelay&) = delete;
  StdoutRelay& operator=(const StdoutRelay&) = delete;

  void pass(const char* data, size_t n) {
    while (n > 0 && error_ == 0) {
      const ssize_t written = write(STDOUT_FILENO, data, n);
      if (written < 0 && errno == EINTR) continue;
      if (written < 0) {
        error_ = errno;
        return;
      }
      data += written, n -= static_cast<size_t>(written);
    }
  }
  int error() const { return error_; }  // errno of the write that failed, or 0

 private:
  struct sigaction old_pipe_ {};
  int error_ = 0;
};

// Forks mpirun (`argv`) with its stderr and stdout into pipes; returns its pid and the pipes'
// read ends.
pid_t start_mpirun(const std::vector<std::string>& argv, int* err_fd, int* out_fd) {
  int fds[2], out[2];
  T3D_ASSERT(pipe(fds) == 0 && pipe(out) == 0, "pipe: ", std::strerror(errno));
  const pid_t parent = getpid();
  const pid_t child = fork();
  T3D_ASSERT(child >= 0, "fork: ", std::strerror(errno));
  if (child == 0) {
    // mpirun and the ranks in a process group of their own: a signal to the launcher's group
    // (Ctrl-C, `timeout`, a job script's kill) reaches them only as the launcher passes it on,
    // so a preemption signal cannot kill mpirun before the ranks' snapshot commits.
    setpgid(0, 0);
    // The launcher killed (SIGKILL: no handler runs) must not leave the ranks training
    // unsupervised: mpirun gets SIGTERM then, and ends them. Set before exec, kept across it;
    // a launcher that died before this line is caught by the getppid check.
    prctl(PR_SET_PDEATHSIG, SIGTERM);
    if (getppid() != parent) _exit(2);
    dup2(fds[1], STDERR_FILENO);
    dup2(out[1], STDOUT_FILENO);
    close(fds[0]), close(fds[1]), close(out[0]), close(out[1]);
    std::vector<char*> args;
    for (const auto& a : argv) args.push_back(const_cast<char*>(a.c_str()));
    args.push_back(nullptr);
    execvp(args[0], args.data());
    std::fprintf(stderr,
                 "titan3d: cannot start mpirun: %s. Install Open MPI (`apt-get install "
                 "openmpi-bin`) or launch titan3d under mpirun / srun yourself\n",
                 std::strerror(errno));
    _exit(2);
  }
  close(fds[1]), close(out[1]);
  *err_fd = fds[0];
  *out_fd = out[0];
  return child;
}

// Notes the collective watchdogs' lines (and the hosts they waited on); ends mpirun's process
// group when mpirun outlives the first one by the watchdog's grace and 10 s (mpirun_watch.h).
class WatchdogAbortGuard {
 public:
  // The watchdog sleeps min(timeout / 2, 10) s before its abort (parallel/comm.cpp).
  explicit WatchdogAbortGuard(double timeout_s)
      : grace_s_(std::clamp(timeout_s / 2, 0.5, 10.0) + 10.0) {}
  void note(const std::string& line, std::vector<std::string>& waited_hosts) {
    if (line.find("watchdog: world rank") == std::string::npos) return;
    if (!since_) since_ = Clock::now();
    const std::string host = watchdog_waited_host(line);
    if (!host.empty() &&
        std::find(waited_hosts.begin(), waited_hosts.end(), host) == waited_hosts.end())
      waited_hosts.push_back(host);
  }
  // Once a second: kills mpirun's group when its time is up; returns a line to print, or "".
  std::string poll(pid_t child, bool& killed) {
    if (!since_ || killed ||
        std::chrono::duration<double>(Clock::now() - *since_).count() <= grace_s_)
      return "";
    killed = true;
    kill(-child, SIGKILL);
    return "titan3d: mpirun did not end the job " + std::to_string(static_cast<int>(grace_s_)) +
           " s after a collective watchdog fired (it waits for a host it cannot reach); ending "
           "mpirun and its ranks on this host";
  }

 private:
  using Clock = std::chrono::steady_clock;
  double grace_s_;
  std::optional<Clock::time_point> since_;
};

// The job's exit code (CONTRIBUTING: exit codes) from mpirun's wait `status` and how the job ended.
int job_exit_code(int status, const MpirunOutcome& outcome, bool stalled,
                  const std::string& pid_dir) {
  int code = WIFEXITED(status) ? WEXITSTATUS(status) : 128 + WTERMSIG(status);
  // The watchdog's exit code.
  if (stalled || outcome.mpirun_killed) code = 3;
  // Ended on a signal, or interrupted (the ranks of a training job exit with this code themselves).
  if ((outcome.signal == -1 || outcome.signal == SIGINT) && code != 0) code = kExitInterrupted;
  // The ranks agreed to stop and their snapshot committed: that is how the job ended, whatever
  // mpirun's code says (stop_signal.h).
  if (const int stopped = pid_dir.empty() ? 0 : recorded_stop(pid_dir); stopped != 0)
    code = stopped;
  return code;
}

}  // namespace

int sleep_unless_signalled(double seconds) {
  ForwardedSignals caught;
  g_received = 0;
  const auto until = std::chrono::steady_clock::now() + std::chrono::duration<double>(seconds);
  while (g_received == 0 && std::chrono::steady_clock::now() < until) ::poll(nullptr, 0, 50);
  const int sig = g_received;
  g_received = 0;
  return sig;
}

MpirunOutcome run_mpirun_watched(const std::vector<std::string>& argv, const std::string& log_dir,
                                 double stall_s, const std::string& pid_dir,
                                 const StopRequest& stop) {
  if (!pid_dir.empty()) forget_stop(pid_dir);  // an earlier attempt's
  int err_fd = -1, out_fd = -1;
  const pid_t child = start_mpirun(argv, &err_fd, &out_fd);
  StdoutRelay relay;
  ForwardedSignals forwarded;
  g_received = 0;
  g_held_twice = 0;
  MpirunOutcome outcome;
  MpirunStderrFilter filter(log_dir);
  WatchdogAbortGuard abort_guard(stall_s);
  const auto print = [&](const std::vector<std::string>& lines) {
    for (const auto& l : lines) {
      std::fprintf(stderr, "%s\n", l.c_str());
      abort_guard.note(l, outcome.waited_hosts);
    }
    std::fflush(stderr);
  };
  bool reaped = false;
  int status = 0;
  // mpirun's stderr line by line and its stdout as it comes, until both are closed (mpirun is
  // ending), and the stall watch once a second in between.
  StallWatch stalls(log_dir, pid_dir, stall_s);
  const auto started_at = std::chrono::steady_clock::now();
  const auto ranks_started = [&] {
    return pid_dir.empty() || access((pid_dir + "/rank0.pid").c_str(), F_OK) == 0 ||
           std::chrono::steady_clock::now() - started_at > std::chrono::seconds(30);
  };
  std::string pending;
  char buf[4096];
  // Reads what `fd` holds (it is ready); closes it at its end. Returns the bytes read into buf.
  const auto read_ready = [&](int& fd) -> size_t {
    const ssize_t n = read(fd, buf, sizeof(buf));
    if (n < 0 && errno == EINTR) return 0;
    if (n <= 0) close(fd), fd = -1;
    return n > 0 ? static_cast<size_t>(n) : 0;
  };
  while (err_fd >= 0 || out_fd >= 0) {
    pollfd pfds[2] = {{err_fd, POLLIN, 0}, {out_fd, POLLIN, 0}};  // a closed one (-1) is skipped
    const int ready = ::poll(pfds, 2, 1000);
    if (ready < 0 && errno != EINTR) break;
    if (ready > 0 && pfds[1].revents != 0) {
      const size_t n = read_ready(out_fd);
      relay.pass(buf, n);
    }
    if (ready > 0 && pfds[0].revents != 0) {
      pending.append(buf, read_ready(err_fd));
      for (size_t nl; (nl = pending.find('\n')) != std::string::npos;) {
        print(filter.feed(pending.substr(0, nl)));
        pending.erase(0, nl + 1);
      }
    }
    print(stalls.poll());
    if (outcome.mpirun_killed && waitpid(child, &status, WNOHANG) == child) {
      reaped = true;  // a process of another group may still hold the pipe: do not wait for EOF
      break;
    }
    if (const std::string said = abort_guard.poll(child, outcome.mpirun_killed); !said.empty())
      print({said});
    // A first signal waits until rank 0 has written its pid file (after MPI_Init, so every rank
    // has its stop handler and mpirun its forwarding): one sent earlier would kill them, or reach
    // mpirun before it has ranks to forward it to. A second signal ends the job at once.
    if (const int sig = g_received;
        sig != 0 && (outcome.signal != 0 || g_held_twice != 0 || ranks_started())) {
      if (g_held_twice != 0 && outcome.signal == 0)
        if (const std::string said = forward(sig, child, outcome); !said.empty()) print({said});
      g_received = 0;
      g_held_twice = 0;
      if (const std::string said = forward(sig, child, outcome); !said.empty()) print({said});
    }
    if (stop && !outcome.stop_asked && outcome.signal == 0 && stop()) {
      outcome.stop_asked = true;
      kill(child, SIGUSR1);  // mpirun forwards SIGUSR1 to every rank
    }
  }
  if (!pending.empty()) print(filter.feed(pending));
  print(filter.finish());
  for (const int fd : {err_fd, out_fd})
    if (fd >= 0) close(fd);
  while (!reaped && waitpid(child, &status, 0) < 0 && errno == EINTR) {
  }
  outcome.dead_rank = filter.dead_rank();
  outcome.dead_signal = filter.dead_signal();
  outcome.dead_host = filter.dead_host();
  outcome.stalled_rank = stalls.killed_rank();
  outcome.code = job_exit_code(status, outcome, stalls.fired(), pid_dir);
  if (relay.error() != 0) {
    print({"titan3d: " + standard_output_lost(relay.error())});
    if (outcome.code == 0) outcome.code = 2;  // a user error: the output went where it cannot
  }
  return outcome;
}

}  // namespace t3d::runtime
