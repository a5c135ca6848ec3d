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
  const k::Exec& exec = options_.exec;
  const k::GemmKind kind = exec.gemm;
  const k::RouterShape r = router_shape();
  const int64_t N = rows_, C = config_.dim, E = r.E, K = r.K;
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
  T3D_ASSERT(offsets[E] <= ep_rows_, "the experts take ", offsets[E], " rows, more than the ",
             ep_rows_, " their buffers hold");
  k::ExpertCopies ec;  // under expert parallelism the rows travel as floats
  if (ep_size() > 1)
    k::moe_gather(s.moe_rows, a.xn2, s.moe_slot_of_row, offsets[E], K, C);
  else
    ec = gather_expert_rows(a, copies, offsets[E]);
  const bool shared = block_has(config_, l, BlockWeight::kSharedGate);
  const int64_t Fs = shared ? config_.shared_ffn_dim() / tp_.size() : 0;
  // The shared experts' hidden layer needs nothing routed: under expert parallelism it runs
  // while the routed rows travel. Only its down projection, added to the routed output, waits.
  const auto shared_hidden = [&] {
    k::linear_forward(exec, a.sgate, a.xn2, w.shared_gate, N, C, Fs);
    k::linear_forward(exec, a.sup, a.xn2, w.shared_up, N, C, Fs);
    k::swiglu_forward(exec, a.sh, a.sgate, a.sup, N * Fs);
  };
  if (ep_size() > 1) {
    RowsInFlight dispatch = moe_ep_dispatch(a);
    if (shared) shared_hidden();
    moe_experts_ep_forward(a, copies, w, dispatch);
  } else {
    k::moe_experts_forward(exec, s.moe_out, a.egate, a.eup, a.eh, s.moe_rows, w.expert_gate,
                           w.expert_up, w.expert_down, offsets, {E, C, Fe}, ec);
    if (shared) shared_hidden();
  }
  k::moe_combine(s.tmp, s.moe_out, a.gates, s.moe_row_of_slot, N, K, C, k::Out::kWrite);
  if (shared) k::linear_forward(exec, s.tmp, a.sh, w.shared_down, N, Fs, C, k::Out::kAccumulate);
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
                         const BlockParams& g, const float* dy, const LayerGrads* keep) {
  const k::Exec& exec = options_.exec;
  const k::GemmKind kind = exec.gemm;
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
  // With `keep` the experts' gated output gradients and their gate and up gradients are written
  // where W reads them.
  float* dys = keep && ep_size() == 1 ? keep->expert_dy : s.moe_out;
  k::moe_gather(dys, dy, s.moe_slot_of_row, kept, K, C);
  std::fill_n(s.moe_dgates, S, 0.0f);
  const bool shared = block_has(config_, l, BlockWeight::kSharedGate);
  const int64_t Fs = shared ? config_.shared_ffn_dim() / tp_.size() : 0;
  float* shared_dgate = keep ? keep->dgate : s.dgate;
  float* shared_dup = keep ? keep->dup : s.dup;
  // The shared experts' gradients that add nothing to dxn: under expert parallelism they run
  // while the routed rows' output gradients travel.
  const auto shared_backward = [&] {
    k::linear_backward_input(exec, s.dh, dy, w.shared_down, N, Fs, C);
    if (!keep) k::linear_backward_weight(exec, g.shared_down, dy, a.sh, N, Fs, C);
    k::swiglu_backward(exec, shared_dgate, shared_dup, s.dh, a.sgate, a.sup, N * Fs);
    if (keep) return;
    k::linear_backward_weight(exec, g.shared_gate, shared_dgate, a.xn2, N, C, Fs);
    k::linear_backward_weight(exec, g.shared_up, shared_dup, a.xn2, N, C, Fs);
  };
  if (ep_size() > 1) {
    RowsInFlight dispatch = moe_ep_dispatch_backward(a);
    if (shared) shared_backward();
    moe_experts_ep_backward(a, copies, w, g, dispatch, keep);
  } else if (keep) {
    k::moe_experts_backward_input(exec, s.moe_grad, s.moe_dgates, s.moe_dh, keep->expert_dgate,
                                  keep->expert_dup, dys, a.gates, s.moe_slot_of_row, a.egate, a.eup,
                                  a.eh, w.expert_gate, w.expert_up, w.expert_down, offsets,
                                  {E, C, Fe}, copies.experts());
    if (shared) shared_backward();
  } else {
    const k::ExpertCopies ec = gather_expert_rows(a, copies, kept);
    k::moe_experts_backward(exec, s.moe_grad, s.moe_dgates, g.expert_gate, g.expert_up,
                            g.expert_down, s.moe_dh, s.moe_dgate, s.moe_dup, dys, a.gates,
                            s.moe_slot_of_row, s.moe_rows, a.egate, a.eup, a.eh, w.expert_gate,
                            w.expert_up, w.expert_down, offsets, {E, C, Fe}, ec);
    if (shared) shared_backward();
  }
  k::moe_combine(s.dxn, s.moe_grad, nullptr, s.moe_row_of_slot, N, K, C, k::Out::kWrite);
  // Each tp rank holds a slice of every expert's width: its gate gradients are partial sums.
  if (tp_.size() > 1) tp_.all_reduce(s.moe_dgates, static_cast<size_t>(S));
  if (shared) {
    k::linear_backward_input(exec, s.dtmp, shared_dgate, w.shared_gate, N, C, Fs);
    k::add_inplace(exec, s.dxn, s.dtmp, N * C);
    k::linear_backward_input(exec, s.dtmp, shared_dup, w.shared_up, N, C, Fs);
    k::add_inplace(exec, s.dxn, s.dtmp, N * C);
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
    k::add_inplace(exec, s.dxn, s.dtmp, N * C);
  }
  const int64_t first = sp_ ? tp_.rank() * rows_local_ : 0;
  if (keep)
    std::copy_n(s.moe_dlogits + first * E, rows_local_ * E, keep->router_dlogits);
  else
    k::linear_backward_weight(rk, g.router, s.moe_dlogits + first * E, a.xn2 + first * C,
                              rows_local_, C, E);
}

