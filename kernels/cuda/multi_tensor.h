// The launches of the multi-tensor AdamW (kernels::adamw_step_many on a GPU, ops_elementwise.cu):
// host code, so the CPU tests check the plan. A launch takes up to kTensorsPerLaunch ranges by
// value as its kernel argument (under 2 KiB, within the classic 4 KiB parameter block: no device
// table, no copy, no wait); each range is cut in chunks of kChunk elements, one block a chunk, the
// ranges' chunks numbered in order (block b works on the range r with first_block[r] <= b <
// first_block[r + 1]).
#pragma once

#include <cstdint>
#include <vector>

#include "kernels/ops.h"
#include "kernels/row_math.h"

namespace t3d::kernels::cuda::multi_tensor {

inline constexpr int kTensorsPerLaunch = 24;
inline constexpr std::int64_t kChunk = 4096;

struct AdamWRange {
  float* params;
  const float* grads;
  float* m;
  float* v;
  std::int64_t n;
  detail::AdamWScalars scalars;
};

struct AdamWLaunch {
  int count = 0;            // ranges used
  std::int64_t blocks = 0;  // chunks of all of them: the grid
  AdamWRange ranges[kTensorsPerLaunch];
  std::int64_t first_block[kTensorsPerLaunch];
};
static_assert(sizeof(AdamWLaunch) <= 4096, "a kernel's parameters: 4 KiB");

// The launches for `count` ranges in order, their scalars at `step`; empty ranges take none.
inline std::vector<AdamWLaunch> plan_adamw(const AdamWTensor* tensors, std::int64_t count,
                                           std::int64_t step) {
  std::vector<AdamWLaunch> launches;
  for (std::int64_t j = 0; j < count; ++j) {
    const AdamWTensor& t = tensors[j];
    if (t.n <= 0) continue;
    if (launches.empty() || launches.back().count == kTensorsPerLaunch) launches.emplace_back();
    AdamWLaunch& l = launches.back();
    l.ranges[l.count] = {t.params, t.grads, t.m, t.v, t.n, detail::adamw_scalars(t.cfg, step)};
    l.first_block[l.count] = l.blocks;
    l.blocks += (t.n + kChunk - 1) / kChunk;
    ++l.count;
  }
  return launches;
}

}  // namespace t3d::kernels::cuda::multi_tensor
