// Preemption: SLURM (`--signal=USR1@120`, or SIGTERM before its kill), a cluster scheduler or
// titan3d's own launcher asks a rank to stop. The first SIGTERM or SIGUSR1 only sets a flag; the
// trainer checks it, agreed over all ranks, after every step, takes a snapshot of that step, waits
// for its commit and exits with kExitPreempted. A second signal exits at once (128 + signal):
// the snapshot being written then is never committed, so the last complete one stays intact.
#pragma once

namespace t3d::runtime {

// Exit code of a job stopped by a preemption signal after its snapshot committed.
inline constexpr int kExitPreempted = 75;  // EX_TEMPFAIL: run again (requeue) to continue

// Installs the handlers (idempotent). Not for the launcher process, which forwards instead.
void install_stop_signals();
// The signal that asked this process to stop, 0 if none.
int stop_requested();

}  // namespace t3d::runtime