// W of a mixture-of-experts block's MLP: every weight gradient moe_backward left to it, from the
// output gradients it kept and the forward's activations (the same GEMMs on the same values).
void Model::moe_backward_weights(int64_t l, const LayerActs& a, const BlockCopies& copies,
                                 const BlockParams& g, const LayerGrads& kept) {
  const k::Exec& exec = options_.exec;
  const k::GemmKind kind = exec.gemm;
  const int64_t N = rows_, C = config_.dim, E = config_.n_experts, K = config_.experts_per_token;
  const int64_t Fe = config_.moe_ffn_dim / tp_.size();
  auto& s = *scratch_;
  if (copies.xn2 && k::gemm_kind_is_bf16(kind)) k::bf16_to_float_threads(a.xn2, copies.xn2, N * C);
  if (ep_size() > 1) {
    // The rows the experts took are kept (a.ex); their expert-major blocks by source rank from
    // the counts the forward received.
    const int64_t P = ep_size(), El = experts_.size(config_);
    auto& route = ep_route_;
    k::moe_ep_offsets(route.local_offsets.data(), route.source_offsets.data(),
                      reinterpret_cast<const int32_t*>(a.erecv), P, El);
    k::moe_experts_backward_weight(exec, g.expert_gate, g.expert_up, g.expert_down, kept.expert_dy,
                                   kept.expert_dgate, kept.expert_dup, a.ex, a.eh,
                                   route.local_offsets.data(),
                                   {El, C, Fe, P, route.source_offsets.data()}, copies.experts());
  } else {
    // The experts' input rows again: the same permutation of the same routing, the same gather.
    int64_t* offsets = expert_offsets_.data();
    k::moe_permute(offsets, s.moe_row_of_slot, s.moe_slot_of_row,
                   reinterpret_cast<const int32_t*>(a.chosen), N, E, K,
                   k::moe_capacity(config_.capacity_factor, N, E, K));
    const k::ExpertCopies ec = gather_expert_rows(a, copies, offsets[E]);
    k::moe_experts_backward_weight(exec, g.expert_gate, g.expert_up, g.expert_down, kept.expert_dy,
                                   kept.expert_dgate, kept.expert_dup, s.moe_rows, a.eh, offsets,
                                   {E, C, Fe}, ec);
  }
  if (block_has(config_, l, BlockWeight::kSharedGate)) {
    const int64_t Fs = config_.shared_ffn_dim() / tp_.size();
    k::linear_backward_weight(exec, g.shared_down, kept.dy_down, a.sh, N, Fs, C);
    k::linear_backward_weight(exec, g.shared_gate, kept.dgate, a.xn2, N, C, Fs);
    k::linear_backward_weight(exec, g.shared_up, kept.dup, a.xn2, N, C, Fs);
  }
  const int64_t first = sp_ ? tp_.rank() * rows_local_ : 0;
  k::linear_backward_weight(router_kind(kind), g.router, kept.router_dlogits, a.xn2 + first * C,
                            rows_local_, C, E);
}

