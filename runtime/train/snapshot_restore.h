// Restoring a snapshot at start-up (Snapshotter::restore, snapshots.h): resolving
// snapshot.resume on rank 0, reading this rank's boxes (resharding), falling back past snapshots
// that fail on some rank, preferring the memory tier's when a relaunch finds it newer, the
// restore line of incidents.jsonl, and setting aside the snapshots this run does not continue.
#pragma once

#include <cstdint>
#include <string>

#include "checkpoint/io_thread.h"
#include "runtime/launch/job.h"

namespace t3d::runtime {

class MemoryTier;
class TrainingState;

class SnapshotRestore {
 public:
  // `tier`: null without the memory tier. Every HDF5 call runs on `io`.
  SnapshotRestore(const Job& job, const TrainingState& state, checkpoint::IoThread& io,
                  MemoryTier* tier);

  // Collective. Rank 0 resolves snapshot.resume and verifies it; every rank restores exactly
  // that snapshot (path, step and id broadcast), so ranks never restore different steps even
  // when the directory changes under them. With `latest`, a snapshot that fails to restore on
  // any rank is skipped (rank 0 names it and the reason) for the next older one; an explicit one
  // that fails is an AgreedFailure. Returns the steps already taken (0: a fresh start);
  // `last_good` becomes the disk index restored ("" for none or the memory tier's).
  int64_t run(std::string* last_good);

 private:
  // What rank 0 resolved snapshot.resume to; every rank restores exactly this.
  struct Choice {
    std::string path;
    int64_t step = 0;
    uint64_t id = 0;
  };
  // Rank 0: the snapshot to restore, verified (index, chain, every shard's hash for `latest`,
  // and the model's shape), older than step `before` when a newer one failed to restore. An
  // empty path: start fresh. UserError when there is nothing good to restore.
  Choice resolve(int64_t before, int64_t* seen);
  // Reads this rank's state from `c`, refusing a snapshot that is not the one rank 0 resolved.
  void load(const Choice& c, std::string* layout, std::string* device);
  // run() without setting aside: the memory tier first where it is newer, then the disk's.
  int64_t restore_chosen();
  // Rank 0 of a restart after a failure with the memory tier on: the restore line of
  // incidents.jsonl (docs/resilience.md) after the supervisor's incident.
  void record_restore(const char* used, int64_t step, int64_t disk_step, int64_t memory_step,
                      const std::string& why);
  // Collective: moves the committed snapshots this run does not continue into
  // <snapshot.dir>/set-aside-<UTC time>/ (rank 0 says so).
  void set_aside_other_runs(int64_t resumed_step);

  const Job& job_;
  const Recipe& r_;
  const parallel::Mesh& mesh_;
  const TrainingState& state_;
  checkpoint::IoThread& io_;
  MemoryTier* tier_;
  const std::string& dir_;
  std::string last_good_;
};

}  // namespace t3d::runtime
