// GradReducer on 2 ranks against sums computed directly. Every contribution is a small integer, so
// float sums are exact in any order and results are compared with ==. Orders of writes follow the
// schedules that stress ZeRO-2's staging pool: micro-batches one after another (1F1B), one unit
// written for every micro-batch before the others (GPipe's LM head), and a unit written in two
// parts far apart (zero-bubble's B then W).
#include <gtest/gtest.h>
#include <mpi.h>

#include <algorithm>
#include <vector>

#include "kernels/arena.h"
#include "kernels/check.h"
#include "parallel/comm.h"
#include "parallel/grad_reducer.h"
#include "parallel/zero.h"

namespace t3d::parallel {
namespace {

// Units of a small "model": sizes chosen so buckets of >= 8 floats merge some units and the
// slices over 2 ranks are uneven.
std::vector<FloatRange> units() {
  std::vector<FloatRange> u;
  int64_t at = 0;
  for (int64_t n : {5, 7, 3, 11, 2, 9}) {
    u.push_back({at, at + n});
    at += n;
  }
  return u;
}

float contribution(int rank, int mb, int64_t i) { return float(1 + rank + 3 * mb + 7 * (i % 5)); }

// One write phase: `unit`'s floats [lo, hi) for micro-batch `mb`, then its report when `report`.
struct Phase {
  int unit, mb;
  double lo = 0, hi = 1;  // fraction of the unit written
  bool report = true;
};

std::vector<Phase> sequential(int n_units, int micro) {  // 1F1B: backward walks units down
  std::vector<Phase> p;
  for (int mb = 0; mb < micro; ++mb)
    for (int u = n_units - 1; u >= 0; --u) p.push_back({u, mb});
  return p;
}

std::vector<Phase> head_first(int n_units, int micro) {  // GPipe: the last unit in every forward
  std::vector<Phase> p;
  for (int mb = 0; mb < micro; ++mb) p.push_back({n_units - 1, mb});
  for (int mb = micro - 1; mb >= 0; --mb)
    for (int u = n_units - 2; u >= 0; --u) p.push_back({u, mb});
  return p;
}

// Zero-bubble: B writes part of units 4 and 2 (their norm weights), W the rest after the
// micro-batch's other units.
std::vector<Phase> split_units(int n_units, int micro) {
  std::vector<Phase> p;
  for (int mb = 0; mb < micro; ++mb) {
    for (int u = n_units - 1; u >= 0; --u) {
      if (u == 4 || u == 2)
        p.push_back({u, mb, 0.0, 0.5, false});
      else
        p.push_back({u, mb});
    }
    p.push_back({4, mb, 0.5, 1.0, true});
    p.push_back({2, mb, 0.5, 1.0, true});
  }
  return p;
}

struct Result {
  std::vector<float> owned;  // owned ranges back to back
  int64_t early = 0;
};

// `replay`: every step is preceded by a local pass of the same writes (a replay,
// GradReducer::begin_step), whose buckets the before-reduce hook must see holding this rank's own
// sums (over all the times each bucket is handed over), and which must leave no trace in the step.
Result run(const Comm& dp, int zero, int64_t bucket_floats, const std::vector<Phase>& phases,
           int micro, int steps = 2, bool replay = false) {
  const auto u = units();
  std::vector<int> per_bucket;
  auto buckets = make_buckets(u, bucket_floats, &per_bucket);
  std::vector<int> bucket_of;
  for (const auto& unit : u) {
    int b = 0;
    while (unit.begin >= buckets[b].end) ++b;
    bucket_of.push_back(b);
  }
  kernels::Arena arena(1 << 20);
  std::vector<float> region(static_cast<size_t>(u.back().end));
  const BucketPartition part(buckets, dp.size(), dp.rank());
  const ZeroBuffers buffers = ZeroBuffers::allocate(zero, part, arena);
  GradReducer reducer(kernels::kCpu, dp, zero, part, per_bucket,
                      zero >= 2 ? nullptr : region.data(), buffers);
  const bool compact = zero >= 2;
  const std::vector<FloatRange>& owned = zero > 0 ? part.mine : part.buckets;
  Result result;
  std::vector<float> seen(region.size());  // a local pass's buckets as the hook saw them, summed
  bool local = false;
  reducer.set_before_reduce([&](int b, float* data) {
    if (local)
      for (int64_t i = 0; i < buckets[b].size(); ++i) seen[buckets[b].begin + i] += data[i];
  });
  const auto pass = [&] {
    reducer.begin_step(micro, local);
    for (const auto& ph : phases) {
      const FloatRange& unit = u[ph.unit];
      const int b = bucket_of[ph.unit];
      float* at = reducer.bucket_grads(b) + (unit.begin - buckets[b].begin);
      const auto lo = static_cast<int64_t>(ph.lo * unit.size());
      const auto hi = static_cast<int64_t>(ph.hi * unit.size());
      for (int64_t i = lo; i < hi; ++i) at[i] += contribution(dp.rank(), ph.mb, unit.begin + i);
      if (ph.report) reducer.unit_done(b);
    }
    reducer.finish();
  };
  for (int step = 0; step < steps; ++step) {  // the second step must not see the first's sums
    if (replay) {
      local = true;
      std::fill(seen.begin(), seen.end(), 0.0f);
      const int64_t reductions = reducer.reductions();
      pass();
      EXPECT_EQ(reducer.reductions(), reductions) << "a local pass counts no reduction";
      for (size_t i = 0; i < seen.size(); ++i) {
        float want = 0;
        for (int mb = 0; mb < micro; ++mb) want += contribution(dp.rank(), mb, int64_t(i));
        EXPECT_EQ(seen[i], want) << "zero " << zero << " local pass, element " << i;
      }
      local = false;
    }
    pass();
  }
  const float* g = compact ? buffers.grad_shard : region.data();
  int64_t at = 0;
  for (const auto& r : owned) {
    for (int64_t i = r.begin; i < r.end; ++i)
      result.owned.push_back(compact ? g[at + i - r.begin] : g[i]);
    at += r.size();
  }
  // The expected sums over ranks and micro-batches, element by element.
  int64_t k = 0;
  for (const auto& r : owned)
    for (int64_t i = r.begin; i < r.end; ++i, ++k) {
      float want = 0;
      for (int d = 0; d < dp.size(); ++d)
        for (int mb = 0; mb < micro; ++mb) want += contribution(d, mb, i);
      EXPECT_EQ(result.owned[k], want) << "zero " << zero << " element " << i;
    }
  result.early = reducer.early_reductions();
  if (zero == 2) {  // the gradient memory is the shard plus the staging buffers, nothing more
    int64_t largest = 0, shard = 0;
    for (size_t b = 0; b < buckets.size(); ++b) {
      largest = std::max(largest, buckets[b].size());
      shard += slice_floats(buckets[b].size(), dp.size(), dp.rank());
    }
    const auto aligned = [](int64_t floats) { return (floats * 4 + 63) / 64 * 64; };
    EXPECT_EQ(arena.used(), size_t(aligned(shard) + kStagingBuffers * aligned(largest)));
    EXPECT_EQ(shard, part.shard_floats);
    EXPECT_EQ(
        zero_state_bytes(2, {double(region.size()), double(shard), double(largest)}, {}).grads,
        double(arena.used()));
  }
  return result;
}

TEST(GradReducer, BucketsAndSlices) {
  std::vector<int> per;
  const auto b = make_buckets(units(), 8, &per);
  ASSERT_EQ(b.size(), 3u);  // {5,7} {3,11} {2,9}: merged until >= 8
  EXPECT_EQ(b[0].begin, 0);
  EXPECT_EQ(b[0].end, 12);
  EXPECT_EQ(b[1].end, 26);
  EXPECT_EQ(per, (std::vector<int>{2, 2, 2}));
  EXPECT_EQ(b[2].end, 37);
  EXPECT_EQ(slice_floats(7, 2, 0) + slice_floats(7, 2, 1), 7);
  EXPECT_EQ(slice_floats(7, 2, 0), 3);
}

TEST(GradReducer, EveryStageSumsExactly) {
  Comm dp = Comm::world(60.0);
  ASSERT_EQ(dp.size(), 2);
  const int n = static_cast<int>(units().size()), micro = 3;
  for (int zero : {0, 1, 2})
    for (int64_t bucket : {1, 8, 100}) {
      SCOPED_TRACE("zero " + std::to_string(zero) + " bucket " + std::to_string(bucket));
      run(dp, zero, bucket, sequential(n, micro), micro);
      run(dp, zero, bucket, head_first(n, micro), micro);
      run(dp, zero, bucket, split_units(n, micro), micro);
    }
}

// A replay's local pass (runtime/train/replay.h) hands every bucket to the hook with this rank's
// own gradients, reduces nothing, and the step after it sums exactly as without it (checked in
// run). Each rank's local sums differ from the other's, so a reduction would show.
TEST(GradReducer, LocalPassReducesNothingAndLeavesTheStepAsItWas) {
  Comm dp = Comm::world(60.0);
  const int n = static_cast<int>(units().size()), micro = 3;
  for (int zero : {0, 1, 2})
    for (int64_t bucket : {1, 8, 100}) {
      SCOPED_TRACE("zero " + std::to_string(zero) + " bucket " + std::to_string(bucket));
      run(dp, zero, bucket, sequential(n, micro), micro, 2, true);
      run(dp, zero, bucket, split_units(n, micro), micro, 2, true);
    }
}

TEST(GradReducer, ZeroTwoReducesEarlyOnlyWhenThePoolIsExhausted) {
  Comm dp = Comm::world(60.0);
  const int n = static_cast<int>(units().size()), micro = 3;
  // One bucket per unit, written one micro-batch at a time: each reduced once per micro-batch.
  EXPECT_EQ(run(dp, 2, 1, sequential(n, micro), micro, 1).early, 0);
  // Two units wait for their W while a third is written: both buffers hold open buckets, so the
  // oldest is reduced as it is (and again after its W), still exactly (checked inside run).
  EXPECT_GT(run(dp, 2, 1, split_units(n, micro), micro, 1).early, 0);
}

// ZeRO-3: scattering a full region into the shards and gathering every bucket back gives the
// region, whatever order buckets are asked in; the two gather buffers serve repeats without a
// collective, and gather_params (after an optimizer step) makes them gather again.
TEST(GradReducer, ZeroThreeGathersTheParameters) {
  Comm dp = Comm::world(60.0);
  kernels::Arena arena(1 << 20);
  std::vector<int> per;
  auto buckets = make_buckets(units(), 8, &per);
  const BucketPartition part(buckets, dp.size(), dp.rank());
  const ZeroBuffers buffers = ZeroBuffers::allocate(3, part, arena);
  GradReducer reducer(kernels::kCpu, dp, 3, part, per, nullptr, buffers);
  std::vector<float> full(static_cast<size_t>(buckets.back().end));
  for (size_t i = 0; i < full.size(); ++i) full[i] = float(i) * 0.5f - 3.0f;
  for (size_t b = 0; b < buckets.size(); ++b)  // this rank's slices (ShardedState::keep_shard)
    std::copy_n(full.data() + part.mine[b].begin, part.mine[b].size(),
                buffers.param_shard + part.shard_offset[b]);
  int64_t shard = 0;
  for (const auto& r : part.mine) shard += r.size();
  EXPECT_EQ(shard, part.shard_floats);
  EXPECT_LT(shard, static_cast<int64_t>(full.size()));  // a slice, not everything
  const auto expect_bucket = [&](int b) {
    const float* got = reducer.bucket_params(b);
    for (int64_t i = 0; i < buckets[b].size(); ++i)
      ASSERT_EQ(got[i], full[static_cast<size_t>(buckets[b].begin + i)]) << "bucket " << b;
  };
  for (int b : {2, 1, 0, 1, 0, 2}) expect_bucket(b);
  EXPECT_EQ(reducer.gathers(), 4);  // 2, 1, 0 gathered; 1, 0 cached; 2 gathered again
  // An update of the shard (as the optimizer makes) must reach the next gather.
  for (int64_t i = 0; i < shard; ++i) buffers.param_shard[i] += 1.0f;
  for (auto& x : full) x += 1.0f;  // the units leave no gaps: every float is in a slice
  reducer.gather_params(nullptr);
  for (int b : {0, 2, 1}) expect_bucket(b);
  EXPECT_EQ(reducer.gathers(), 7);
}

TEST(GradReducer, MissingUnitIsReported) {
  Comm world = Comm::world(60.0);
  const Comm dp = world.split(world.rank(), 0, "alone");  // no collective left in flight
  kernels::Arena arena(1 << 20);
  std::vector<int> per;
  auto buckets = make_buckets(units(), 8, &per);
  const BucketPartition part(buckets, dp.size(), dp.rank());
  GradReducer reducer(kernels::kCpu, dp, 2, part, per, nullptr,
                      ZeroBuffers::allocate(2, part, arena));
  reducer.begin_step(1);
  reducer.bucket_grads(0);
  reducer.unit_done(0);  // bucket 0 has two units: one report short
  for (int b = 1; b < 3; ++b)
    for (int k = 0; k < per[b]; ++k) {
      reducer.bucket_grads(b);
      reducer.unit_done(b);
    }
  EXPECT_THROW(reducer.finish(), InternalError);
}

}  // namespace
}  // namespace t3d::parallel