k::ExpertCopies Model::gather_expert_rows(const LayerActs& a, const BlockCopies& copies,
                                          int64_t rows) {
  auto& s = *scratch_;
  const int64_t K = config_.experts_per_token, C = config_.dim;
  k::ExpertCopies ec = copies.experts();
  if (!ec.fused() || !copies.xn2) {
    k::moe_gather(s.moe_rows, a.xn2, s.moe_slot_of_row, rows, K, C);
    return ec;
  }
  auto* rows16 = reinterpret_cast<k::bf16*>(s.moe_rows);
  k::moe_gather(rows16, copies.xn2, s.moe_slot_of_row, rows, K, C);
  ec.xs = rows16;
  return ec;
}

// Expert parallelism (docs/moe.md). The slots this rank routed are sorted by expert (moe_permute,
// rows in scratch moe_rows); the rows of EP rank q's experts go to q. First every rank tells every
// other how many rows each of its experts gets (an all-to-all of El counts per pair, kept in
// a.erecv for the backward), then the rows travel (an all-to-allv, source-rank order), are
// reordered expert-major, run through the local experts, and come back the same way.
void Model::ep_plan(const int32_t* recv) {
  const int64_t P = ep_size(), El = experts_.size(config_);
  const int64_t* offsets = expert_offsets_.data();
  int send_at = 0, recv_at = 0;
  for (int64_t q = 0; q < P; ++q) {
    const auto to_q = static_cast<int>(offsets[(q + 1) * El] - offsets[q * El]);
    int from_q = 0;
    for (int64_t j = 0; j < El; ++j) from_q += recv[q * El + j];
    const auto i = static_cast<size_t>(q);
    ep_route_.send_counts[i] = to_q, ep_route_.send_displs[i] = send_at;
    ep_route_.recv_counts[i] = from_q, ep_route_.recv_displs[i] = recv_at;
    send_at += to_q, recv_at += from_q;
  }
  k::moe_ep_offsets(ep_route_.local_offsets.data(), ep_route_.source_offsets.data(), recv, P, El);
  T3D_ASSERT(recv_at <= ep_rows_, "the experts of this rank take ", recv_at,
             " rows, more than the ", ep_rows_, " their buffers hold");
}

