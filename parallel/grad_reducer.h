// Data-parallel gradient reduction in buckets, overlapped with the backward (flashlight's Reducer:
// a bucket is started as its gradients become final, `finish` waits for the rest), and ZeRO's
// sharding of gradients and of the optimizer step.
//
// The gradient region is cut into buckets, each a contiguous float range of gradient units (a
// layer, the embedding, the head: see Model's grad hook). Each unit reports once per micro-batch.
//
// Which slice of every bucket a rank owns, and where shards and buffers live, is the caller's
// (parallel/zero.h: BucketPartition and ZeroBuffers; runtime/train/sharded_state.h owns them for
// training): the reducer only moves bytes. With ZeRO >= 1 a rank keeps optimizer state and runs
// AdamW only for what it owns, then `gather_params` all-gathers the updated slices.
//
// ZeRO 0 and 1: micro-batches accumulate into the full-size gradient region; a bucket's
// all-reduce (non-blocking) starts once every micro-batch has reported all of its units.
//
// ZeRO 2 (DeepSpeed stage 2): there is no full-size gradient region. A rank keeps its owned
// slices back to back (the shard, about 1/dp of the gradients) and a small pool of staging
// buffers, each the size of the largest bucket. A bucket written by the backward gets a zeroed
// staging buffer; once its units have reported (normally: once per micro-batch) it is
// reduce-scattered non-blocking, and when that completes this rank's slice is added to the shard
// and the buffer is free for the next bucket. When all buffers are busy, the oldest reduction is
// waited for, or, if none is in flight, the oldest open bucket is reduced as it is: sums are
// linear, so reducing a bucket in several parts gives the same gradients (up to the order of
// additions). Every decision depends only on the sequence of bucket_grads / unit_done calls,
// which is the same on every rank of the dp group (same stage, same schedule), so the
// collectives match.
//
// ZeRO 3 adds the parameters: a rank keeps only its slices of them (the parameter shard, laid out
// like the gradient shard) and the optimizer updates them there. Whenever the model reads a
// unit's weights (forward, and again in the backward) the unit's bucket is all-gathered into one
// of two gather buffers (the size of the largest bucket), unless one still holds it; an
// optimizer step invalidates them. Gathers are blocking (no prefetch yet): exact, not overlapped.
#pragma once

#include <cstdint>
#include <deque>
#include <functional>
#include <vector>

#include "kernels/exec.h"
#include "parallel/tensor_comm.h"
#include "parallel/zero.h"

namespace t3d::parallel {

class GradReducer {
 public:
  // `partition` (which must outlive the reducer) over `dp`'s ranks. `grads`: the full-size
  // gradient region (ZeRO 0 and 1), nullptr with ZeRO 2 and 3, which use `buffers` (the shard
  // and staging buffers; ZeRO 3 also the parameter shard and gather buffers).
  GradReducer(const kernels::Exec& exec, const TensorComm& dp, int zero_stage,
              const BucketPartition& partition, std::vector<int> units_per_bucket, float* grads,
              const ZeroBuffers& buffers);
  ~GradReducer();
  GradReducer(const GradReducer&) = delete;
  GradReducer& operator=(const GradReducer&) = delete;

  const std::vector<FloatRange>& buckets() const { return part_.buckets; }

  // Called before a bucket's data is reduced (sequence parallelism sums replicated norm weight
  // gradients over tp there): bucket index and the bucket's first float.
  void set_before_reduce(std::function<void(int b, float* data)> fn) { before_ = std::move(fn); }

  // Start of a step of `micro_batches`: zeroes the gradients (region or shard). `local`: a
  // replayed pass (runtime/train/replay.h): every bucket still goes through the before-reduce
  // hook when it would start, is then left where it is (no collective, nothing added to the
  // shard) and is zeroed by the next begin_step; ZeRO-3's parameter gathers stay collective, so
  // every rank of the group must replay alongside.
  void begin_step(int micro_batches, bool local = false);
  // Where bucket b's gradients accumulate now (its first float): the region, or with ZeRO 2 its
  // staging buffer, taken from the pool and zeroed if it had none. Valid until the next call.
  float* bucket_grads(int b);
  // A micro-batch has added its gradient to one unit of bucket b.
  void unit_done(int b);
  void progress();  // let in-flight reductions advance (MPI progresses only inside MPI calls)
  // Waits for every bucket (each unit must have reported once per micro-batch); afterwards the
  // region (ZeRO 0, 1: every float) or the shard (ZeRO 2, 3: this rank's slices back to back)
  // holds the sums over dp of the slices this rank owns.
  void finish();
  // ZeRO 1, 2: every rank's owned slices of `params` to every rank. ZeRO 3: the parameter shard
  // changed, so the gathered buffers are stale.
  void gather_params(float* params);

  // ZeRO 3: bucket b's full parameters (its first float), gathered over dp from the parameter
  // shards if no gather buffer holds them. Valid until the next call.
  const float* bucket_params(int b);
  int64_t gathers() const { return gathers_; }
  // Bucket reductions started so far, and how many of them reduced a ZeRO-2 bucket before all its
  // units had reported (all staging buffers were busy, or left open at the end of a step).
  int64_t reductions() const { return reductions_; }
  int64_t early_reductions() const { return early_; }

 private:
  struct Staging {
    float* data = nullptr;
    int bucket = -1;   // bucket it holds, -1 when free
    int reported = 0;  // unit_done calls since it was taken
    bool reducing = false;
    Request request;
    uint64_t opened = 0;  // order taken, to pick the oldest
  };
  void start_reduce(int b);            // ZeRO 0, 1: all-reduce in the region
  void flush(int s, bool early);       // ZeRO 2: start reducing staging buffer s
  void complete_oldest();              // ZeRO 2: wait for the oldest reduction, add, free
  void accumulate(const Staging& st);  // ZeRO 2: this rank's reduced slice into the shard

  kernels::Exec exec_;  // where the buffers are and the reducer's own copies and sums run
  const TensorComm& dp_;
  int zero_;
  const BucketPartition& part_;
  std::vector<int> units_;
  std::vector<Request> requests_;
  std::vector<int> pending_;  // per bucket: unit reports still to come this step
  float* grads_ = nullptr;    // ZeRO 0, 1
  float* shard_ = nullptr;    // ZeRO 2: owned slices back to back
  std::vector<Staging> staging_;
  std::vector<int> open_;     // per bucket: staging buffer index or -1
  std::deque<int> reducing_;  // staging buffers in flight, oldest first
  uint64_t opened_ = 0;
  int64_t reductions_ = 0, early_ = 0;  // not counting local passes
  bool local_ = false;                  // this step's pass is local (begin_step)
  // ZeRO 3
  struct Gathered {
    float* data = nullptr;
    int bucket = -1;
    uint64_t used = 0;  // last use, to evict the least recent
  };
  const float* param_shard_ = nullptr;
  std::vector<Gathered> gathered_;
  uint64_t uses_ = 0;
  int64_t gathers_ = 0;
  std::function<void(int, float*)> before_;
};

}  // namespace t3d::parallel
