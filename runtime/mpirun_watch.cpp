#include "runtime/mpirun_watch.h"

#include <sys/wait.h>
#include <unistd.h>

#include <csignal>
#include <cstdio>
#include <cstring>
#include <regex>

#include "kernels/check.h"

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
    if (m[5].matched && m[5] == "15") return {};  // ended by the launcher: an echo
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
  return {line};
}

std::vector<std::string> MpirunStderrFilter::finish() {
  if (!in_banner_) return {};
  in_banner_ = false;
  return close_banner();
}

int run_mpirun_watched(const std::vector<std::string>& argv, const std::string& log_dir) {
  int fds[2];
  T3D_ASSERT(pipe(fds) == 0, "pipe: ", std::strerror(errno));
  const pid_t child = fork();
  T3D_ASSERT(child >= 0, "fork: ", std::strerror(errno));
  if (child == 0) {
    dup2(fds[1], STDERR_FILENO);
    close(fds[0]), close(fds[1]);
    std::vector<char*> args;
    for (const auto& a : argv) args.push_back(const_cast<char*>(a.c_str()));
    args.push_back(nullptr);
    execvp(args[0], args.data());
    std::fprintf(stderr, "titan3d: cannot start mpirun: %s. Install Open MPI (`apt-get install "
                 "openmpi-bin`) or launch titan3d under mpirun / srun yourself\n",
                 std::strerror(errno));
    _exit(2);
  }
  close(fds[1]);
  std::signal(SIGINT, SIG_IGN);  // Ctrl-C reaches mpirun too; it ends the ranks, we report
  MpirunStderrFilter filter(log_dir);
  const auto print = [](const std::vector<std::string>& lines) {
    for (const auto& l : lines) std::fprintf(stderr, "%s\n", l.c_str());
    std::fflush(stderr);
  };
  std::FILE* in = fdopen(fds[0], "r");
  char* line = nullptr;
  size_t cap = 0;
  for (ssize_t n; (n = getline(&line, &cap, in)) > 0;) {
    std::string l(line, static_cast<size_t>(n));
    if (!l.empty() && l.back() == '\n') l.pop_back();
    print(filter.feed(l));
  }
  print(filter.finish());
  std::free(line);
  std::fclose(in);
  int status = 0;
  while (waitpid(child, &status, 0) < 0 && errno == EINTR) {
  }
  return WIFEXITED(status) ? WEXITSTATUS(status) : 128 + WTERMSIG(status);
}

}  // namespace t3d::runtime
