// The parameters a rank reads that no comparison of replicas covers, watched for corruption at
// rest (part of run.replay_every, replay.h). Under ZeRO 1-3 the owner's update is handed to every
// replica alike (ZeRO-3's shard has no copy at all, and a ZeRO-1/2 copy is overwritten by the
// step's all-gather after this rank's forward read it), and a group of one rank has no replica:
// there the parameter store (the ZeRO-3 shard, else the group's region) is hashed after every
// optimizer step and again before the next one, and any difference is corruption, since nothing
// writes it in between. ZeRO 0 with replicas is left to the replicas' parameter hashes (a
// difference there persists until the next check).
#pragma once

#include <cstdint>
#include <vector>

#include "checkpoint/hash.h"
#include "kernels/exec.h"

namespace t3d::runtime {

class TrainingState;

class KeptParams {
 public:
  // `zero`: parallel.zero. Records the hashes of the state as it is (restored or initialised).
  KeptParams(const TrainingState& state, int zero);
  // Whether any group keeps parameters no other rank holds (else the calls below do nothing).
  bool active() const { return !watched_.empty(); }
  // After the optimizer step (or a skipped one): the hashes of what it left.
  void updated();
  // Before the optimizer step of `step` reads them: compares; the first change is kept.
  void verify(int64_t step);

  struct Change {
    int64_t step = 0;                         // the step before whose update it was found (0: none)
    uint64_t group = 0, kept = 0, found = 0;  // state group; its hash after the last update, now
  };
  const Change& change() const { return change_; }

 private:
  uint64_t hash(size_t group);
  const TrainingState& state_;
  std::vector<size_t> watched_;  // groups with kept parameters
  std::vector<uint64_t> kept_;   // per watched group: the hash after the last update
  Change change_;
};

}  // namespace t3d::runtime
