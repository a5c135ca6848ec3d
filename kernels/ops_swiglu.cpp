// The SwiGLU MLP (kernels/ops_swiglu.h): the linear ops and the SwiGLU activation of ops_mlp.cpp
// in the one order every caller shares.
#include "kernels/ops_swiglu.h"

namespace t3d::kernels {

void swiglu_act_forward(const Exec& exec, const SwigluActs& a, const SwigluCopies& c,
                        std::int64_t n) {
  if (c.fused)
    swiglu_forward_bf16(exec, c.h, c.gate, c.up, a.gate, a.up, n);
  else
    swiglu_forward(exec, a.h, a.gate, a.up, n);
}

void swiglu_act_backward(const Exec& exec, float* dgate, float* dup, const float* dh,
                         const SwigluActs& a, const SwigluCopies& c, std::int64_t n) {
  if (c.fused)
    swiglu_backward_bf16(exec, dgate_copy(dgate, c), dgate_copy(dup, c), dh, c.gate, c.up, n);
  else
    swiglu_backward(exec, dgate, dup, dh, a.gate, a.up, n);
}

void swiglu_mlp_forward(const Exec& exec, float* y, Out mode, const LinearInput& x,
                        const SwigluWeights& w, const SwigluActs& a, const SwigluCopies& c,
                        std::int64_t F, const float* residual) {
  swiglu_mlp_hidden(exec, x, w, a, c, F);
  swiglu_mlp_down(exec, y, mode, w, a, c, x.rows(), x.cols(), F, residual);
}

void swiglu_mlp_hidden(const Exec& exec, const LinearInput& x, const SwigluWeights& w,
                       const SwigluActs& a, const SwigluCopies& c, std::int64_t F) {
  linear_forward(a.gate, x, w.gate, F);
  linear_forward(a.up, x, w.up, F);
  swiglu_act_forward(exec, a, c, x.rows() * F);
}

void swiglu_mlp_down(const Exec& exec, float* y, Out mode, const SwigluWeights& w,
                     const SwigluActs& a, const SwigluCopies& c, std::int64_t N, std::int64_t C,
                     std::int64_t F, const float* residual) {
  using Copy = LinearInput::Copy;
  // Fused, h exists only as its copy; else h is rounded once into its copy (if any) here.
  const LinearInput h(exec, a.h, c.h, c.fused ? Copy::kFilled : Copy::kFill, N, F);
  T3D_ASSERT(!residual || mode == Out::kWrite, "a residual with Out::kAccumulate");
  if (residual)
    linear_forward_residual(y, residual, h, w.down, C);
  else
    linear_forward(y, h, w.down, C, mode);
}

void swiglu_mlp_backward_hidden(const Exec& exec, float* dgate, float* dup, float* dh,
                                const LinearInput& dy, const SwigluWeights& w, const SwigluActs& a,
                                const SwigluCopies& c, std::int64_t F) {
  linear_backward_input(dh, dy, w.down, F);
  swiglu_act_backward(exec, dgate, dup, dh, a, c, dy.rows() * F);
}

void swiglu_mlp_backward_input(const Exec& exec, float* dx, Out mode, float* tmp,
                               const float* dgate, const float* dup, const SwigluWeights& w,
                               const SwigluCopies& c, std::int64_t N, std::int64_t C,
                               std::int64_t F) {
  using Copy = LinearInput::Copy;
  // Fused: dgate and dup exist only rounded, in the first half of their fp32 buffers.
  const LinearInput dg(exec, dgate, dgate_copy(dgate, c), Copy::kFilled, N, F);
  const LinearInput du(exec, dup, dgate_copy(dup, c), Copy::kFilled, N, F);
  if (mode == Out::kWrite) {
    linear_backward_input(dx, dg, w.gate, C);
  } else {
    linear_backward_input(tmp, dg, w.gate, C);
    add_inplace(exec, dx, tmp, N * C);
  }
  linear_backward_input(tmp, du, w.up, C);
  add_inplace(exec, dx, tmp, N * C);
}

void swiglu_mlp_backward_weight(const Exec& exec, const SwigluGrads& g, const LinearInput& dy,
                                const LinearInput& x, const float* dgate, const float* dup,
                                const SwigluActs& a, const SwigluCopies& c, std::int64_t F) {
  using Copy = LinearInput::Copy;
  const std::int64_t N = x.rows();
  linear_backward_weight(g.down, dy, LinearInput(exec, a.h, c.h, Copy::kFilled, N, F));
  const LinearInput dg(exec, dgate, dgate_copy(dgate, c), Copy::kFilled, N, F);
  const LinearInput du(exec, dup, dgate_copy(dup, c), Copy::kFilled, N, F);
  linear_backward_weight(g.gate, dg, x);
  linear_backward_weight(g.up, du, x);
}

}  // namespace t3d::kernels
