// The hosts of a self-launched multi-host job (run.hostfile) and whether each can still be
// reached: what the restart loop (runtime/supervise/supervisor.h) needs to tell a failed rank,
// which a relaunch on the same hosts gets past, from a host that is gone, which it cannot.
#pragma once

#include <string>
#include <vector>

#include "runtime/launch/launch.h"

namespace t3d::runtime {

// One line of an Open MPI hostfile: `host [slots=N] [other options]`.
struct HostEntry {
  std::string host;
  int slots = 0;     // 0: not given (Open MPI then counts the host's cores)
  std::string line;  // as written, to write the file back without a host
};

// The hosts of `path`, in order (comments and blank lines skipped). UserError naming `key`, the
// file and line when it cannot be read, is empty, or a line's slots are not a positive number.
std::vector<HostEntry> read_hostfile(const std::string& path, const std::string& key);
// Writes `hosts` back as a hostfile (their original lines).
void write_hostfile(const std::string& path, const std::vector<HostEntry>& hosts);
// The slots of `hosts` together, or 0 when a host's slots are not given.
int total_slots(const std::vector<HostEntry>& hosts);

// Whether mpirun can start a process on `host` within timeout_s: `mpirun -np 1 --host <host>
// true`, through the same launch agent and out-of-band network the job's mpirun uses (Open MPI's
// environment and MCA files), so a host whose agent fails or whose daemon cannot call back is
// unreachable. Never hangs: past the deadline the probe's process group is killed. `why` gets
// the reason when it is not reachable.
bool probe_host(const std::string& host, bool as_root, double timeout_s, std::string* why);
// The same with `command` (argv) in place of `true`: whether it ran there and exited 0.
bool run_on_host(const std::string& host, bool as_root, double timeout_s,
                 const std::vector<std::string>& command, std::string* why);

}  // namespace t3d::runtime
