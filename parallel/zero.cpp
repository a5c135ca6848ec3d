#include "parallel/zero.h"

#include <algorithm>

#include "kernels/check.h"

namespace t3d::parallel {

int64_t bucket_floats(double bucket_mb) {
  return std::max<int64_t>(1, static_cast<int64_t>(bucket_mb * (1 << 18)));
}

std::vector<FloatRange> make_buckets(const std::vector<FloatRange>& units, int64_t floats,
                                     std::vector<int>* units_per_bucket) {
  std::vector<FloatRange> buckets;
  units_per_bucket->clear();
  for (const auto& u : units) {
    if (buckets.empty() || buckets.back().size() >= floats) {
      buckets.push_back(u);
      units_per_bucket->push_back(0);
    }
    buckets.back().end = u.end;
    ++units_per_bucket->back();
  }
  return buckets;
}

int64_t slice_floats(int64_t floats, int size, int rank) {
  return floats * (rank + 1) / size - floats * rank / size;
}

BucketPartition::BucketPartition(std::vector<FloatRange> b, int size, int rank)
    : buckets(std::move(b)) {
  T3D_ASSERT(size >= 1 && rank >= 0 && rank < size, "rank ", rank, " of ", size);
  for (const auto& bucket : buckets) {
    std::vector<int> count(size), displ(size);
    for (int d = 0; d < size; ++d) {
      displ[d] = static_cast<int>(bucket.size() * d / size);
      count[d] = static_cast<int>(slice_floats(bucket.size(), size, d));
    }
    mine.push_back({bucket.begin + displ[rank], bucket.begin + displ[rank] + count[rank]});
    shard_offset.push_back(shard_floats);
    shard_floats += count[rank];
    largest_bucket = std::max(largest_bucket, bucket.size());
    counts.push_back(std::move(count));
    displs.push_back(std::move(displ));
  }
}

FullRegions full_regions(int zero) {
  T3D_ASSERT(zero >= 0 && zero <= 3, "ZeRO stage ", zero, " is not implemented");
  return {zero < 3, zero < 2, zero < 1};
}

StateBytes zero_state_bytes(int zero, const ZeroFloats& f, const StateBytesPerFloat& b) {
  const auto aligned = [](double bytes) {  // whole bytes: floats times bytes per float
    return static_cast<double>(kernels::aligned_bytes(static_cast<size_t>(bytes)));
  };
  const FullRegions full = full_regions(zero);
  const auto buffers = [&](int n, double bytes) { return n * aligned(f.largest_bucket * bytes); };
  StateBytes s;
  s.params = full.params ? f.region * b.weight
                         : aligned(f.owned * b.weight) + buffers(kGatherBuffers, b.weight);
  s.grads =
      full.grads ? f.region * b.grad : aligned(f.owned * b.grad) + buffers(kStagingBuffers, b.grad);
  s.optimizer = full.moments ? f.region * (b.master + 2 * b.moment)
                             : 2 * aligned(f.owned * b.moment) +
                                   (b.master > 0 ? aligned(f.owned * b.master) : 0);
  return s;
}

ZeroBuffers ZeroBuffers::allocate(int zero, const BucketPartition& p, kernels::Arena& arena) {
  const FullRegions full = full_regions(zero);
  ZeroBuffers z;
  const auto shard = static_cast<size_t>(p.shard_floats);
  const auto largest = static_cast<size_t>(p.largest_bucket);
  if (!full.params) {
    z.param_shard = arena.alloc_floats("parameters (ZeRO-3 shard)", shard);
    for (int g = 0; g < kGatherBuffers; ++g)
      z.gathered.push_back(
          arena.alloc_floats("parameters (ZeRO-3 gathered " + std::to_string(g) + ")", largest));
  }
  if (!full.grads) {
    z.grad_shard = arena.alloc_floats("gradients (ZeRO-2 shard)", shard);
    for (int s = 0; s < kStagingBuffers; ++s)
      z.staging.push_back(
          arena.alloc_floats("gradients (ZeRO-2 staging " + std::to_string(s) + ")", largest));
  }
  return z;
}

}  // namespace t3d::parallel
