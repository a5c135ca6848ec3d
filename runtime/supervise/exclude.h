// run.on_corruption = exclude (docs/resilience.md, Replay): a job whose replay named a corrupting
// host exits kExitCorruption after rank 0 wrote its account to incidents.jsonl
// (runtime/train/replay.cpp); the restart loop (supervisor.h) reads the host to leave out from
// it and continues without that host through the elastic shrink (elastic.h).
#pragma once

#include <optional>
#include <string>
#include <vector>

#include "runtime/launch/hosts.h"

namespace t3d::runtime {

// What the supervisor takes from a `corruption` line of incidents.jsonl.
struct CorruptionAccount {
  long step = 0;           // the step the replay stopped
  long verified_step = 0;  // the last step a check passed
  std::string host;        // the host to leave out; empty: none (the candidates on several hosts)
  int rank = -1;           // a named rank on it
  std::string what;        // what differed, in words
};

// The last `corruption` line of the incidents file `path` (nullopt: none, or no file).
std::optional<CorruptionAccount> last_corruption(const std::string& path);

// The entry of `hosts` (the job's hostfile, in the order mpirun --map-by slot fills it) that a
// rank named by its host name `name` and world rank `rank` ran on: the entry written as that
// name, else the one whose slots hold `rank` when every entry gives its slots; -1: neither says.
int host_index(const std::vector<HostEntry>& hosts, const std::string& name, int rank);

}  // namespace t3d::runtime
