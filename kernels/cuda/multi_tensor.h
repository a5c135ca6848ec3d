// The launches of the multi-range ops on a GPU (kernels::adamw_step_many, float_to_bf16_many;
// ops_elementwise.cu): host code, so the CPU tests check the plans. A launch takes up to kMax
// ranges by value as its kernel argument (within the classic 4 KiB parameter block: no device
// table, no copy, no wait); each range is cut in chunks of kChunk elements, one block a chunk, the
// ranges' chunks numbered in order (block b works on the range r with first_block[r] <= b <
// first_block[r + 1]).
#pragma once

#include <cstdint>
#include <vector>

#include "kernels/ops.h"
#include "kernels/row_math.h"

namespace t3d::kernels::cuda::multi_tensor {

inline constexpr int kTensorsPerLaunch = 24;  // AdamW's ranges a launch
inline constexpr int kCastsPerLaunch = 96;    // float_to_bf16_many's
inline constexpr std::int64_t kChunk = 4096;

// Up to kMax ranges (each with its element count `n`) in one launch.
template <class Range, int kMax>
struct Launch {
  int count = 0;            // ranges used
  std::int64_t blocks = 0;  // chunks of all of them: the grid
  Range ranges[kMax];
  std::int64_t first_block[kMax];
  // The range block `b` works on, and its chunk's elements [lo, hi) of it.
  T3D_HD int range_of(std::int64_t b, std::int64_t& lo, std::int64_t& hi) const {
    int r = 0;
    while (r + 1 < count && first_block[r + 1] <= b) ++r;
    lo = (b - first_block[r]) * kChunk;
    hi = ranges[r].n - lo < kChunk ? ranges[r].n : lo + kChunk;
    return r;
  }
};

// The launches for `count` ranges in order, range j being make_range(j); empty ranges take none.
template <class L, class MakeRange>
std::vector<L> plan(std::int64_t count, int max_ranges, MakeRange make_range) {
  std::vector<L> launches;
  for (std::int64_t j = 0; j < count; ++j) {
    const auto range = make_range(j);
    if (range.n <= 0) continue;
    if (launches.empty() || launches.back().count == max_ranges) launches.emplace_back();
    L& l = launches.back();
    l.ranges[l.count] = range;
    l.first_block[l.count] = l.blocks;
    l.blocks += (range.n + kChunk - 1) / kChunk;
    ++l.count;
  }
  return launches;
}

struct AdamWRange {
  float* params;
  const float* grads;
  float* m;
  float* v;
  std::int64_t n;
  detail::AdamWScalars scalars;
};
using AdamWLaunch = Launch<AdamWRange, kTensorsPerLaunch>;
static_assert(sizeof(AdamWLaunch) <= 4096, "a kernel's parameters: 4 KiB");

// AdamW's launches for `count` ranges, their scalars at `step`.
inline std::vector<AdamWLaunch> plan_adamw(const AdamWTensor* tensors, std::int64_t count,
                                           std::int64_t step) {
  return plan<AdamWLaunch>(count, kTensorsPerLaunch, [&](std::int64_t j) {
    const AdamWTensor& t = tensors[j];
    return AdamWRange{t.params, t.grads, t.m, t.v, t.n, detail::adamw_scalars(t.cfg, step)};
  });
}

using CastLaunch = Launch<Bf16Cast, kCastsPerLaunch>;
static_assert(sizeof(CastLaunch) <= 4096, "a kernel's parameters: 4 KiB");

inline std::vector<CastLaunch> plan_casts(const Bf16Cast* casts, std::int64_t count) {
  return plan<CastLaunch>(count, kCastsPerLaunch, [&](std::int64_t j) { return casts[j]; });
}

}  // namespace t3d::kernels::cuda::multi_tensor
