// The self-launched training job's parent process: it runs the ranks under mpirun and, when the
// job ends because a rank died (a signal, an exit without finishing MPI), hung (the stall watch,
// or the collective watchdog's exit 3) or became unreachable, relaunches it from the newest
// complete snapshot (snapshot.resume = latest), with backoff (1, 2, 4 … s, at most 30), at most
// run.max_restarts times within run.restart_window_s.
//
// A restart continues the very run that would have happened: steps are bit-deterministic, the
// sampler's position is part of the snapshot, and metrics.jsonl is appended to (steps after the
// snapshot appear twice; the later line is the one that counts).
//
// Not restarted: success, a user error (exit 2: the same input fails the same way), a
// preemption (kExitPreempted: the snapshot is taken, the scheduler requeues), a signal to this
// launcher (Ctrl-C), and a failure that repeats — the same rank failing the same way before the
// run got past the step where it failed last time is a deterministic crash, not a transient
// fault, and is reported as such.
//
// Every failure is an incident: one JSON line in <run dir>/incidents.jsonl (time, attempt,
// cause, rank, host, exit code, last step logged, snapshot resumed, steps and seconds lost) and
// one line on the console. The launcher's end-of-run table gives the restarts, the time lost and
// the goodput (useful step time over wall time) from the SupervisedRun returned here.
#pragma once

#include <string>
#include <vector>

#include "runtime/launch/launch.h"
#include "runtime/recipe/recipe.h"
#include "runtime/supervise/elastic.h"

namespace t3d::runtime {

// An elastic change of layout: "old -> new without host X (why)" (a shrink), or "old -> new with
// host X back" (a regrow).
struct LayoutChange {
  bool regrow = false;
  std::string change;
};

// How a supervised job went, for the end-of-run table (apps/perf_report.h).
struct SupervisedRun {
  int code = 0;         // the exit code for the launcher
  int restarts = 0;     // relaunches after failures
  double lost_s = 0;    // step time done again after restarts, and time waiting to restart
  double useful_s = 0;  // step time that counts (each step once)
  double wall_s = 0;    // the whole job, first launch to last exit
  std::vector<LayoutChange> layout_changes;  // in order
  double goodput() const { return wall_s > 0 ? useful_s / wall_s : 0; }
};

// Runs `plan` (built from `recipe` by make_spawn_plan) until it succeeds or must stop.
// `log_level`: the command line's --log-level, kept on restarts. With run.hostfile naming several
// hosts, a failure is followed by a probe of every host (elastic.h): a host mpirun cannot reach
// stops the job, naming it, or with run.elastic shrinks it onto the others. A shrunk job probes
// the hosts it dropped every run.elastic_regrow_s; once all answer, it is stopped at a snapshot
// of its step (as a preemption) and relaunched in the layout it had before, on every host.
// `rank_bytes` prices a shrink's layout (elastic.h; empty: a shrink is not priced).
SupervisedRun supervise_training(const Recipe& recipe, SpawnPlan plan, const std::string& log_level,
                                 const RankBytes& rank_bytes = {});

}  // namespace t3d::runtime
