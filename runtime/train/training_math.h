// The two pieces of a step's arithmetic the trainer computes itself, as docs/training-math.md
// states them: the learning-rate schedule and the clip coefficient (AdamW is
// kernels::adamw_step, the decay set ParamInfo::decay). Inline, so a unit test needs no MPI.
#pragma once

#include <algorithm>
#include <cmath>
#include <cstdint>

#include "runtime/recipe/recipe.h"

namespace t3d::runtime {

// lr of 0-based step `step` (docs/training-math.md): linear warm-up lr·(step + 1)/warmup_steps;
// then lr until the decay's D steps (decay_steps, or 0 for every step after the warm-up), which
// take it from lr towards min_lr by the shape lr_decay, reaching min_lr at step `steps`: the last
// step taken (steps − 1) is still above min_lr. Constant: lr after the warm-up.
inline double learning_rate(const TrainConfig& t, int64_t step) {
  if (step < t.warmup_steps) return t.lr * static_cast<double>(step + 1) / t.warmup_steps;
  if (t.lr_decay == LrDecay::kConstant) return t.lr;
  const int64_t decay = t.decay_steps > 0 ? t.decay_steps : t.steps - t.warmup_steps;
  const int64_t start = t.steps - decay;  // warmup_steps without a stable phase
  if (step < start) return t.lr;
  const double span = std::max<int64_t>(1, decay);
  const double progress = std::min(1.0, (step - start) / span);
  switch (t.lr_decay) {
    case LrDecay::kLinear:
      return t.min_lr + (t.lr - t.min_lr) * (1.0 - progress);
    case LrDecay::kSqrt:
      return t.min_lr + (t.lr - t.min_lr) * (1.0 - std::sqrt(progress));
    default:
      return t.min_lr + 0.5 * (t.lr - t.min_lr) * (1.0 + std::cos(M_PI * progress));
  }
}

// What AdamW multiplies the gradients by (its grad_scale): grad_clip / norm when clipping is on
// and the global norm exceeds it, else 1. No epsilon, so a norm equal to grad_clip is not clipped;
// rounded to fp32 as AdamW takes it.
inline float clip_coefficient(double grad_clip, double norm) {
  return grad_clip > 0 && norm > grad_clip ? static_cast<float>(grad_clip / norm) : 1.0f;
}

}  // namespace t3d::runtime
