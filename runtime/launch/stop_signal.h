// Preemption: SLURM (`--signal=USR1@120`, or SIGTERM before its kill), a cluster scheduler or
// titan3d's own launcher asks a rank to stop. The first SIGTERM or SIGUSR1 only sets a flag; the
// trainer checks it, agreed over all ranks, after every step, takes a snapshot of that step, waits
// for its commit and exits with kExitPreempted. A second signal exits at once (128 + signal):
// the snapshot being written then is never committed, so the last complete one stays intact.
// Signals within kStopEchoSeconds of the first are that same request come by another route, not
// a second one: a scheduler that signals every process of a job reaches a rank directly, through
// mpirun (which forwards SIGUSR1, and ends the ranks with SIGTERM when signalled itself) and
// through the self-launched launcher, all at once.
//
// An interrupt (SIGINT, or kInterruptSignal) stops the same way and exits with kExitInterrupted:
// the user stopped the run, no scheduler is to requeue it. The self-launched launcher passes
// Ctrl-C on as kInterruptSignal, which mpirun forwards to every rank as it is (SIGINT it would
// turn into SIGTERM, which reads as a preemption, and SIGKILL a second later).
#pragma once

#include <csignal>
#include <string>

namespace t3d::runtime {

// Exit code of a job stopped by a preemption signal after its snapshot committed.
inline constexpr int kExitPreempted = 75;  // EX_TEMPFAIL: run again (requeue) to continue
// Exit code of a job stopped by an interrupt (Ctrl-C to its launcher): 128 + SIGINT.
inline constexpr int kExitInterrupted = 130;
// The signal the launcher passes Ctrl-C on as.
inline constexpr int kInterruptSignal = SIGUSR2;
// How long after the first stop signal another one is an echo of it (above).
inline constexpr int kStopEchoSeconds = 2;

// Installs the handlers of SIGTERM, SIGUSR1, SIGINT and kInterruptSignal (idempotent). Not for
// the launcher process, which forwards instead.
void install_stop_signals();
// The signal that asked this process to stop, 0 if none.
int stop_requested();
// Whether that stop is an interrupt rather than a preemption.
bool stop_is_interrupt();

// How the ranks agreed to stop, for the self-launched launcher. mpirun's exit code does not say
// it: an mpirun that was signalled itself (a scheduler signalling every process of the job, a
// `kill` of mpirun) exits 1 after its ranks stopped with their snapshot, which read as a failure
// and was restarted. So the lowest rank on each host writes the agreed exit code
// (kExitPreempted, kExitInterrupted) to `<pid dir>/stopped` once the step's snapshot committed;
// run_mpirun_watched removes the file before mpirun starts and, finding it after mpirun ended,
// ends with that code however mpirun ended.
void record_stop(const std::string& pid_dir, int exit_code);
// The code record_stop wrote to pid_dir, or 0 when there is none. `forget_stop` removes it.
int recorded_stop(const std::string& pid_dir);
void forget_stop(const std::string& pid_dir);

}  // namespace t3d::runtime
