// A mixture-of-experts block's MLP part (docs/moe.md): the router (fp32 GEMM and scores, top-k
// with the selection bias), the routed experts as one grouped pass over the token slots sorted by
// expert, the shared experts as a dense SwiGLU, and their backward. The attention part, the
// norms and the residual stream are the dense block's (model.cpp).
#include <algorithm>

#include "kernels/check.h"
#include "kernels/ops.h"
#include "kernels/ops_moe.h"
#include "kernels/precision.h"
#include "runtime/model/model.h"
#include "runtime/model/model_scratch.h"

namespace t3d::runtime {

namespace k = t3d::kernels;

namespace {

// The router runs in fp32 whatever the GEMM kind: with bf16 GEMMs, oneDNN's fp32.
k::GemmKind router_kind(k::GemmKind kind) {
  return k::gemm_kind_is_bf16(kind) ? k::GemmKind::kOneDnnF32 : kind;
}

}  // namespace

k::RouterShape Model::router_shape() const {
  k::RouterShape r;
  r.N = rows_;
  r.E = config_.n_experts;
  r.K = config_.experts_per_token;
  r.score = config_.router_score;
  r.normalize = config_.router_norm_topk;
  r.scale = static_cast<float>(config_.router_scale);
  return r;
}

void Model::reset_moe_stats() {
  std::fill(expert_counts_.begin(), expert_counts_.end(), 0.0);
  std::fill(dropped_slots_.begin(), dropped_slots_.end(), 0.0);
  aux_loss_ = 0;
}

void Model::moe_forward(int64_t l, LayerActs& a, const BlockCopies& copies, const ConstBlock& w,
                        bool first_pass) {
  const k::GemmKind kind = options_.gemm;
  const k::RouterShape r = router_shape();
  const int64_t N = rows_, C = config_.dim, E = r.E, K = r.K, S = N * K;
  const int64_t Fe = config_.moe_ffn_dim / tp_.size();
  auto& s = *scratch_;
  // A bf16-stored block keeps xn2 only as the copy its forward fills (encode16 leaves it out).
  if (copies.xn2) k::float_to_bf16_threads(copies.xn2, a.xn2, N * C);
  auto* chosen = reinterpret_cast<int32_t*>(a.chosen);
  k::linear_forward(router_kind(kind), a.scores, a.xn2, w.router, N, C, E);  // the logits
  k::moe_route_forward(a.scores, chosen, a.gates, a.scores,
                       block_has(config_, l, BlockWeight::kRouterBias) ? w.router_bias : nullptr,
                       r);
  // The capacity drops the same slots in the backward and in a recompute: they depend on
  // `chosen` alone.
  int64_t* offsets = expert_offsets_.data();
  const int64_t dropped = k::moe_permute(offsets, s.moe_row_of_slot, s.moe_slot_of_row, chosen, N,
                                         E, K, k::moe_capacity(config_.capacity_factor, N, E, K));
  k::moe_gather(s.moe_rows, a.xn2, s.moe_slot_of_row, offsets[E], K, C);
  k::moe_experts_forward(kind, s.moe_out, a.egate, a.eup, a.eh, s.moe_rows, w.expert_gate,
                         w.expert_up, w.expert_down, offsets, {E, C, Fe});
  k::moe_combine(s.tmp, s.moe_out, a.gates, s.moe_row_of_slot, N, K, C, k::Out::kWrite);
  if (block_has(config_, l, BlockWeight::kSharedGate)) {
    const int64_t Fs = config_.shared_ffn_dim() / tp_.size();
    k::linear_forward(kind, a.sgate, a.xn2, w.shared_gate, N, C, Fs);
    k::linear_forward(kind, a.sup, a.xn2, w.shared_up, N, C, Fs);
    k::swiglu_forward(a.sh, a.sgate, a.sup, N * Fs);
    k::linear_forward(kind, s.tmp, a.sh, w.shared_down, N, Fs, C, k::Out::kAccumulate);
  }
  if (!first_pass) return;
  const size_t at = static_cast<size_t>(
      std::lower_bound(moe_layers_.begin(), moe_layers_.end(), l) - moe_layers_.begin());
  k::moe_count(expert_counts_.data() + at * static_cast<size_t>(E), chosen, N, E, K);
  dropped_slots_[at] += static_cast<double>(dropped);
  if (options_.moe_aux_weight > 0)
    aux_loss_ += options_.moe_aux_weight *
                 k::moe_aux_loss(nullptr, a.scores, chosen, options_.micro_rows, seq_local_, r, 0);
}

void Model::moe_backward(int64_t l, LayerActs& a, const BlockCopies& copies, const ConstBlock& w,
                         const BlockParams& g, const float* dy) {
  const k::GemmKind kind = options_.gemm;
  const k::RouterShape r = router_shape();
  const int64_t N = rows_, C = config_.dim, E = r.E, K = r.K, S = N * K;
  const int64_t Fe = config_.moe_ffn_dim / tp_.size();
  auto& s = *scratch_;
  // With bf16 GEMMs decode16 leaves xn2 in its copy only: the router and the gathers read floats.
  if (copies.xn2 && k::gemm_kind_is_bf16(kind)) k::bf16_to_float_threads(a.xn2, copies.xn2, N * C);
  const auto* chosen = reinterpret_cast<const int32_t*>(a.chosen);
  int64_t* offsets = expert_offsets_.data();
  k::moe_permute(offsets, s.moe_row_of_slot, s.moe_slot_of_row, chosen, N, E, K,
                 k::moe_capacity(config_.capacity_factor, N, E, K));
  // Routed experts: xs in moe_rows, dy's rows in moe_out (clobbered), dxs in moe_grad. A dropped
  // slot has no row: its gate's gradient stays 0.
  const int64_t kept = offsets[E];
  k::moe_gather(s.moe_rows, a.xn2, s.moe_slot_of_row, kept, K, C);
  k::moe_gather(s.moe_out, dy, s.moe_slot_of_row, kept, K, C);
  std::fill_n(s.moe_dgates, S, 0.0f);
  k::moe_experts_backward(kind, s.moe_grad, s.moe_dgates, g.expert_gate, g.expert_up, g.expert_down,
                          s.moe_dh, s.moe_dgate, s.moe_dup, s.moe_out, a.gates, s.moe_slot_of_row,
                          s.moe_rows, a.egate, a.eup, a.eh, w.expert_gate, w.expert_up,
                          w.expert_down, offsets, {E, C, Fe});
  k::moe_combine(s.dxn, s.moe_grad, nullptr, s.moe_row_of_slot, N, K, C, k::Out::kWrite);
  // Each tp rank holds a slice of every expert's width: its gate gradients are partial sums.
  if (tp_.size() > 1) tp_.all_reduce(s.moe_dgates, static_cast<size_t>(S));
  if (block_has(config_, l, BlockWeight::kSharedGate)) {
    const int64_t Fs = config_.shared_ffn_dim() / tp_.size();
    k::linear_backward_input(kind, s.dh, dy, w.shared_down, N, Fs, C);
    k::linear_backward_weight(kind, g.shared_down, dy, a.sh, N, Fs, C);
    k::swiglu_backward(s.dgate, s.dup, s.dh, a.sgate, a.sup, N * Fs);
    k::linear_backward_input(kind, s.dtmp, s.dgate, w.shared_gate, N, C, Fs);
    k::add_inplace(s.dxn, s.dtmp, N * C);
    k::linear_backward_input(kind, s.dtmp, s.dup, w.shared_up, N, C, Fs);
    k::add_inplace(s.dxn, s.dtmp, N * C);
    k::linear_backward_weight(kind, g.shared_gate, s.dgate, a.xn2, N, C, Fs);
    k::linear_backward_weight(kind, g.shared_up, s.dup, a.xn2, N, C, Fs);
  }
  // The router: the gates' gradient (and the auxiliary loss's, injected here at the layer, so
  // that it is the same under any pipeline split), through the scores to the logits.
  const float* dscores_aux = nullptr;
  if (options_.moe_aux_weight > 0) {
    k::moe_aux_loss(s.moe_dscores, a.scores, chosen, options_.micro_rows, seq_local_, r,
                    static_cast<float>(options_.moe_aux_weight));
    dscores_aux = s.moe_dscores;
  }
  k::moe_route_backward(s.moe_dlogits, s.moe_dgates, dscores_aux, a.scores, chosen, r);
  // The router is replicated over tp and every rank's dlogits are the same: its part of the
  // input gradient joins the others' partial sums on one rank only. Its weight gradient is
  // whole on every rank, or with sequence parallelism this rank's rows' part, which
  // sum_replicated_grads adds up over tp as it does the norms'.
  const k::GemmKind rk = router_kind(kind);
  if (tp_.rank() == 0) {
    k::linear_backward_input(rk, s.dtmp, s.moe_dlogits, w.router, N, C, E);
    k::add_inplace(s.dxn, s.dtmp, N * C);
  }
  const int64_t first = sp_ ? tp_.rank() * rows_local_ : 0, rows = sp_ ? rows_local_ : N;
  k::linear_backward_weight(rk, g.router, s.moe_dlogits + first * E, a.xn2 + first * C, rows, C, E);
}

}  // namespace t3d::runtime
