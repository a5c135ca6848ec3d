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
// one line on the console. After a run with restarts, a line gives their count, the time lost
// and the goodput (useful step time over wall time).
#pragma once

#include <string>

#include "runtime/launch/launch.h"
#include "runtime/recipe/recipe.h"

namespace t3d::runtime {

// Runs `plan` (built from `recipe` by make_spawn_plan) until it succeeds or must stop; returns
// the exit code for the launcher. `log_level`: the command line's --log-level, kept on restarts.
int supervise_training(const Recipe& recipe, SpawnPlan plan, const std::string& log_level);

}  // namespace t3d::runtime
