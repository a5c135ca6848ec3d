// The self-launched job's parent: runs mpirun as a child and watches its stderr, so that a rank
// that dies (killed, crashed) is named in titan3d's own words. Open MPI reports a dead rank only in
// a banner (`mpirun noticed that process rank 1 with PID ... exited on signal 9`), and its other
// banners repeat what titan3d's ranks already said (MPI_ABORT after the watchdog, non-zero exits
// after an agreed error): those are dropped, a dead rank becomes one line, anything else passes.
#pragma once

#include <functional>
#include <optional>
#include <string>
#include <vector>

namespace t3d::runtime {

// What ended a watched mpirun, for the restart loop's incident log.
struct MpirunOutcome {
  int code = 0;         // exit code (128 + signal when mpirun itself was killed)
  int dead_rank = -1;   // a rank Open MPI saw die, or -1
  int dead_signal = 0;  // ... by this signal (0: it exited without finishing MPI)
  std::string dead_host;
  int stalled_rank = -1;  // a rank the stall watch killed, or -1
  int signal = 0;         // a signal this launcher passed on (-1: it ended the job), or 0
  // Hosts the ranks' collective watchdogs said they were waiting on (`waiting on host X`), in
  // the order first named: suspects, not verdicts (a slow host is named as well as a gone one).
  std::vector<std::string> waited_hosts;
  bool mpirun_killed = false;  // mpirun outlived the watchdog's abort and was ended (see below)
  bool stop_asked = false;     // the caller's StopRequest asked the job to stop (see below)
};

// Asked about once a second while mpirun runs, never blocking: true asks the job to stop as a
// preemption does (SIGUSR1 to mpirun: every rank snapshots its step and exits kExitPreempted),
// once. The restart loop's elastic regrow uses it (runtime/supervise/supervisor.h).
using StopRequest = std::function<bool()>;

// From one line of output: the host a collective watchdog waited on ("" if it names none).
std::string watchdog_waited_host(const std::string& line);

class MpirunStderrFilter {
 public:
  explicit MpirunStderrFilter(std::string log_dir) : log_dir_(std::move(log_dir)) {}
  // One line of mpirun's stderr (no newline) -> the lines to print.
  std::vector<std::string> feed(const std::string& line);
  // At end of stream: whatever an unterminated banner held.
  std::vector<std::string> finish();
  // The last rank a banner reported dead (rank -1 if none), its signal and host.
  int dead_rank() const { return dead_rank_; }
  int dead_signal() const { return dead_signal_; }
  const std::string& dead_host() const { return dead_host_; }

 private:
  std::vector<std::string> close_banner();
  std::string log_dir_;
  bool in_banner_ = false;
  std::vector<std::string> banner_;
  int dead_rank_ = -1, dead_signal_ = 0;
  std::string dead_host_;
};

// Runs `argv` (mpirun ...) with its stderr through the filter; returns how it ended.
//
// mpirun's stdout (rank 0's console) is relayed to this process's stdout: mpirun itself ignores a
// failed write there, so a result written to a full disk, /dev/full or a closed pipe would be
// lost with exit 0. The relay's first failed write is remembered and said once mpirun has ended
// (standard_output_lost); a job that succeeded then ends with code 2, the code of the verbs that
// write their own stdout, and any other code stays as it was.
//
// Signals to this launcher reach the job, so that no rank is left running: the first SIGTERM,
// SIGHUP or SIGUSR1 becomes SIGUSR1 to mpirun, which forwards it to every rank (preemption: each
// snapshots its step and exits with kExitPreempted); the first SIGINT (Ctrl-C, to the launcher's
// process group or to it alone) becomes kInterruptSignal, forwarded alike (a training rank
// stops as for a preemption and exits with kExitInterrupted, saying so; a rank of another verb
// ends), and the job's code is then kExitInterrupted. A first signal is held until rank 0 has
// published its pid (its stop handler is in place by then; 30 s at most); a second signal of
// either kind ends the job at once (SIGTERM to mpirun, which ends every rank). mpirun gets
// SIGTERM when this process dies, even by SIGKILL (PR_SET_PDEATHSIG), and ends the ranks.
//
// Stall watch (stall_s > 0): every rank on this host publishes its pid in pid_dir/rank<N>.pid
// (join_world). Once a second the parent reads each one's state from /proc; a rank stopped
// (SIGSTOP, a debugger) is named after stall_s / 2, before the other ranks' watchdogs (which see
// only that they wait) fire at stall_s, and killed after stall_s, ending the job with exit 3. A
// one-rank job has no one else to notice: this is what ends it.
//
// After a rank's collective watchdog fired (its `watchdog:` line), mpirun is given the watchdog's
// grace and 10 s more to end the job; past that its process group is killed (exit 3). mpirun
// waits without end for the daemon of a host it can no longer reach, and a restart must not.
MpirunOutcome run_mpirun_watched(const std::vector<std::string>& argv, const std::string& log_dir,
                                 double stall_s = 0, const std::string& pid_dir = "",
                                 const StopRequest& stop = {});

// "writing to standard output failed: <errno's words>; the output is lost. ...": the one message
// for output lost on stdout, of a verb (apps/) or of the ranks whose output the launcher relays.
std::string standard_output_lost(int err);

// Waits `seconds` unless SIGINT, SIGTERM, SIGHUP or SIGUSR1 comes first; returns that signal (0
// when the time ran out). The restart loop's backoff: a signal then stops the job as it would
// have stopped the ranks.
int sleep_unless_signalled(double seconds);

// The scheduler state letter of a process from /proc/<pid>/stat ('R', 'S', 'T' stopped, ...), or
// 0 when there is no such process.
char process_state(int pid);

}  // namespace t3d::runtime
