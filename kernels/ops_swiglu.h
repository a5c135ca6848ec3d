// The SwiGLU MLP, one path for every copy of it: a dense block's MLP, a mixture of experts'
// shared experts and, for its activation, the routed experts (kernels/ops_moe.h), in training and
// in the decoder. Its forward, its input-gradient backward (B) and its weight-gradient backward
// (W), with the GEMM inputs rounded once for bf16 GEMMs (LinearInput) and, with bf16 GEMMs over
// bf16-stored activations, the fused bf16 SwiGLU (ops.h swiglu_forward_bf16 / _backward_bf16).
//
//   gate = x · Wg^T, up = x · Wu^T, h = silu(gate) ⊙ up, y = h · Wd^T
//
// Shapes: x, y (N, C); gate, up, h and their gradients (N, F); Wg, Wu (F, C), Wd (C, F).
#pragma once

#include <cstdint>

#include "kernels/exec.h"
#include "kernels/ops.h"

namespace t3d::kernels {

struct SwigluWeights {
  const float *gate = nullptr, *up = nullptr, *down = nullptr;
};
struct SwigluGrads {  // as SwigluWeights; the backward adds to them
  float *gate = nullptr, *up = nullptr, *down = nullptr;
};
// The forward's activations (N, F) each.
struct SwigluActs {
  float *gate = nullptr, *up = nullptr, *h = nullptr;
};
// A bf16-stored SwiGLU's copies of its activations (N, F) each, or null. `fused` (bf16 GEMMs):
// the forward writes gate, up and h rounded into them, h's floats are not written and the down
// GEMM reads h's copy; the backward reads gate and up from the copies alone and writes dgate and
// dup rounded, into the first half of their fp32 buffers (dgate_copy), where the GEMMs read
// them. The same bits as the fp32 activations rounded and stored, then decoded. Not fused, only
// h's copy is used: the forward rounds h into it for the down GEMM (Copy::kFill), the backward's
// weight gradient reads it as it is (Copy::kFilled).
struct SwigluCopies {
  bf16 *gate = nullptr, *up = nullptr, *h = nullptr;
  bool fused = false;
};
// The rounded copy of a fused backward's dgate or dup: the first half of its fp32 buffer; null
// when not fused. Non-const for LinearInput, which writes a copy only when told to fill it.
inline bf16* dgate_copy(const float* d, const SwigluCopies& c) {
  return c.fused ? reinterpret_cast<bf16*>(const_cast<float*>(d)) : nullptr;
}

// h = silu(gate) ⊙ up over n elements: swiglu_forward, or fused swiglu_forward_bf16 (copies).
void swiglu_act_forward(const Exec& exec, const SwigluActs& a, const SwigluCopies& c,
                        std::int64_t n);
// dgate, dup (n) = from dh (n): swiglu_backward on a's gate and up, or fused
// swiglu_backward_bf16 on the copies, writing dgate_copy(dgate), dgate_copy(dup).
void swiglu_act_backward(const Exec& exec, float* dgate, float* dup, const float* dh,
                         const SwigluActs& a, const SwigluCopies& c, std::int64_t n);

// y (N, C) = or += (mode) the MLP of x (N, C), whose LinearInput has exec's GEMM kind; writes
// a (and the copies). With `residual` (mode kWrite; not y): y = residual + the MLP, the residual
// added by the down projection's GEMM (linear_forward_residual). The two halves apart:
// swiglu_mlp_hidden (gate, up, h) then swiglu_mlp_down (y from h), for a caller that runs
// something between them.
void swiglu_mlp_forward(const Exec& exec, float* y, Out mode, const LinearInput& x,
                        const SwigluWeights& w, const SwigluActs& a, const SwigluCopies& c,
                        std::int64_t F, const float* residual = nullptr);
void swiglu_mlp_hidden(const Exec& exec, const LinearInput& x, const SwigluWeights& w,
                       const SwigluActs& a, const SwigluCopies& c, std::int64_t F);
void swiglu_mlp_down(const Exec& exec, float* y, Out mode, const SwigluWeights& w,
                     const SwigluActs& a, const SwigluCopies& c, std::int64_t N, std::int64_t C,
                     std::int64_t F, const float* residual = nullptr);
// B's first half, from dy (N, C) the gradient of y: dh = dy · Wd (scratch (N, F)), then dgate and
// dup (N, F) = (fused: rounded, in their first halves).
void swiglu_mlp_backward_hidden(const Exec& exec, float* dgate, float* dup, float* dh,
                                const LinearInput& dy, const SwigluWeights& w, const SwigluActs& a,
                                const SwigluCopies& c, std::int64_t F);
// B's second half: dx (N, C) = (kWrite) dgate · Wg, then tmp = dup · Wu added to it; or
// (kAccumulate) tmp = dgate · Wg added to dx, then tmp = dup · Wu added. tmp (N, C) scratch.
void swiglu_mlp_backward_input(const Exec& exec, float* dx, Out mode, float* tmp,
                               const float* dgate, const float* dup, const SwigluWeights& w,
                               const SwigluCopies& c, std::int64_t N, std::int64_t C,
                               std::int64_t F);
// W: g.down += dy^T h, g.gate += dgate^T x, g.up += dup^T x (h read from its copy when there is
// one, dgate and dup from theirs when fused).
void swiglu_mlp_backward_weight(const Exec& exec, const SwigluGrads& g, const LinearInput& dy,
                                const LinearInput& x, const float* dgate, const float* dup,
                                const SwigluActs& a, const SwigluCopies& c, std::int64_t F);

}  // namespace t3d::kernels
