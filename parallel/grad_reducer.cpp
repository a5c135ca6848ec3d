#include "parallel/grad_reducer.h"

#include <algorithm>
#include <cstring>

#include "kernels/check.h"
#include "kernels/ops.h"

namespace t3d::parallel {

GradReducer::GradReducer(const kernels::Exec& exec, const TensorComm& dp, int zero_stage,
                         const BucketPartition& partition, std::vector<int> units_per_bucket,
                         float* grads, const ZeroBuffers& buffers)
    : exec_(exec),
      dp_(dp),
      zero_(zero_stage),
      part_(partition),
      units_(std::move(units_per_bucket)),
      grads_(grads),
      shard_(buffers.grad_shard),
      param_shard_(buffers.param_shard) {
  T3D_ASSERT(zero_ >= 0 && zero_ <= 3, "ZeRO stage ", zero_, " is not implemented");
  T3D_ASSERT(units_.size() == part_.buckets.size(), "one unit count per bucket");
  T3D_ASSERT(part_.counts.empty() || static_cast<int>(part_.counts[0].size()) == dp_.size(),
             "the partition is over ", part_.counts[0].size(), " ranks, the group has ",
             dp_.size());
  const FullRegions full = full_regions(zero_);
  T3D_ASSERT(full.grads == (grads_ != nullptr) && full.grads == (shard_ == nullptr) &&
                 full.params == (param_shard_ == nullptr),
             "ZeRO ", zero_, ": the gradient region or the shards do not fit the stage");
  requests_.assign(part_.buckets.size(), Request{});
  pending_.assign(part_.buckets.size(), 0);
  open_.assign(part_.buckets.size(), -1);
  for (float* g : buffers.gathered) gathered_.push_back({g});
  for (float* s : buffers.staging) staging_.push_back({s});
}

GradReducer::~GradReducer() {
  for (auto& r : requests_) dp_.release(r);
  for (auto& s : staging_) dp_.release(s.request);
}

void GradReducer::begin_step(int micro_batches, bool local) {
  local_ = local;
  for (size_t b = 0; b < part_.buckets.size(); ++b) {
    T3D_ASSERT(open_[b] < 0, "bucket ", b, " still open at the start of a step");
    pending_[b] = units_[b] * micro_batches;
  }
  // With the rank's threads (kernels::zero): the gradient region is the largest memset of a step.
  if (zero_ >= 2)
    kernels::zero(exec_, shard_, part_.shard_floats);
  else if (!part_.buckets.empty())
    kernels::zero(exec_, grads_, part_.buckets.back().end);
}

float* GradReducer::bucket_grads(int b) {
  if (zero_ < 2) return grads_ + part_.buckets.at(b).begin;
  if (open_.at(b) >= 0) return staging_[open_[b]].data;
  auto free_buffer = [&] {
    for (int s = 0; s < kStagingBuffers; ++s)
      if (staging_[s].bucket < 0 && !staging_[s].reducing) return s;
    return -1;
  };
  int s = free_buffer();
  if (s < 0 && reducing_.empty()) {
    // Every buffer holds an open bucket (micro-batches interleave over buckets, as GPipe's head or
    // interleaved chunks do): reduce the oldest as it is.
    int oldest = 0;
    for (int i = 1; i < kStagingBuffers; ++i)
      if (staging_[i].opened < staging_[oldest].opened) oldest = i;
    flush(oldest, true);
  }
  if (s < 0) {
    complete_oldest();
    s = free_buffer();
  }
  T3D_ASSERT(s >= 0, "no ZeRO-2 staging buffer free after a reduction completed");
  Staging& st = staging_[s];
  kernels::zero(exec_, st.data, part_.buckets[b].size());
  st.bucket = b;
  st.reported = 0;
  st.opened = opened_++;
  open_[b] = s;
  return st.data;
}

void GradReducer::unit_done(int b) {
  T3D_ASSERT(pending_.at(b) > 0, "bucket ", b, " reported more units than it has micro-batches");
  --pending_[b];
  // Every report lets the reductions in flight advance, the one just started too: MPI moves
  // them only inside MPI calls, and the backward makes none between two units.
  if (zero_ < 2) {
    if (pending_[b] == 0) start_reduce(b);
    progress();
    return;
  }
  // A bucket flushed early (all buffers were busy) may get a unit's report after its data left.
  if (open_[b] >= 0 && ++staging_[open_[b]].reported == units_[b]) flush(open_[b], false);
  progress();
}

void GradReducer::start_reduce(int b) {
  if (before_) before_(b, grads_ + part_.buckets[b].begin);
  if (local_) return;
  ++reductions_;
  if (dp_.size() == 1) return;
  requests_[b] = dp_.iall_reduce_sum(grads_ + part_.buckets[b].begin,
                                     static_cast<size_t>(part_.buckets[b].size()),
                                     "all_reduce (gradient bucket)", b);
}

void GradReducer::flush(int s, bool early) {
  Staging& st = staging_[s];
  const int b = st.bucket;
  reductions_ += !local_;
  early_ += early && !local_;
  open_[b] = -1;
  if (before_) before_(b, st.data);
  st.reducing = true;
  reducing_.push_back(s);
  if (dp_.size() == 1 || local_) return;
  // In place: the input is the whole bucket; this rank's reduced slice lands at its start.
  st.request =
      dp_.ireduce_scatter_sum(st.data, part_.counts[b], "reduce_scatter (gradient bucket)", b);
}

void GradReducer::accumulate(const Staging& st) {
  if (local_) return;  // a replayed pass's gradients reach no shard
  const int b = st.bucket;
  // dp = 1 skips the reduce-scatter: the slice is the whole bucket, still at its own offset.
  const float* from = dp_.size() == 1 ? st.data + part_.displs[b][dp_.rank()] : st.data;
  float* to = shard_ + part_.shard_offset[b];
  const int64_t n = part_.counts[b][dp_.rank()];
  kernels::add_inplace(exec_, to, from, n);
}

void GradReducer::complete_oldest() {
  const int s = reducing_.front();
  reducing_.pop_front();
  Staging& st = staging_[s];
  if (st.request.pending) dp_.wait(st.request, "gradient reduce_scatter");
  accumulate(st);
  st.bucket = -1;
  st.reducing = false;
}

void GradReducer::progress() {
  if (zero_ < 2) {
    for (auto& r : requests_) dp_.test(r);
    return;
  }
  // Oldest first only: two reductions of one bucket must reach the shard in a fixed order, or
  // the sum's rounding would depend on timing.
  while (!reducing_.empty()) {
    if (!dp_.test(staging_[reducing_.front()].request)) break;
    complete_oldest();
  }
}

void GradReducer::finish() {
  for (size_t b = 0; b < part_.buckets.size(); ++b)
    T3D_ASSERT(pending_[b] == 0, "bucket ", b, " is missing ", pending_[b],
               " unit report(s): a layer's gradients were not computed");
  if (zero_ >= 2) {
    // Buckets still open (flushed early, then written again): reduce them, in bucket order.
    for (size_t b = 0; b < part_.buckets.size(); ++b)
      if (open_[b] >= 0) flush(open_[b], true);
    while (!reducing_.empty()) complete_oldest();
    return;
  }
  for (size_t b = 0; b < part_.buckets.size(); ++b) {
    if (!requests_[b].pending) continue;
    dp_.wait(requests_[b], "gradient all_reduce");
  }
}

void GradReducer::gather_params(float* params) {
  if (zero_ == 3) {
    for (auto& g : gathered_) g.bucket = -1;
    return;
  }
  if (zero_ == 0 || dp_.size() == 1) return;
  for (size_t b = 0; b < part_.buckets.size(); ++b)
    requests_[b] =
        dp_.iall_gatherv(nullptr, params + part_.buckets[b].begin, part_.counts[b], part_.displs[b],
                         "all_gather (parameters, ZeRO)", static_cast<int64_t>(b));
  for (auto& r : requests_) dp_.wait(r, "parameter all_gather (ZeRO)");
}

const float* GradReducer::bucket_params(int b) {
  T3D_ASSERT(zero_ == 3, "only ZeRO-3 gathers parameters");
  Gathered* slot = &gathered_[0];
  for (auto& g : gathered_) {
    if (g.bucket == b) {
      g.used = ++uses_;
      return g.data;
    }
    if (g.used < slot->used) slot = &g;
  }
  // Evict the least recently used buffer and gather bucket b into it.
  slot->bucket = b;
  slot->used = ++uses_;
  ++gathers_;
  const int me = dp_.rank();
  const float* mine = param_shard_ + part_.shard_offset[b];
  if (dp_.size() == 1) {
    kernels::copy(exec_, slot->data, mine, part_.counts[b][me]);
    return slot->data;
  }
  Request request = dp_.iall_gatherv(mine, slot->data, part_.counts[b], part_.displs[b],
                                     "all_gather (parameter bucket, ZeRO-3)", b);
  dp_.wait(request, "parameter all_gather (ZeRO-3)");
  return slot->data;
}

}  // namespace t3d::parallel
