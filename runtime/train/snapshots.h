// The trainer's side of snapshots: what each rank writes, when, and how ranks agree before a
// snapshot is published; restoring (and resharding) at start-up. The files themselves are
// checkpoint/'s business (format in docs/snapshot-format.md).
//
// Taking a snapshot at a step boundary: the rank copies the boxes it writes (parameters, AdamW
// moments) to host staging memory — the only time training waits, unless the previous snapshot
// is still being written — and its I/O thread writes the shard while the next steps run. The
// staging is capped (snapshot.staging_gib; by default half the rank's training state): a larger
// snapshot is staged in waves, training waiting while each but the last is written.
// At each later step boundary one integer all-reduce asks whether every rank has finished; then
// ranks agree that all writes succeeded, publish their shards (rename), and rank 0 writes the
// index, the commit record. A failed write on any rank is reported by rank 0, the snapshot is
// dropped, training goes on, and the last good snapshot stays as it was.
//
// Who writes what: tensor i of a (pp, tp) position is written by rank i mod (dp · cp) of the
// flattened dp × cp group (Mesh::dp_cp), and tp-replicated tensors (norm weights) by tp rank 0
// only, so every box of every global tensor has exactly one writer and the write load is spread
// over the replicas. With ZeRO each dp × cp rank writes the state it owns, as boxes of the
// global tensors; restore re-slices them.
//
// Incremental snapshots (snapshot.full_every > 1): every rank keeps the last committed
// snapshot's chunk hashes (not its bytes); the next snapshot leaves out the chunks whose hash did
// not change. It is incremental only where that pays: when at least
// snapshot.incremental_min_unchanged of all chunks were unchanged last time (measured on every
// snapshot). The decision depends only on
// commits, which all ranks agree on, so it is alike everywhere. The first two snapshots after a
// start or resume are full (the second measures).
//
// The memory tier (snapshot.memory_every, memory_tier_copies.h): between disk snapshots, the same
// shards (full, uncompressed) into this host's /dev/shm through the same staging and I/O thread,
// plus buddy copies on the next host; committed by a manifest once every copy arrived. restore() of
// a relaunch after a failure takes the newer of the memory tier's newest complete snapshot and the
// disk's.
#pragma once

#include <cstdint>
#include <map>
#include <memory>
#include <string>

#include "runtime/launch/job.h"
#include "runtime/recipe/recipe.h"

namespace t3d::runtime {

class Model;
class MetricsWriter;
class TrainingState;

class Snapshotter {
 public:
  // `metrics`: rank 0's writer (null elsewhere). When snapshot.every > 0, checks that this rank
  // can write into snapshot.dir (UserError naming the key) and allocates the host staging memory.
  // `state`: what this rank owns (its boxes of the global tensors). `device`: the rank's
  // (kernels::Device::description), which rank 0's index records.
  Snapshotter(const Job& job, Model& model, const TrainingState& state, MetricsWriter* metrics,
              const std::string& device = "cpu");
  ~Snapshotter();  // lets a write in flight finish; an uncommitted snapshot stays unpublished
  Snapshotter(const Snapshotter&) = delete;
  Snapshotter& operator=(const Snapshotter&) = delete;

  // Restores parameters and optimizer moments from snapshot.resume ("" none, "latest", or a
  // path), resharding to this rank's layout. Returns the number of steps already taken (0 for a
  // fresh start). Collective, outside agree_on: rank 0 resolves and verifies the snapshot, every
  // rank restores exactly that one (path, step and id broadcast); `latest` falls back past any
  // snapshot that fails on some rank. A failure is agreed on and reported once (AgreedFailure).
  // Also reserves the snapshot staging first: collective, refused (exit 2) on every rank when a
  // host lacks the memory for its ranks' staging.
  int64_t restore();
  // Host memory this rank stages snapshots in (0 without snapshots).
  size_t staging_bytes() const;

  // After optimizer step `steps_done` on every rank (collective): commits a finished snapshot,
  // starts one when due (every `snapshot.every` steps and at the last step). Three failed
  // snapshots in a row end the run (AgreedFailure, exit 2).
  void after_step(int64_t steps_done, bool last);
  // Before the optimizer changes parameters or moments: on a GPU the last snapshot's copies may
  // still be running beside the step (SnapshotStaging::stage), and the ops enqueued after this
  // wait for them (on the GPU; the host goes on). Nothing on the CPU.
  void before_state_changes() const;
  // Waits for the snapshot in flight and commits it (collective). If the run's last snapshot
  // failed, its final state is lost: AgreedFailure (exit 2).
  void finish();

 private:
  struct Impl;
  std::unique_ptr<Impl> impl_;
};

}  // namespace t3d::runtime
