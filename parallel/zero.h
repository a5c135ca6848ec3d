// ZeRO (Rajbhandari et al. 2020) as data: how a flat parameter region is cut into buckets, how
// every bucket is split over a data-parallel group, and what one rank keeps under each stage.
// Pure (no MPI): the trainer's state (runtime/train/sharded_state.h), the gradient reducer
// (parallel/grad_reducer.h) and the planner's memory model all read these definitions.
//
//   stage 0   every rank keeps the whole region: parameters, gradients, AdamW moments.
//   stage 1   moments only for the rank's slice of every bucket ("owned", back to back).
//   stage 2   gradients too: an owned shard plus kStagingBuffers buffers of the largest bucket.
//   stage 3   parameters too: an owned shard plus kGatherBuffers buffers of the largest bucket.
#pragma once

#include <cstdint>
#include <string>
#include <vector>

#include "kernels/arena.h"

namespace t3d::parallel {

struct FloatRange {
  int64_t begin = 0, end = 0;  // [begin, end) in floats
  int64_t size() const { return end - begin; }
};

// ZeRO 2 staging buffers: one being written by the backward while one reduces.
inline constexpr int kStagingBuffers = 2;
// ZeRO 3 gather buffers: a unit's weights and the previous unit's (the LM head's forward reads
// the final norm and the head, which a tied embedding puts in another bucket).
inline constexpr int kGatherBuffers = 2;

// parallel.bucket_mb in floats (at least one).
int64_t bucket_floats(double bucket_mb);
// Consecutive units merged into buckets until each holds at least `floats` (the last may hold
// less). `units_per_bucket` receives how many units each bucket merged.
std::vector<FloatRange> make_buckets(const std::vector<FloatRange>& units, int64_t floats,
                                     std::vector<int>* units_per_bucket);
// Floats of rank `rank`'s slice of a bucket of `floats` split over `size` ranks.
int64_t slice_floats(int64_t floats, int size, int rank);

// Every bucket split over `size` ranks into near-equal contiguous slices; rank d owns slice d.
// Each element of the region is in exactly one rank's slice.
struct BucketPartition {
  BucketPartition() = default;
  BucketPartition(std::vector<FloatRange> buckets, int size, int rank);

  std::vector<FloatRange> buckets;
  // Per bucket, per rank: the slice's length and its offset from the bucket's start.
  std::vector<std::vector<int>> counts, displs;
  std::vector<FloatRange> mine;       // this rank's slice of every bucket, in region order
  std::vector<int64_t> shard_offset;  // per bucket: its slice's offset in a compact shard
  int64_t shard_floats = 0;           // floats of `mine`, back to back
  int64_t largest_bucket = 0;         // floats
};

// Which of the Model's full-size regions a rank keeps under ZeRO `zero` (the rest are shards).
struct FullRegions {
  bool params, grads, moments;
};
FullRegions full_regions(int zero);

// The floats a stage's memory depends on, and the bytes each kind of state takes per float.
struct ZeroFloats {
  double region = 0;          // the full parameter region (padding included)
  double owned = 0;           // this rank's slices (the BucketPartition's shard_floats)
  double largest_bucket = 0;  // one staging or gather buffer
};
struct StateBytesPerFloat {
  double weight = 4, grad = 4, moment = 4, master = 0;
};
struct StateBytes {
  double params = 0, grads = 0, optimizer = 0;
  double total() const { return params + grads + optimizer; }
};
// Arena bytes of parameters, gradients and optimizer state under ZeRO `zero`, each allocation
// rounded up to kernels::kAlignment as the arena does.
StateBytes zero_state_bytes(int zero, const ZeroFloats& floats, const StateBytesPerFloat& bytes);

// The arena allocations of a ZeRO stage beyond the Model's regions: gradient shard and staging
// buffers (stage >= 2), parameter shard and gather buffers (stage 3). Null where the stage
// keeps none.
struct ZeroBuffers {
  float* grad_shard = nullptr;
  std::vector<float*> staging;
  float* param_shard = nullptr;
  std::vector<float*> gathered;
  static ZeroBuffers allocate(int zero, const BucketPartition& partition, kernels::Arena& arena);
};

}  // namespace t3d::parallel
