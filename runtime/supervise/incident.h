// One failed attempt of a supervised job (supervisor.h) as incidents.jsonl records it, and the
// decisions about it that need nothing of the restart loop.
#pragma once

#include <string>
#include <utility>

#include "runtime/launch/launch.h"

namespace t3d::runtime {

// One failed attempt, as incidents.jsonl records it.
struct Incident {
  int attempt = 0;
  std::string cause;
  int rank = -1;
  std::string host;
  int exit_code = 0;
  long last_step = 0, snapshot_step = 0;
  double lost_s = 0;
  std::string action;
  std::string tier;  // with the memory tier on: the tier the restart is expected to use

  bool same_failure(const Incident& o) const {
    return o.cause == cause && o.rank == rank && last_step <= o.last_step;
  }
};

// What ended the attempt, in words, and the rank it names (-1: none).
std::pair<std::string, int> cause_of(const MpirunOutcome& out);
// Whether the job's end is a fault a relaunch may get past (run.on_corruption = exclude's exit 6
// is decided by the loop).
bool restartable(const MpirunOutcome& out);
// Appends `i` to <run_dir>/incidents.jsonl.
void record_incident(const std::string& run_dir, const Incident& i);
// The end of a job that a signal stopped while it waited to restart after incident `i`: a stop line
// after that incident's (whose action said it would restart), so that incidents.jsonl ends with
// what happened: {"time", "event": "stop", "attempt", "signal", "exit_code", "snapshot_step",
// "action"}.
void record_stop_incident(const std::string& run_dir, const Incident& i, int sig, int code);

}  // namespace t3d::runtime
