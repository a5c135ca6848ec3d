// Silent data corruption caught by replay (docs/resilience.md#replay; issue 43). Every step is
// bit-deterministic, so a step recomputed anywhere with the same parameters and data gives the
// same bits: any difference is corruption, not noise. Every run.replay_every steps:
//
//   - Each data-parallel replica (the ranks of one dp coordinate: every pp, tp and cp rank of it,
//     so the pipeline's and tensor parallelism's collectives stay matched) first recomputes a
//     peer replica's share of the step, the peer's micro-batches through this rank's own stage,
//     with the gradient reducer local (GradReducer::begin_step: nothing reduced, nothing kept).
//     At the c-th check (c = step / replay_every, from 1) replica d replays replica
//     (d + k) mod dp, k = 1 + (c − 1) mod (dp − 1): every replica is replayed by one peer per
//     check, and by every other replica over dp − 1 checks. With dp = 1 a replica replays
//     itself, which catches transient faults only (the log says so). With expert parallelism
//     whole EP groups replay whole EP groups (k a multiple of ep, their all-to-alls assemble
//     the same tokens): replicas = dp / ep; one EP group holding every replica replays itself.
//   - Then the step's own pass runs as always. Every bucket of both passes is hashed at the moment
//     its reduction would start (after sequence parallelism's sum over tp, before any collective:
//     ShardedState::set_tap), so the overlapped reduction is left as it is and each hash is of
//     the rank's local gradient alone; the pass and its replay make the same sequence of
//     reductions (same stage, same schedule). A rank's own hashes are compared, over its dp group
//     (same pp, tp, cp coordinates), with its replayer's.
//   - After the optimizer step the dp group compares a hash of its parameters. ZeRO 0-2 keep the
//     whole parameter region on every replica (ZeRO-1/2 after the step's all-gather), so the
//     region's hash is comparable and that is the one taken (per state group, among the ranks
//     holding the same experts); a ZeRO-3 rank keeps only its own shard, which no other rank
//     holds, so that comparison is skipped there.
//   - Under ZeRO 1-3, peers recompute each owner's optimizer update from its inputs and compare
//     hashes of the result (UpdateCheck, replay_update.h): the all-gather would hand a wrong
//     update to every replica alike.
//   - Every step, under ZeRO 1-3 or without replicas, the parameter store is hashed after the
//     update and before the next (KeptParams, replay_kept.h): a change at rest is named, settled,
//     at the next check or the run's last step.
//
// A rank whose parameters changed at rest is named first. A mismatch is settled before it is
// reported: every replica recomputes its own share once more.
// A rank whose first result differs from both recomputations had a transient fault; one that
// reproduces its own result while its replayer computes another disagrees persistently, and the
// parameter hashes (by majority, dp ≥ 3) or the rank common to several disagreements name it;
// with dp = 2 a persistent disagreement cannot be settled and both candidates are named.
// run.on_corruption = stop: the step is not applied, the snapshots in flight commit, rank 0
// names step, rank(s), host(s), bucket and hashes in its log, on stderr and in incidents.jsonl,
// and every rank exits kExitCorruption (runtime/launch/job.h).
//
// Not caught: a fault that corrupts every replica alike (inside the reduction), and a transient
// fault at a step that is not checked (it is averaged into every replica alike).
//
// T3D_FAULT=flip (parallel/fault.h), which exists to test this, is injected here too.
#pragma once

#include <cstdint>
#include <functional>
#include <memory>

#include "kernels/arena.h"
#include "runtime/launch/job.h"
#include "runtime/model/stage_model.h"

namespace t3d::runtime {

class Model;
class Snapshotter;
class TrainingState;

class Replay {
 public:
  // A training pass of this rank's stage over replica `replica`'s micro-batches of the step (cut
  // to this rank's cp part): the trainer's executor run, with the gradient scale of the step.
  using Pass = std::function<void(int replica)>;
  // `first_step`: the steps already taken (a resumed run's snapshot; the last state known good).
  Replay(const Job& job, Model& model, TrainingState& state, Snapshotter& snapshots,
         kernels::Arena& arena, int64_t first_step);
  ~Replay();
  Replay(const Replay&) = delete;
  Replay& operator=(const Replay&) = delete;

  // Before step `step`'s own pass (1-based; collective on a replay step): T3D_FAULT=flip's
  // parameter flip or armed gradient flip, and on a replay step the replayed pass of the peer's
  // share, after which the own pass's buckets are hashed.
  void begin_step(int64_t step, const Pass& pass);
  // What the own pass runs: the Model, or on a T3D_FAULT=flip:...:act step a stage that flips a
  // stored activation after its first forward.
  StageModel& stage();
  // After the own pass's reductions finished, before the optimizer (collective on a replay step):
  // compares the gradient hashes; on a mismatch settles, reports and stops (AgreedFailure with
  // kExitCorruption on every rank; the optimizer step is not taken).
  void check_gradients(int64_t step, const Pass& pass);
  // Right before the optimizer step, with its learning rate and clipping factor (collective on
  // a replay step under ZeRO 1-3): peers recompute the owners' updates (UpdateCheck,
  // replay_update.h).
  void before_update(int64_t step, double lr, float grad_scale);
  // After the optimizer step (collective on a replay step): the parameters' hashes and the
  // recomputed updates'; stops as above on a mismatch.
  void check_parameters(int64_t step);
  // This rank's seconds spent replaying, hashing (its own pass's buckets too) and comparing in
  // the current step.
  double seconds() const;

 private:
  struct Impl;
  std::unique_ptr<Impl> impl_;
};

}  // namespace t3d::runtime
