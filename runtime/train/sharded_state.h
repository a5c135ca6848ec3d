// The training state this rank updates, one owner for all of it: per state group (model_spec.h:
// the dense parameters, a mixture of experts' routed experts) a ShardedState, the ZeRO partition
// of the group's part of the Model's flat parameter region over the group's data-parallel ranks,
// the shards and buffers each stage keeps (parallel/zero.h), the AdamW moments, and the gradient
// reducer that moves bucket bytes between them (parallel/grad_reducer.h). TrainingState holds the
// groups; it initialises, restores and reports that state, and the trainer and the snapshotter
// walk it without knowing the ZeRO stage or the groups.
//
// A group's data-parallel ranks: dp × cp (Mesh::dp_cp) for the dense group; for the experts the
// ranks that hold the same experts (the expert-data-parallel group: dp × cp when parallel.ep =
// 1). "dp rank" below means a rank of the group's.
//
//   ZeRO 0   owns everything; parameters, gradients and moments are the Model's regions.
//   ZeRO 1   owns its dp slice of every bucket (partition()); moments are a shard holding the
//            owned ranges back to back ("compact"); gradients, parameters regions.
//   ZeRO 2   gradients are a compact shard too.
//   ZeRO 3   parameters are a compact shard too (gathered bucket by bucket for the model).
//
// Everything that walks the owned state — AdamW, gradient clipping, the global gradient norm,
// the snapshot boxes — walks it through for_each_piece: (tensor, part of the region, its offset
// in a compact array), tensors in the Model's order, ranges inside.
#pragma once

#include <cstdint>
#include <functional>
#include <memory>
#include <vector>

#include "checkpoint/snapshot.h"
#include "kernels/arena.h"
#include "parallel/grad_reducer.h"
#include "parallel/zero.h"
#include "runtime/model/model.h"
#include "runtime/recipe/recipe.h"

namespace t3d::runtime {

class ShardedState {
 public:
  // `model` built with the regions parallel::full_regions(zero) keeps (build_stage does). Cuts
  // the gradient units of `kind` into buckets of about `bucket_mb`, partitions them over
  // `group`, allocates this rank's shards, buffers and moments (zeroed) from `arena`, and points
  // the model's gradient source and hook (ZeRO 3: its weight source) of `kind` at the reducer.
  // The model holds units of `kind`.
  ShardedState(Model& model, StateGroup kind, const parallel::TensorComm& group, int zero,
               double bucket_mb, kernels::Arena& arena);
  ~ShardedState();
  ShardedState(const ShardedState&) = delete;
  ShardedState& operator=(const ShardedState&) = delete;

  // ZeRO 3: keeps this rank's slices of `n` initial values (host memory) of the parameter region
  // from float `offset` on (TrainingState::init, one tensor at a time).
  void keep_shard(int64_t offset, const float* values, int64_t n);
  // After the stores were initialised or restored: makes every rank's parameters current (ZeRO
  // 3: the gathered buffers are stale).
  void restored();
  StateGroup kind() const { return kind_; }
  int zero() const { return zero_; }
  int group_size() const { return group_.size(); }  // the group's data-parallel ranks
  bool param_shard() const { return buffers_.param_shard != nullptr; }

  parallel::GradReducer& reducer() { return *reducer_; }
  // Each bucket as its reduction starts (after sequence parallelism's sum over tp, before any
  // collective), for the replay's hashes (replay.h): bucket index, first float, floats. Empty:
  // none.
  using BucketTap = std::function<void(int bucket, const float* data, int64_t n)>;
  void set_tap(BucketTap tap) { tap_ = std::move(tap); }
  // T3D_FAULT=flip:...:grad (parallel/fault.h): bit `bit` of the middle float of the next bucket
  // whose reduction starts is flipped, before the tap sees it.
  void arm_grad_flip(int bit) { flip_bit_ = bit; }
  // T3D_FAULT=flip:...:update: bit `bit` of the middle float of the first tensor piece the next
  // adamw_step updates is flipped after the update and before the all-gather hands it on (an
  // owner's wrong arithmetic).
  void arm_update_flip(int bit) { update_flip_bit_ = bit; }
  // What the optimizer updates: everything (ZeRO 0) or this dp rank's partition.
  const std::vector<parallel::FloatRange>& owned() const {
    return zero_ > 0 ? partition_.mine : partition_.buckets;
  }
  // This dp rank's slice of every bucket: each element of the region in exactly one dp rank's
  // partition (the norm counts each once).
  const std::vector<parallel::FloatRange>& partition() const { return partition_.mine; }
  // Group rank `r`'s partition (partition() is this rank's), and the group over which it is
  // partitioned: a peer recomputes the owner's update from them (replay_update.h).
  std::vector<parallel::FloatRange> partition_of(int r) const;
  const parallel::TensorComm& group() const { return group_; }

  // Arena bytes of parameters, gradients and optimizer state this rank keeps
  // (parallel::zero_state_bytes, the planner's rule).
  parallel::StateBytes footprint() const;
  // This rank's log: the stage's shards and buffers; rank 0 also warns when ZeRO-2's staging
  // buffers outweigh the shard. After training: the reducer's counters.
  void log_footprint(bool rank0) const;
  void log_counters() const;