Model::RowsInFlight Model::moe_ep_dispatch(LayerActs& a) {
  const parallel::Comm& ep = *options_.ep;
  const int64_t E = config_.n_experts, El = experts_.size(config_);
  auto& s = *scratch_;
  auto* recv = reinterpret_cast<int32_t*>(a.erecv);
  for (int64_t e = 0; e < E; ++e)
    ep_route_.mine[static_cast<size_t>(e)] =
        static_cast<int32_t>(expert_offsets_[e + 1] - expert_offsets_[e]);
  ep.all_to_all(ep_route_.mine.data(), recv, static_cast<size_t>(El));
  ep_plan(recv);
  const auto& r = ep_route_;
  return start_ep_exchange(s.moe_rows, r.send_counts, r.send_displs, s.moe_ep_rows, r.recv_counts,
                           r.recv_displs);
}

void Model::moe_experts_ep_forward(LayerActs& a, const BlockCopies& copies, const ConstBlock& w,
                                   RowsInFlight& dispatch) {
  const int64_t P = ep_size(), El = experts_.size(config_), C = config_.dim,
                Fe = config_.moe_ffn_dim / tp_.size();
  auto& s = *scratch_;
  const auto* recv = reinterpret_cast<const int32_t*>(a.erecv);
  const auto& r = ep_route_;
  finish_ep_exchange(dispatch);
  k::moe_ep_reorder(a.ex, s.moe_ep_rows, recv, r.source_offsets.data(), P, El, C, true);
  k::moe_experts_forward(options_.exec, s.moe_ep_out, a.egate, a.eup, a.eh, a.ex, w.expert_gate,
                         w.expert_up, w.expert_down, r.local_offsets.data(), {El, C, Fe},
                         copies.experts());
  k::moe_ep_reorder(s.moe_ep_rows, s.moe_ep_out, recv, r.source_offsets.data(), P, El, C, false);
  ep_exchange(s.moe_ep_rows, r.recv_counts, r.recv_displs, s.moe_out, r.send_counts, r.send_displs);
}

// The mirror image: each row's output gradient (scratch moe_out) and gate travel to its expert,
// the experts' backward runs on the rows they took in the forward (a.ex), and every row's input
// gradient (into moe_grad) and gate gradient (into moe_dgates, by slot) come back.
Model::RowsInFlight Model::moe_ep_dispatch_backward(LayerActs& a) {
  const parallel::Comm& ep = *options_.ep;
  const int64_t P = ep_size(), El = experts_.size(config_),
                kept = expert_offsets_[config_.n_experts];
  auto& s = *scratch_;
  const auto* recv = reinterpret_cast<const int32_t*>(a.erecv);
  ep_plan(recv);
  const auto& r = ep_route_;
  for (int64_t row = 0; row < kept; ++row) s.moe_ep_gates[row] = a.gates[s.moe_slot_of_row[row]];
  ep.start_all_to_allv(ep_exchange_, s.moe_ep_gates, r.send_counts, r.send_displs, s.moe_ep_dgates,
                       r.recv_counts, r.recv_displs);
  ep.wait(ep_exchange_);
  k::moe_ep_reorder(s.moe_ep_gates, s.moe_ep_dgates, recv, r.source_offsets.data(), P, El, 1, true);
  return start_ep_exchange(s.moe_out, r.send_counts, r.send_displs, s.moe_ep_rows, r.recv_counts,
                           r.recv_displs);
}

