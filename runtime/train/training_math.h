// The two pieces of a step's arithmetic the trainer computes itself, as docs/training-math.md
// states them: the learning-rate schedule and the clip coefficient (AdamW is
// kernels::adamw_step, the decay set ParamInfo::decay). Inline, so a unit test needs no MPI.
#pragma once

#include <algorithm>
#include <cmath>
#include <cstdint>

#include "runtime/recipe/recipe.h"

namespace t3d::runtime {

// lr of 0-based step `step`: linear warm-up lr·(step + 1)/warmup_steps, then a cosine from lr over
// steps − warmup_steps steps towards min_lr, which step `steps` would reach: the last step taken
// (steps − 1) is still above min_lr.
inline double learning_rate(const TrainConfig& t, int64_t step) {
  if (step < t.warmup_steps) return t.lr * static_cast<double>(step + 1) / t.warmup_steps;
  const double span = std::max<int64_t>(1, t.steps - t.warmup_steps);
  const double progress = std::min(1.0, (step - t.warmup_steps) / span);
  return t.min_lr + 0.5 * (t.lr - t.min_lr) * (1.0 + std::cos(M_PI * progress));
}

// What AdamW multiplies the gradients by (its grad_scale): grad_clip / norm when clipping is on
// and the global norm exceeds it, else 1. No epsilon, so a norm equal to grad_clip is not clipped;
// rounded to fp32 as AdamW takes it.
inline float clip_coefficient(double grad_clip, double norm) {
  return grad_clip > 0 && norm > grad_clip ? static_cast<float>(grad_clip / norm) : 1.0f;
}

}  // namespace t3d::runtime
