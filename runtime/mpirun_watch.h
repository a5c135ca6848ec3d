// The self-launched job's parent: runs mpirun as a child and watches its stderr, so that a rank
// that dies (killed, crashed) is named in titan3d's own words. Open MPI reports a dead rank only in
// a banner (`mpirun noticed that process rank 1 with PID ... exited on signal 9`), and its other
// banners repeat what titan3d's ranks already said (MPI_ABORT after the watchdog, non-zero exits
// after an agreed error): those are dropped, a dead rank becomes one line, anything else passes.
#pragma once

#include <optional>
#include <string>
#include <vector>

namespace t3d::runtime {

class MpirunStderrFilter {
 public:
  explicit MpirunStderrFilter(std::string log_dir) : log_dir_(std::move(log_dir)) {}
  // One line of mpirun's stderr (no newline) -> the lines to print.
  std::vector<std::string> feed(const std::string& line);
  // At end of stream: whatever an unterminated banner held.
  std::vector<std::string> finish();

 private:
  std::vector<std::string> close_banner();
  std::string log_dir_;
  bool in_banner_ = false;
  std::vector<std::string> banner_;
};

// Runs `argv` (mpirun ...) with its stderr through the filter; returns its exit code (128 + signal
// when it was killed). Ignores SIGINT itself (mpirun, in the same process group, ends the job).
int run_mpirun_watched(const std::vector<std::string>& argv, const std::string& log_dir);

}  // namespace t3d::runtime
