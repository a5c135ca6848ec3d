// The host-memory policy of snapshots (docs/snapshot-format.md, "Staging, in waves within a
// cap"): the boxes this rank writes, the host staging they are copied into at a snapshot, capped
// by snapshot.staging_gib and by what the host's memory leaves, and the waves that cap cuts them
// into. SnapshotWriter (snapshot_writer.h) stages and writes the waves.
#pragma once

#include <cstddef>
#include <cstdint>
#include <memory>
#include <vector>

#include "checkpoint/snapshot.h"
#include "kernels/arena.h"
#include "kernels/device.h"
#include "runtime/launch/job.h"

namespace t3d::runtime {

class Model;
class TrainingState;

class SnapshotStaging {
 public:
  // Chunks [first, last) of box `box`, chunk `first` at float `at` of the staging.
  struct Part {
    size_t box;
    int64_t first, last;
    size_t at;
  };

  // This rank's boxes and the waves they are staged in; the staging itself is allocated by
  // reserve() once every host is known to have the memory. UserError naming
  // snapshot.staging_gib when an explicit cap cannot hold one chunk.
  SnapshotStaging(const Recipe& r, const TrainingState& state);

  // Collective. A host's memory for the job is what is available plus what its ranks already
  // hold; each rank will hold at least its arena's regions (most not yet touched when this runs)
  // or what it holds now, whichever is more, plus its staging. With the default cap
  // (snapshot.staging_gib = 0) a host's ranks stage in at most 3/4 of what that leaves (smaller
  // waves where half the training state would not fit); an explicit cap is taken as given. A run
  // whose staging cannot fit some host is refused (exit 2, on every rank) with the numbers. Then
  // the staging is allocated and touched, so that the first snapshot's stall is a plain copy.
  void reserve(const Job& job, const Model& model, const TrainingState& state);

  // The boxes this rank writes (data in the arena).
  const std::vector<checkpoint::Slice>& boxes() const { return mine_; }
  // Waves of at most bytes(): each is written before the next is copied, and training goes on
  // while the last one is written.
  const std::vector<std::vector<Part>>& waves() const { return waves_; }
  // Starts copying the parts of wave `w` from the arena into the staging
  // (kernels::copy_to_host_started): on a GPU on the copy stream, behind the compute enqueued so
  // far and beside what is enqueued after (the staging is pinned: the link's rate); on the CPU
  // done on return. wait_staged() waits for them (any thread), before the staging is read;
  // before_state_changes() makes the compute enqueued after it wait for them (on the GPU, not the
  // host): the optimizer must not overwrite parameters or moments still being copied.
  void stage(size_t w);
  void wait_staged() const;
  void before_state_changes() const;
  const float* data() const { return staging_; }
  // Host memory the staging takes (the cap, or all of this rank's boxes when smaller).
  size_t bytes() const { return staging_floats_ * sizeof(float); }

 private:
  // Cuts the boxes into waves of at most staging_floats_, at chunk boundaries, filled from the
  // end: the last wave, written while training goes on, is a full one and the first takes the
  // rest, so training waits for as little writing as the cap allows.
  void plan_waves();

  const Recipe& r_;
  kernels::Exec exec_;  // the memory of the boxes (the state's)
  std::vector<checkpoint::Slice> mine_;
  std::vector<std::vector<Part>> waves_;
  int64_t largest_chunk_floats_ = 1;
  size_t staging_floats_ = 0;
  // An arena of its own (huge pages where offered, like the device arena): staging_floats_.
  std::unique_ptr<kernels::Arena> staging_arena_;
  float* staging_ = nullptr;
  std::unique_ptr<kernels::PinnedHostRegion> pinned_;  // on a GPU; declared last: unpinned first
};

}  // namespace t3d::runtime
