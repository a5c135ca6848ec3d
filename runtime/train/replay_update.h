// A peer's recomputation of each ZeRO owner's optimizer update (part of run.replay_every,
// replay.h). Under ZeRO 1-3 each rank of a state group updates only its own partition, and the
// all-gather hands the result to every replica alike: wrong arithmetic in that update would
// reach every replica and no comparison of replicas would see it. So on a checked step, before
// the update, every rank streams the inputs of its update (its partition's parameters, gradients
// and AdamW moments, in chunks of kChunkFloats through one staging buffer) to the rank that
// checks it, and from what it receives recomputes, with the same arithmetic and settings
// (ShardedState::adamw_config), the update of the rank it checks, hashing the parameters and
// moments that gives. After the update each owner hashes what it wrote, chunk by chunk alike,
// and the group compares.
//
// Who checks whom: at the c-th check group rank i checks rank (i + s) mod n, s = 1 + (c − 1)
// mod (n − 1), so over n − 1 checks every rank is checked by every other. With n ≥ 3 a second
// checker, rank (i + s') mod n with the next s', recomputes too, so that a disagreement between
// an owner and one checker is settled by the other; with n = 2 it cannot be, and both are named
// as candidates. Groups of one rank, and ZeRO 0 (every replica updates everything, and the
// replicas' parameter hashes compare), are not checked here.
//
// Cost per check: sending 4 floats per owned float to each checker and one AdamW pass over as
// many; the staging takes 2 · 4 · kChunkFloats floats of the arena, allocated once.
#pragma once

#include <cstdint>
#include <vector>

#include "kernels/arena.h"
#include "parallel/comm.h"
#include "runtime/recipe/recipe.h"

namespace t3d::runtime {

class ShardedState;
class TrainingState;

class UpdateCheck {
 public:
  static constexpr int64_t kChunkFloats = int64_t{1} << 16;

  // The state groups with more than one rank under ZeRO ≥ 1 (none: active() is false and
  // nothing is allocated).
  UpdateCheck(const parallel::Mesh& mesh, TrainingState& state, int zero, kernels::Arena& arena);
  bool active() const { return !checked_.empty(); }

  // Before the optimizer step `step` (1-based) of the check numbered `check` (from 1), with the
  // step's learning rate and clipping factor: collective over each checked group.
  void recompute(int64_t check, const TrainConfig& t, double lr, int64_t step, float grad_scale);

  // After that optimizer step (collective over each checked group): what this rank's own update
  // and its recomputations say. A rank is named when its result is outvoted: an owner whose
  // update both checkers recompute alike and otherwise, or a checker whose recomputation differs
  // from the owner's and the other checker's; with one checker a difference names both owner and
  // checker, unsettled.
  struct Finding {
    enum : uint64_t { kAgrees, kWrongUpdate, kWrongRecomputation, kUnsettled };
    uint64_t verdict = kAgrees;
    uint64_t group = 0;       // the state group (0 dense, 1 experts)
    uint64_t hash = 0;        // this rank's: its update's hash, or its recomputation's
    uint64_t other = 0;       // the hash it was compared with (the other side's)
    uint64_t other_rank = 0;  // the world rank of the other side
    uint64_t recomputed = 0;  // 1: `hash` is this rank's recomputation of other_rank's update
  };
  Finding compare();

  ~UpdateCheck();
  UpdateCheck(const UpdateCheck&) = delete;
  UpdateCheck& operator=(const UpdateCheck&) = delete;

 private:
  struct Group {
    size_t index = 0;                      // in TrainingState::groups()
    const parallel::Comm* comm = nullptr;  // its ranks (the hashes travel here)
    int n = 0, me = 0;
    int shifts[2] = {0, 0};       // this check's: rank me checks rank (me + shift) mod n
    uint64_t recomputed[2] = {};  // per shift: the hash of that rank's update, recomputed here
    std::vector<bool> paired;     // per shift: its pairs readied (TensorComm::prepare_pairs)
  };
  // A rank's chunks: the pieces it updates, cut so that each chunk holds at most kChunkFloats.
  struct Segment {
    size_t param;
    int64_t lo, n, at;  // the piece part: floats [lo, lo + n) of the region, `at` in the store
    int64_t chunk, offset;
  };
  struct Plan {
    std::vector<Segment> segments;
    std::vector<int64_t> chunk_floats;
  };
  Plan plan_of(const Group& g, int group_rank) const;
  // Copies chunk `chunk` of this rank's `plan` into send_ as [parameters | gradients | m | v]
  // (without the gradients when !grads), its segments from index i on (advanced past them).
  void pack(const ShardedState& st, const Plan& plan, size_t& i, int64_t chunk, bool grads);
  // The chunks of this rank's own parameters and moments (after its update), hashed as
  // stream() hashes a recomputation.
  uint64_t own_hash(const Group& g);
  void stream(Group& g, int shift, size_t slot, const TrainConfig& t, double lr, int64_t step,
              float grad_scale);

  const parallel::Mesh& mesh_;
  TrainingState& state_;
  std::vector<Group> checked_;
  float* send_ = nullptr;  // 4 · kChunkFloats: a chunk's parameters, gradients, moments
  float* recv_ = nullptr;
  bool pending_ = false;  // recompute ran for this step; compare() has not yet
};

}  // namespace t3d::runtime