void Model::moe_experts_ep_backward(LayerActs& a, const BlockCopies& copies, const ConstBlock& w,
                                    const BlockParams& g, RowsInFlight& dispatch,
                                    const LayerGrads* keep) {
  const parallel::Comm& ep = *options_.ep;
  const int64_t P = ep_size(), El = experts_.size(config_), C = config_.dim,
                Fe = config_.moe_ffn_dim / tp_.size(), kept = expert_offsets_[config_.n_experts];
  auto& s = *scratch_;
  const auto* recv = reinterpret_cast<const int32_t*>(a.erecv);
  const auto& r = ep_route_;
  finish_ep_exchange(dispatch);
  // With `keep` the gated output gradients and the gate and up gradients stay for W.
  float* dys = keep ? keep->expert_dy : s.moe_ep_out;
  k::moe_ep_reorder(dys, s.moe_ep_rows, recv, r.source_offsets.data(), P, El, C, true);
  // The rows are their own slots here (moe_ep_index is the identity): gates and gate gradients
  // by row.
  const k::ExpertShape shape{El, C, Fe, P, r.source_offsets.data()};
  if (keep)
    k::moe_experts_backward_input(options_.exec, s.moe_ep_rows, s.moe_ep_dgates, s.moe_dh,
                                  keep->expert_dgate, keep->expert_dup, dys, s.moe_ep_gates,
                                  s.moe_ep_index, a.egate, a.eup, a.eh, w.expert_gate, w.expert_up,
                                  w.expert_down, r.local_offsets.data(), shape, copies.experts());
  else
    k::moe_experts_backward(options_.exec, s.moe_ep_rows, s.moe_ep_dgates, g.expert_gate,
                            g.expert_up, g.expert_down, s.moe_dh, s.moe_dgate, s.moe_dup, dys,
                            s.moe_ep_gates, s.moe_ep_index, a.ex, a.egate, a.eup, a.eh,
                            w.expert_gate, w.expert_up, w.expert_down, r.local_offsets.data(),
                            shape, copies.experts());
  k::moe_ep_reorder(s.moe_ep_out, s.moe_ep_rows, recv, r.source_offsets.data(), P, El, C, false);
  ep_exchange(s.moe_ep_out, r.recv_counts, r.recv_displs, s.moe_grad, r.send_counts, r.send_displs);
  k::moe_ep_reorder(s.moe_ep_gates, s.moe_ep_dgates, recv, r.source_offsets.data(), P, El, 1,
                    false);
  ep.start_all_to_allv(ep_exchange_, s.moe_ep_gates, r.recv_counts, r.recv_displs, s.moe_ep_dgates,
                       r.send_counts, r.send_displs);
  ep.wait(ep_exchange_);
  for (int64_t row = 0; row < kept; ++row)
    s.moe_dgates[s.moe_slot_of_row[row]] = s.moe_ep_dgates[row];
}

void Model::ep_exchange(const float* send, const std::vector<int>& sent,
                        const std::vector<int>& sent_at, float* recv,
                        const std::vector<int>& received, const std::vector<int>& received_at) {
  RowsInFlight rows = start_ep_exchange(send, sent, sent_at, recv, received, received_at);
  finish_ep_exchange(rows);
}

Model::RowsInFlight Model::start_ep_exchange(const float* send, const std::vector<int>& sent,
                                             const std::vector<int>& sent_at, float* recv,
                                             const std::vector<int>& received,
                                             const std::vector<int>& received_at) {
  const parallel::Comm& ep = *options_.ep;
  const auto C = static_cast<size_t>(config_.dim);
  RowsInFlight f;
  f.recv = recv;
  f.rows = static_cast<int64_t>(received_at.back()) + received.back();
  if (!options_.bf16) {
    ep.start_all_to_allv(ep_exchange_, send, sent, sent_at, recv, received, received_at, C);
    return f;
  }
  auto& s = *scratch_;
  const int64_t sent_rows = static_cast<int64_t>(sent_at.back()) + sent.back();
  k::float_to_bf16_threads(s.ep16_send, send, sent_rows * config_.dim);
  ep.start_all_to_allv(ep_exchange_, s.ep16_send, sent, sent_at, s.ep16_recv, received, received_at,
                       C);
  return f;
}

void Model::finish_ep_exchange(RowsInFlight& rows) {
  options_.ep->wait(ep_exchange_);
  if (options_.bf16)
    k::bf16_to_float_threads(rows.recv, scratch_->ep16_recv, rows.rows * config_.dim);
}

}  // namespace t3d::runtime
