// The shared experts' sigmoid gate of a mixture-of-experts block (model.shared_expert_gate,
// Qwen2-MoE; docs/moe.md): y = routed + g ⊙ Shared(u), g[t] = sigmoid(u[t] · w), u = xn2.
//
// Under tensor parallelism each rank's Shared(u) is a partial sum over its slice of the shared
// experts' width, and g is the same on every rank (u whole, w replicated): each rank scales its
// partial sum by g, and the block's tp reduction sums g · Shared(u). In the backward the gate's
// gradient needs the whole dy[t] · Shared(u)[t], so each rank's dot of its partial sum is summed
// over tp (N floats, fp32) before dz = dg · g (1 − g) is formed; the shared experts take g ⊙ dy;
// the gradient into u, dz ⊗ w, joins the other partial sums of dxn on tp rank 0 only (as the
// router's does); w's gradient Σ_t dz[t] u[t] is the whole sum on every rank, or with sequence
// parallelism this rank's rows' part, which sum_replicated_grads adds up over tp.
#include "kernels/ops.h"
#include "kernels/ops_gate.h"
#include "runtime/model/model.h"
#include "runtime/model/model_scratch.h"

namespace t3d::runtime {

namespace k = t3d::kernels;

void Model::shared_experts_down(int64_t l, LayerActs& a, const BlockCopies& copies,
                                const ConstBlock& w) {
  const k::Exec& exec = options_.exec;
  const int64_t N = rows_, C = dims_.C;
  auto& s = *scratch_;
  const k::SwigluActs sa{a.sgate, a.sup, a.sh};
  if (!block_has(config_, l, BlockWeight::kSharedExpertGate)) {
    k::swiglu_mlp_down(exec, s.tmp, k::Out::kAccumulate, shared_weights(w), sa, copies.shared(), N,
                       C, dims_.Fs);
    return;
  }
  // The routed rows' outputs in moe_out are combined into tmp by now: it holds Shared(u).
  k::swiglu_mlp_down(exec, s.moe_out, k::Out::kWrite, shared_weights(w), sa, copies.shared(), N, C,
                     dims_.Fs);
  k::shared_gate_forward(exec, s.tmp, a.sgate_g, a.xn2, w.shared_expert_gate, s.moe_out, N, C);
}

const float* Model::shared_gate_backward(int64_t l, const LayerActs& a, const BlockCopies& copies,
                                         const ConstBlock& w, const float* dy,
                                         const LayerGrads* keep) {
  if (!block_has(config_, l, BlockWeight::kSharedExpertGate)) return dy;
  const k::Exec& exec = options_.exec;
  const int64_t N = rows_, C = dims_.C;
  auto& s = *scratch_;
  // Shared(u) again (this rank's partial sum), from the activations the forward kept: the same
  // GEMM on the same h, into dxn, which the routed experts' combine writes later.
  k::swiglu_mlp_down(exec, s.dxn, k::Out::kWrite, shared_weights(w), {a.sgate, a.sup, a.sh},
                     copies.shared(), N, C, dims_.Fs);
  k::shared_gate_backward_dot(exec, s.gate_dg, dy, s.dxn, N, C);
  if (tp_.size() > 1) tp_.all_reduce(s.gate_dg, static_cast<size_t>(N));
  // g ⊙ dy: what the shared experts' backward reads, and with `keep` their down_proj's W too.
  float* gdy = keep ? keep->dy_down : s.tmp;
  k::shared_gate_backward(exec, gdy, s.gate_dg, s.gate_dg, a.sgate_g, dy, N, C);
  if (keep) k::copy(exec, keep->gate_dz, s.gate_dg, N);
  return gdy;
}

void Model::shared_gate_backward_finish(int64_t l, const LayerActs& a, const ConstBlock& w,
                                        const BlockParams& g, const LayerGrads* keep) {
  if (!block_has(config_, l, BlockWeight::kSharedExpertGate)) return;
  const int64_t N = rows_, C = dims_.C;
  auto& s = *scratch_;
  if (tp_.rank() == 0)
    k::shared_gate_backward_input(options_.exec, s.dxn, s.gate_dg, w.shared_expert_gate, N, C);
  if (!keep) shared_gate_weight_grad(a, g, s.gate_dg);
}

void Model::shared_gate_weight_grad(const LayerActs& a, const BlockParams& g, const float* dz) {
  const int64_t first = sp_ ? tp_.rank() * rows_local_ : 0;
  k::shared_gate_backward_weight(options_.exec, g.shared_expert_gate, dz + first,
                                 a.xn2 + first * dims_.C, rows_local_, dims_.C);
}

}  // namespace t3d::runtime