  // One tensor's part of a walk over `ranges`: the tensor (index into Model::params()), floats
  // [lo, hi) of the region, and `at`, lo's offset in an array holding the ranges back to back.
  struct Piece {
    size_t param;
    int64_t lo, hi, at;
    int64_t size() const { return hi - lo; }
  };
  void for_each_piece(const std::vector<parallel::FloatRange>& ranges,
                      const std::function<void(const Piece&)>& fn) const;

  // Where a piece of owned() (or, equal with ZeRO >= 1, of partition()) lives.
  float* params(const Piece& p) const;
  float* grads(const Piece& p) const;
  float* exp_avg(const Piece& p) const;
  float* exp_avg_sq(const Piece& p) const;

  // An array of the region's `ranges` back to back (sharded), or the region whole: what a
  // snapshot stages and restores.
  struct Store {
    std::vector<parallel::FloatRange> ranges;
    float* data = nullptr;
    int64_t floats = 0;
    bool sharded = false;
  };
  Store param_store() const;
  Store exp_avg_store() const;
  Store exp_avg_sq_store() const;
  int64_t moment_floats() const { return exp_avg_store().floats; }

  // This rank's boxes of the global tensors in a snapshot ("model/<name>", "optim/exp_avg/<name>",
  // "optim/exp_avg_sq/<name>"), the data in the stores. Writing (`only_owned`), every box gets
  // exactly one writer among the group's ranks (which hold this stage, tp shard and experts):
  // tensor i of an unsharded store by rank i mod size, a sharded store's pieces by the rank that
  // owns them, tp-replicated tensors by tp rank 0. Reading, a rank asks for everything it holds,
  // whatever layout wrote the snapshot.
  std::vector<checkpoint::Slice> boxes(bool only_owned) const;

  // The gradient pieces of partition() whose squares the global norm sums, appended in order:
  // tp-replicated tensors on tp rank 0 only, so the sum over dp, tp and pp is the global sum
  // exactly.
  void add_grad_pieces(std::vector<const float*>& ranges, std::vector<int64_t>& sizes) const;
  // AdamW over owned(), each piece with its tensor's weight decay (train.weight_decay for
  // matrices, none for norms: ParamInfo::decay), on the gradients times `grad_scale` (clipping;
  // folded into the update, so the stored gradients stay unscaled); then gathers the updated
  // parameters. The router biases (ParamInfo::router_bias) are left to RouterBalance
  // (router_balance.h), which applies their step to the owned pieces before this.
  void adamw_step(const TrainConfig& t, double lr, int64_t step, float grad_scale);
  // Whether adamw_step updates piece `p` (not a router bias), and its settings for it (the
  // tensor's weight decay): what a recomputation of the update needs besides the arrays.
  bool updates(const Piece& p) const;
  kernels::AdamWConfig adamw_config(const TrainConfig& t, double lr, float grad_scale,
                                    const Piece& p) const;

 private:
  Store store(const std::vector<parallel::FloatRange>& ranges, float* shard, float* region) const;

  void attach_to_model();

  Model& model_;
  StateGroup kind_;
  parallel::FloatRange region_;  // the group's part of the Model's region
  const parallel::TensorComm& group_;
  int zero_;
  double bucket_mb_;
  parallel::BucketPartition partition_;
  std::vector<int> units_per_bucket_;
  parallel::ZeroBuffers buffers_;
  std::unique_ptr<parallel::GradReducer> reducer_;
  float* m_shard_ = nullptr;  // ZeRO >= 1: the owned ranges' moments back to back
  float* v_shard_ = nullptr;
  BucketTap tap_;
  int flip_bit_ = -1;         // armed grad flip, -1: none
  int update_flip_bit_ = -1;  // armed update flip, -1: none
};

// Every state group of this rank's Model, each a ShardedState over its own ranks.
class TrainingState {
 public:
  // The dense group over `dense_group` (dp × cp), the experts (when the Model holds any) over
  // `experts_group` (the expert-data-parallel ranks), both with the same ZeRO stage and bucket
  // size.
  TrainingState(Model& model, const parallel::TensorComm& dense_group,
                const parallel::TensorComm& experts_group, int zero, double bucket_mb,
                kernels::Arena& arena);

  // Parameters from `seed` (Model::init); with ZeRO 3 each tensor is drawn on the host and each
  // group keeps its rank's slices of it.
  void init(uint64_t seed);
  // After a snapshot was read into the stores (ShardedState::restored).
  void restored();

  const std::vector<std::unique_ptr<ShardedState>>& groups() const { return groups_; }
  ShardedState& dense() const { return *groups_.front(); }
  // Where the state lives and its ops run: the Model's.
  const kernels::Exec& exec() const { return model_.exec(); }

  // A step's gradient reductions (parallel::GradReducer), every group's; `local`: a replayed
  // pass, reduced nowhere (GradReducer::begin_step).
  void begin_step(int micro_batches, bool local = false);
  void finish_step();

  parallel::StateBytes footprint() const;  // the groups' together
  void log_footprint(bool rank0) const;
  void log_counters() const;
  std::vector<checkpoint::Slice> boxes(bool only_owned) const;  // the groups' together
  // Over every group's partition(): summed over the world, the global sum exactly (each element
  // once). One wait for all groups (kernels::sum_of_squares_each).
  double grad_sum_of_squares() const;
  void adamw_step(const TrainConfig& t, double lr, int64_t step, float grad_scale);

 private:
  Model& model_;
  std::vector<std::unique_ptr<ShardedState>> groups_;
};

}  // namespace t3d::runtime
