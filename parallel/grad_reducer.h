// Data-parallel gradient reduction in buckets, overlapped with the backward (flashlight's Reducer:
// `ready` as gradients become final, then `finish`), and ZeRO's sharding of the optimizer step.
//
// The gradient region is cut into buckets, each a contiguous float range that becomes final at
// once (a layer, the embedding, the head: see Model's grad hook). A ready bucket starts a
// non-blocking all-reduce (ZeRO 0 and 1) or reduce-scatter (ZeRO 2) on the dp group at once, so
// the reduction of late layers runs while earlier layers are still in their backward.
//
// Ownership: every bucket is split into dp near-equal contiguous slices; dp rank d owns slice d.
// With ZeRO >= 1 a rank keeps optimizer state and runs AdamW only for what it owns, then
// `gather_params` all-gathers the updated slices. The same partition serves the gradient norm at
// every stage, so each gradient element is counted exactly once across the dp group.
#pragma once

#include <cstdint>
#include <vector>

#include "parallel/comm.h"

namespace t3d::parallel {

struct FloatRange {
  int64_t begin = 0, end = 0;  // [begin, end) in floats
  int64_t size() const { return end - begin; }
};

class GradReducer {
 public:
  GradReducer(const Comm& dp, int zero_stage, std::vector<FloatRange> buckets);
  ~GradReducer();
  GradReducer(const GradReducer&) = delete;
  GradReducer& operator=(const GradReducer&) = delete;

  const std::vector<FloatRange>& buckets() const { return buckets_; }
  // This dp rank's slice of every bucket (the ZeRO partition), in region order.
  const std::vector<FloatRange>& partition() const { return partition_; }
  // What this rank's optimizer updates: everything (ZeRO 0) or its partition (ZeRO >= 1).
  const std::vector<FloatRange>& owned() const { return zero_ > 0 ? partition_ : buckets_; }
  int64_t owned_floats() const;

  // Bucket `b`'s gradients in `grads` are final: start reducing them (non-blocking).
  void ready(int b, float* grads);
  void progress();  // let in-flight reductions advance (MPI progresses only inside MPI calls)
  // Waits for every bucket (each must have been made ready); afterwards the owned ranges of
  // `grads` hold the sums over dp.
  void finish(float* grads);
  // ZeRO >= 1: every rank's owned slices of `params` to every rank.
  void gather_params(float* params);

 private:
  const Comm& dp_;
  int zero_;
  std::vector<FloatRange> buckets_, partition_;
  std::vector<std::vector<int>> counts_, displs_;  // per bucket, per dp rank
  std::vector<MPI_Request> requests_;
  std::vector<char> started_;
};

}  // namespace t3d::parallel
