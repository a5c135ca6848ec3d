// Softmax cross-entropy fused with its gradient. The vocab-parallel pieces and the fused
// single-rank version share the per-row helpers below, so they cannot drift apart.
#include <cmath>
#include <limits>

#include "kernels/check.h"
#include "kernels/cuda/cuda_ops.h"
#include "kernels/ops.h"
#include "kernels/threads.h"

namespace t3d::kernels {
namespace {

float row_max_of(const float* x, std::int64_t V) {
  float m = -std::numeric_limits<float>::infinity();
  for (std::int64_t j = 0; j < V; ++j) m = x[j] > m ? x[j] : m;
  return m;
}

float row_sum_exp(const float* x, std::int64_t V, float max) {
  double s = 0.0;  // V can be 128k: fp32 accumulation would lose the small terms
  for (std::int64_t j = 0; j < V; ++j) s += std::exp(x[j] - max);
  return static_cast<float>(s);
}

// Overwrites the row with (softmax - onehot) * grad_scale and returns the row's loss.
// `local_target` is the target's column in this slice, or -1 when another rank owns it.
float loss_and_grad_row(float* x, std::int64_t V, float max, float sum_exp, float target_logit,
                        std::int64_t local_target, float grad_scale) {
  const float inv_sum = 1.0f / sum_exp;
  for (std::int64_t j = 0; j < V; ++j) x[j] = std::exp(x[j] - max) * inv_sum * grad_scale;
  if (local_target >= 0) x[local_target] -= grad_scale;
  // -log softmax[t] = log(sum exp(x - max)) + max - x_t
  return std::log(sum_exp) + max - target_logit;
}

void zero_row(float* x, std::int64_t V) {
  for (std::int64_t j = 0; j < V; ++j) x[j] = 0.0f;
}

}  // namespace

void cross_entropy_fused(const Exec& exec, float* logits, float* losses,
                         const std::int32_t* targets, std::int64_t N, std::int64_t V,
                         float grad_scale) {
  T3D_ON_GPU(exec,
             cuda::cross_entropy_fused(*exec.stream, logits, losses, targets, N, V, grad_scale));
  for (std::int64_t i = 0; i < N; ++i)  // checked before the threads: a throw cannot leave them
    T3D_USER_CHECK(targets[i] == kIgnoreIndex || (targets[i] >= 0 && targets[i] < V),
                   "target token ", targets[i], " at row ", i, " is outside the vocabulary [0, ", V,
                   ")");
  // Row by row, rows split over the threads: the three passes (max, sum-exp, gradient) of a row
  // stay in cache, and each row's result does not depend on the split.
  detail::split_rows(N, V, [&](std::int64_t lo, std::int64_t hi) {
    for (std::int64_t i = lo; i < hi; ++i) {
      float* x = logits + i * V;
      const std::int32_t t = targets[i];
      if (t == kIgnoreIndex) {
        zero_row(x, V);
        losses[i] = 0.0f;
        continue;
      }
      const float max = row_max_of(x, V);
      const float sum = row_sum_exp(x, V, max);
      losses[i] = loss_and_grad_row(x, V, max, sum, x[t], t, grad_scale);
    }
  });
}

void ce_local_max(const Exec& exec, float* row_max, const float* logits, std::int64_t N,
                  std::int64_t V) {
  T3D_ON_GPU(exec, cuda::ce_local_max(*exec.stream, row_max, logits, N, V));
  detail::split_rows(N, V, [&](std::int64_t lo, std::int64_t hi) {
    for (std::int64_t i = lo; i < hi; ++i) row_max[i] = row_max_of(logits + i * V, V);
  });
}

void ce_local_sum_exp(const Exec& exec, float* sum_exp, const float* logits, const float* row_max,
                      std::int64_t N, std::int64_t V) {
  T3D_ON_GPU(exec, cuda::ce_local_sum_exp(*exec.stream, sum_exp, logits, row_max, N, V));
  detail::split_rows(N, V, [&](std::int64_t lo, std::int64_t hi) {
    for (std::int64_t i = lo; i < hi; ++i) sum_exp[i] = row_sum_exp(logits + i * V, V, row_max[i]);
  });
}

void ce_local_target_logit(const Exec& exec, float* target_logit, const float* logits,
                           const std::int32_t* targets, std::int64_t N, std::int64_t V,
                           std::int64_t vocab_start) {
  T3D_ON_GPU(exec, cuda::ce_local_target_logit(*exec.stream, target_logit, logits, targets, N, V,
                                               vocab_start));
  for (std::int64_t i = 0; i < N; ++i) {
    const std::int64_t local = static_cast<std::int64_t>(targets[i]) - vocab_start;
    // Zero on ranks that do not own the target, so an all-reduce SUM yields the value.
    target_logit[i] =
        (targets[i] != kIgnoreIndex && local >= 0 && local < V) ? logits[i * V + local] : 0.0f;
  }
}

void ce_loss_and_grad(const Exec& exec, float* logits, float* losses, const std::int32_t* targets,
                      const float* row_max, const float* sum_exp, const float* target_logit,
                      std::int64_t N, std::int64_t V, std::int64_t vocab_start, float grad_scale) {
  T3D_ON_GPU(exec, cuda::ce_loss_and_grad(*exec.stream, logits, losses, targets, row_max, sum_exp,
                                          target_logit, N, V, vocab_start, grad_scale));
  detail::split_rows(N, V, [&](std::int64_t lo, std::int64_t hi) {
    for (std::int64_t i = lo; i < hi; ++i) {
      float* x = logits + i * V;
      if (targets[i] == kIgnoreIndex) {
        zero_row(x, V);
        losses[i] = 0.0f;
        continue;
      }
      const std::int64_t local = static_cast<std::int64_t>(targets[i]) - vocab_start;
      losses[i] = loss_and_grad_row(x, V, row_max[i], sum_exp[i], target_logit[i],
                                    (local >= 0 && local < V) ? local : -1, grad_scale);
    }
  });
}

}  // namespace t3d::kernels
