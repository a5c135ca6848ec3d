#include "runtime/supervise/incident.h"

#include <fmt/format.h>

#include <algorithm>

#include "parallel/trace.h"
#include "runtime/launch/job.h"
#include "runtime/launch/logging.h"
#include "runtime/launch/stop_signal.h"

namespace t3d::runtime {

std::pair<std::string, int> cause_of(const MpirunOutcome& out) {
  if (out.stalled_rank >= 0)
    return {
        "rank " + std::to_string(out.stalled_rank) + " hung (stopped; the stall watch killed it)",
        out.stalled_rank};
  if (out.dead_rank >= 0)
    return {out.dead_signal
                ? "rank " + std::to_string(out.dead_rank) + " died: signal " +
                      std::to_string(out.dead_signal)
                : "rank " + std::to_string(out.dead_rank) + " exited without finishing MPI",
            out.dead_rank};
  if (out.code == 3)
    return {"a collective waited past parallel.timeout_s (a hung rank or an unreachable host)", -1};
  return {"the job exited with code " + std::to_string(out.code), -1};
}

bool restartable(const MpirunOutcome& out) {
  if (out.signal != 0) return false;  // the launcher was told to stop
  switch (out.code) {
    case 0:                // done
    case 2:                // user error: the same input fails the same way
    case kExitPreempted:   // snapshot taken; the scheduler requeues
    case 5:                // selfcheck verdict
    case kExitCorruption:  // a replay's mismatch: the named host's results cannot be trusted
    case 130:
      return false;
    default:
      return true;
  }
}

void record_incident(const std::string& run_dir, const Incident& i) {
  append_incident(
      run_dir,
      fmt::format(
          "\"attempt\": {}, \"cause\": {}, \"rank\": {}, \"host\": {}, "
          "\"exit_code\": {}, \"last_step\": {}, \"snapshot_step\": {}, \"lost_steps\": {}, "
          "\"lost_s\": {:.3f}, \"action\": {}{}",
          i.attempt, parallel::trace::json_string(i.cause), i.rank,
          parallel::trace::json_string(i.host), i.exit_code, i.last_step, i.snapshot_step,
          std::max(0L, i.last_step - i.snapshot_step), i.lost_s,
          parallel::trace::json_string(i.action),
          i.tier.empty() ? "" : ", \"tier\": " + parallel::trace::json_string(i.tier)));
}

void record_stop_incident(const std::string& run_dir, const Incident& i, int sig, int code) {
  append_incident(
      run_dir,
      fmt::format(
          "\"event\": \"stop\", \"attempt\": {}, \"signal\": {}, \"exit_code\": {}, "
          "\"snapshot_step\": {}, \"action\": {}",
          i.attempt, sig, code, i.snapshot_step,
          parallel::trace::json_string(fmt::format(
              "stop: signal {} while waiting to restart, not restarting; continue with `titan3d "
              "train {}/restart.toml`",
              sig, run_dir))));
}

}  // namespace t3d::runtime
