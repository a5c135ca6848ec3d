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
#include "runtime/model/moe_block.h"

namespace t3d::runtime {

namespace k = t3d::kernels;
using Copy = k::LinearInput::Copy;

void Model::reset_moe_stats() {
  std::fill(expert_counts_.begin(), expert_counts_.end(), 0.0);
  std::fill(dropped_slots_.begin(), dropped_slots_.end(), 0.0);
  aux_loss_ = 0;
}

k::ExpertShape Model::expert_shape() const { return {dims_.E, dims_.C, dims_.Fe}; }

k::SwigluWeights Model::shared_weights(const ConstBlock& w) {
  return {w.shared_gate, w.shared_up, w.shared_down};
}

int64_t Model::routing_to_host(const LayerActs& a, BlockPass pass) {
  const k::Exec& exec = options_.exec;
  const int64_t N = rows_, E = dims_.E, K = dims_.K, S = N * K;
  auto& h = routing_host_;
  BlockRouting& kept = *a.routing;
  int64_t* offsets = kept.offsets.data();
  // A recomputed block's training forward permutes into the block's own maps, which its
  // recompute then copies in as they are (the same routing: it depends on the block's input
  // alone), without the crossing of `chosen`.
  const bool keeps_maps = !kept.row_of_slot.empty() && pass != BlockPass::kEvaluation;
  T3D_ASSERT(keeps_maps || pass != BlockPass::kRecompute, "a recompute without kept slot maps");
  int32_t* row_of_slot = keeps_maps ? kept.row_of_slot.data() : h.row_of_slot.data();
  int32_t* slot_of_row = keeps_maps ? kept.slot_of_row.data() : h.slot_of_row.data();
  int64_t dropped = 0;
  if (pass != BlockPass::kRecompute) {
    // The crossing: `chosen` to the host, the permutation there (offsets for the experts' GEMM
    // shapes, which the host launches), the slot maps back into the Exec's memory for the
    // gathers and the combine. On a GPU the copy out waits for the stream; the maps go in
    // without a wait (small uploads).
    k::copy_to_host(exec, h.chosen.data(), a.chosen, static_cast<size_t>(S) * sizeof(int32_t));
    dropped = k::moe_permute(offsets, row_of_slot, slot_of_row, h.chosen.data(), N, E, K,
                             k::moe_capacity(config_.capacity_factor, N, E, K));
  }
  k::copy_from_host(exec, a.row_of_slot, row_of_slot, static_cast<size_t>(S) * sizeof(int32_t));
  k::copy_from_host(exec, a.slot_of_row, slot_of_row,
                    static_cast<size_t>(offsets[E]) * sizeof(int32_t));
  return dropped;
}

void Model::moe_forward(int64_t l, LayerActs& a, const BlockCopies& copies, const ConstBlock& w,
                        BlockPass pass) {
  const k::Exec& exec = options_.exec;
  const k::RouterShape r = router_shape(config_, rows_);
  const int64_t N = rows_, C = dims_.C, E = dims_.E, K = dims_.K;
  auto& s = *scratch_;
  // A bf16-stored block keeps xn2 only as the copy its forward fills (encode16 leaves it out):
  // the norm did, except after a sequence-parallel gather.
  if (copies.xn2 && sp_) k::float_to_bf16(options_.exec, copies.xn2, a.xn2, N * C);
  route(exec, a.scores, a.chosen, a.gates, a.xn2, w.router,
        block_has(config_, l, BlockWeight::kRouterBias) ? w.router_bias : nullptr, r, C);
  const bool training = pass == BlockPass::kTraining;
  if (training) add_aux_loss(a, r);
  const int64_t dropped = routing_to_host(a, pass);
  const int64_t* offsets = a.routing->offsets.data();
  T3D_ASSERT(offsets[E] <= ep_rows_, "the experts take ", offsets[E], " rows, more than the ",
             ep_rows_, " their buffers hold");
  k::ExpertCopies ec;  // under expert parallelism the rows travel as floats
  if (ep_size() > 1)
    k::moe_gather(exec, s.moe_rows, a.xn2, a.slot_of_row, offsets[E], K, C);
  else
    ec = gather_expert_rows(a, copies, offsets[E]);
  const bool shared = block_has(config_, l, BlockWeight::kSharedGate);
  const k::SwigluActs sa{a.sgate, a.sup, a.sh};
  // The shared experts' hidden layer needs nothing routed: under expert parallelism it runs
  // while the routed rows travel. Only its down projection, added to the routed output, waits.
  const auto shared_hidden = [&] {
    const k::LinearInput x(exec, a.xn2, copies.xn2, copies.xn2 ? Copy::kFilled : Copy::kFill, N, C);
    k::swiglu_mlp_hidden(exec, x, shared_weights(w), sa, copies.shared(), dims_.Fs);
  };
  if (ep_size() > 1) {
    RowsInFlight dispatch = moe_ep_dispatch(a);
    if (shared) shared_hidden();
    moe_experts_ep_forward(a, copies, w, dispatch);
  } else {
    k::moe_experts_forward(exec, s.moe_out, {a.egate, a.eup, a.eh}, s.moe_rows,
                           {w.expert_gate, w.expert_up, w.expert_down}, offsets, expert_shape(),
                           ec);
    if (shared) shared_hidden();
  }
  k::moe_combine(exec, s.tmp, s.moe_out, a.gates, a.row_of_slot, N, K, C, k::Out::kWrite);
  if (shared) shared_experts_down(l, a, copies, w);
  if (training) count_routing(l, dropped);
}

void Model::add_aux_loss(const LayerActs& a, const k::RouterShape& r) {
  if (options_.moe_aux_weight > 0)
    aux_loss_ +=
        options_.moe_aux_weight * k::moe_aux_loss(options_.exec, nullptr, a.scores, a.chosen,
                                                  options_.micro_rows, seq_local_, r, 0);
}

void Model::count_routing(int64_t l, int64_t dropped) {
  const int64_t E = dims_.E;
  const size_t at = static_cast<size_t>(
      std::lower_bound(moe_layers_.begin(), moe_layers_.end(), l) - moe_layers_.begin());
  // From the host copy of a.chosen routing_to_host has just made.
  k::moe_count(expert_counts_.data() + at * static_cast<size_t>(E), routing_host_.chosen.data(),
               rows_, E, dims_.K);
  dropped_slots_[at] += static_cast<double>(dropped);
}

void Model::moe_backward(int64_t l, LayerActs& a, const BlockCopies& copies, const ConstBlock& w,
                         const BlockParams& g, const float* dy, const LayerGrads* keep) {
  const k::Exec& exec = options_.exec;
  const int64_t N = rows_, C = dims_.C, K = dims_.K, S = dims_.S, Fs = dims_.Fs;
  auto& s = *scratch_;
  // With bf16 GEMMs decode16 leaves xn2 in its copy only: the router and the gathers read floats.
  if (copies.xn2 && k::gemm_kind_is_bf16(exec.gemm))
    k::bf16_to_float(options_.exec, a.xn2, copies.xn2, N * C);
  // Routed experts (the forward's routing, a.routing and the slot maps): xs in moe_rows, dy's
  // rows in moe_out (clobbered), dxs in moe_grad. A dropped slot has no row: its gate's gradient
  // stays 0.
  const int64_t* offsets = a.routing->offsets.data();
  const int64_t kept = offsets[dims_.E];
  // With `keep` the experts' gated output gradients and their gate and up gradients are written
  // where W reads them.
  float* dys = keep && ep_size() == 1 ? keep->expert_dy : s.moe_out;
  k::moe_gather(exec, dys, dy, a.slot_of_row, kept, K, C);
  k::zero(exec, s.moe_dgates, S);
  const bool shared = block_has(config_, l, BlockWeight::kSharedGate);
  float* shared_dgate = keep ? keep->dgate : s.dgate;
  float* shared_dup = keep ? keep->dup : s.dup;
  // The shared experts' output gradient: dy, or g ⊙ dy behind their gate.
  const float* shared_dy = shared ? shared_gate_backward(l, a, copies, w, dy, keep) : dy;
  const k::SwigluActs sa{a.sgate, a.sup, a.sh};
  // The shared experts' gradients that add nothing to dxn: under expert parallelism they run
  // while the routed rows' output gradients travel.
  const auto shared_backward = [&] {
    const k::LinearInput dy_in(exec, shared_dy, N, C);
    k::swiglu_mlp_backward_hidden(exec, shared_dgate, shared_dup, s.dh, dy_in, shared_weights(w),
                                  sa, copies.shared(), Fs);
    if (keep) return;
    const k::LinearInput x(exec, a.xn2, copies.xn2, Copy::kFilled, N, C);
    k::swiglu_mlp_backward_weight(exec, {g.shared_gate, g.shared_up, g.shared_down}, dy_in, x,
                                  shared_dgate, shared_dup, sa, copies.shared(), Fs);
  };
  const k::ExpertGating gating{a.gates, s.moe_dgates, a.slot_of_row};
  const k::ExpertWeights ew{w.expert_gate, w.expert_up, w.expert_down};
  const k::ExpertActs acts{a.egate, a.eup, a.eh};
  if (ep_size() > 1) {
    RowsInFlight dispatch = moe_ep_dispatch_backward(a);
    if (shared) shared_backward();
    moe_experts_ep_backward(a, copies, w, g, dispatch, keep);
  } else if (keep) {
    k::moe_experts_backward_input(exec, s.moe_grad, gating,
                                  {s.moe_dh, keep->expert_dgate, keep->expert_dup}, dys, acts, ew,
                                  offsets, expert_shape(), copies.experts());
    if (shared) shared_backward();
  } else {
    const k::ExpertCopies ec = gather_expert_rows(a, copies, kept);
    k::moe_experts_backward(exec, s.moe_grad, gating, {g.expert_gate, g.expert_up, g.expert_down},
                            {s.moe_dh, s.moe_dgate, s.moe_dup}, dys, s.moe_rows, acts, ew, offsets,
                            expert_shape(), ec);
    if (shared) shared_backward();
  }
  k::moe_combine(exec, s.dxn, s.moe_grad, nullptr, a.row_of_slot, N, K, C, k::Out::kWrite);
  // Each tp rank holds a slice of every expert's width: its gate gradients are partial sums.
  if (tp_.size() > 1) tp_.all_reduce(s.moe_dgates, static_cast<size_t>(S));
  if (shared)
    k::swiglu_mlp_backward_input(exec, s.dxn, k::Out::kAccumulate, s.dtmp, shared_dgate, shared_dup,
                                 shared_weights(w), copies.shared(), N, C, Fs);
  if (shared) shared_gate_backward_finish(l, a, w, g, keep);
  router_backward(a, w, g, keep);
}

// The router: the gates' gradient (and the auxiliary loss's, injected here at the layer, so that
// it is the same under any pipeline split), through the scores to the logits.
void Model::router_backward(const LayerActs& a, const ConstBlock& w, const BlockParams& g,
                            const LayerGrads* keep) {
  const k::Exec& exec = options_.exec;
  const k::RouterShape r = router_shape(config_, rows_);
  const int64_t N = rows_, C = dims_.C, E = dims_.E;
  auto& s = *scratch_;
  const float* dscores_aux = nullptr;
  if (options_.moe_aux_weight > 0) {
    k::moe_aux_loss_backward(exec, s.moe_dscores, a.scores, a.chosen, options_.micro_rows,
                             seq_local_, r, static_cast<float>(options_.moe_aux_weight));
    dscores_aux = s.moe_dscores;
  }
  k::moe_route_backward(exec, s.moe_dlogits, s.moe_dgates, dscores_aux, a.scores, a.chosen, r);
  // The router is replicated over tp and every rank's dlogits are the same: its part of the
  // input gradient joins the others' partial sums on one rank only. Its weight gradient is
  // whole on every rank, or with sequence parallelism this rank's rows' part, which
  // sum_replicated_grads adds up over tp as it does the norms'.
  const k::Exec rexec = router_exec(exec);
  if (tp_.rank() == 0) {
    k::linear_backward_input(rexec, s.dtmp, s.moe_dlogits, w.router, N, C, E);
    k::add_inplace(exec, s.dxn, s.dtmp, N * C);
  }
  const int64_t first = sp_ ? tp_.rank() * rows_local_ : 0;
  if (keep)
    k::copy(exec, keep->router_dlogits, s.moe_dlogits + first * E, rows_local_ * E);
  else
    k::linear_backward_weight(rexec, g.router, s.moe_dlogits + first * E, a.xn2 + first * C,
                              rows_local_, C, E);
}

// W of a mixture-of-experts block's MLP: every weight gradient moe_backward left to it, from the
// output gradients it kept and the forward's activations (the same GEMMs on the same values).
void Model::moe_backward_weights(int64_t l, const LayerActs& a, const BlockCopies& copies,
                                 const BlockParams& g, const LayerGrads& kept) {
  const k::Exec& exec = options_.exec;
  const int64_t N = rows_, C = dims_.C, E = dims_.E;
  if (copies.xn2 && k::gemm_kind_is_bf16(exec.gemm))
    k::bf16_to_float(options_.exec, a.xn2, copies.xn2, N * C);
  const k::ExpertGrads eg{g.expert_gate, g.expert_up, g.expert_down};
  const k::ExpertActGrads ed{nullptr, kept.expert_dgate, kept.expert_dup};
  if (ep_size() > 1) {
    // The rows the experts took are kept (a.ex); their expert-major blocks by source rank from
    // the counts the forward received.
    const int64_t P = ep_size(), El = dims_.El;
    auto& route = ep_route_;
    k::moe_ep_offsets(route.local_offsets.data(), route.source_offsets.data(),
                      a.routing->ep_recv.data(), P, El);
    k::moe_experts_backward_weight(
        exec, eg, kept.expert_dy, ed, a.ex, a.eh, route.local_offsets.data(),
        {El, C, dims_.Fe, P, route.source_offsets.data()}, copies.experts());
  } else {
    // The experts' input rows again: the forward's routing, the same gather.
    const int64_t* offsets = a.routing->offsets.data();
    const k::ExpertCopies ec = gather_expert_rows(a, copies, offsets[E]);
    k::moe_experts_backward_weight(exec, eg, kept.expert_dy, ed, scratch_->moe_rows, a.eh, offsets,
                                   expert_shape(), ec);
  }
  if (block_has(config_, l, BlockWeight::kSharedGate)) {
    const k::LinearInput dy(exec, kept.dy_down, N, C);
    const k::LinearInput x(exec, a.xn2, copies.xn2, Copy::kFilled, N, C);
    k::swiglu_mlp_backward_weight(exec, {g.shared_gate, g.shared_up, g.shared_down}, dy, x,
                                  kept.dgate, kept.dup, {a.sgate, a.sup, a.sh}, copies.shared(),
                                  dims_.Fs);
    if (block_has(config_, l, BlockWeight::kSharedExpertGate))
      shared_gate_weight_grad(a, g, kept.gate_dz);
  }
  const int64_t first = sp_ ? tp_.rank() * rows_local_ : 0;
  k::linear_backward_weight(router_exec(exec), g.router, kept.router_dlogits, a.xn2 + first * C,
                            rows_local_, C, E);
}

k::ExpertCopies Model::gather_expert_rows(const LayerActs& a, const BlockCopies& copies,
                                          int64_t rows) {
  const k::Exec& exec = options_.exec;
  auto& s = *scratch_;
  const int64_t K = dims_.K, C = dims_.C;
  k::ExpertCopies ec = copies.experts();
  if (!ec.fused() || !copies.xn2) {
    k::moe_gather(exec, s.moe_rows, a.xn2, a.slot_of_row, rows, K, C);
    return ec;
  }
  auto* rows16 = reinterpret_cast<k::bf16*>(s.moe_rows);
  k::moe_gather(exec, rows16, copies.xn2, a.slot_of_row, rows, K, C);
  ec.xs = rows16;
  return ec;
}

// Expert parallelism (docs/moe.md). The slots this rank routed are sorted by expert (moe_permute,
// rows in scratch moe_rows); the rows of EP rank q's experts go to q. First every rank tells every
// other how many rows each of its experts gets (an all-to-all of El counts per pair, kept in
// a.routing for the backward), then the rows travel (an all-to-allv, source-rank order), are
// reordered expert-major, run through the local experts, and come back the same way.
void Model::ep_plan(const BlockRouting& routing) {
  const int64_t P = ep_size(), El = dims_.El;
  const int64_t* offsets = routing.offsets.data();
  const int32_t* recv = routing.ep_recv.data();
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
  const int64_t E = dims_.E, El = dims_.El;
  auto& s = *scratch_;
  const int64_t* offsets = a.routing->offsets.data();
  for (int64_t e = 0; e < E; ++e)
    ep_route_.mine[static_cast<size_t>(e)] = static_cast<int32_t>(offsets[e + 1] - offsets[e]);
  // Host values both ways, kept with the block's routing for the backward.
  ep.all_to_all(ep_route_.mine.data(), a.routing->ep_recv.data(), static_cast<size_t>(El));
  ep_plan(*a.routing);
  const auto& r = ep_route_;
  return start_ep_exchange(s.moe_rows, r.send_counts, r.send_displs, s.moe_ep_rows, r.recv_counts,
                           r.recv_displs);
}

void Model::moe_experts_ep_forward(LayerActs& a, const BlockCopies& copies, const ConstBlock& w,
                                   RowsInFlight& dispatch) {
  const k::Exec& exec = options_.exec;
  const int64_t P = ep_size(), El = dims_.El, C = dims_.C;
  auto& s = *scratch_;
  const int32_t* recv = a.routing->ep_recv.data();  // moe_ep_dispatch's
  const auto& r = ep_route_;
  finish_ep_exchange(dispatch);
  k::moe_ep_reorder(exec, a.ex, s.moe_ep_rows, recv, r.source_offsets.data(), P, El, C, true);
  k::moe_experts_forward(exec, s.moe_ep_out, {a.egate, a.eup, a.eh}, a.ex,
                         {w.expert_gate, w.expert_up, w.expert_down}, r.local_offsets.data(),
                         {El, C, dims_.Fe}, copies.experts());
  k::moe_ep_reorder(exec, s.moe_ep_rows, s.moe_ep_out, recv, r.source_offsets.data(), P, El, C,
                    false);
  ep_exchange(s.moe_ep_rows, r.recv_counts, r.recv_displs, s.moe_out, r.send_counts, r.send_displs);
}

// The mirror image: each row's output gradient (scratch moe_out) and gate travel to its expert,
// the experts' backward runs on the rows they took in the forward (a.ex), and every row's input
// gradient (into moe_grad) and gate gradient (into moe_dgates, by slot) come back.
Model::RowsInFlight Model::moe_ep_dispatch_backward(LayerActs& a) {
  const k::Exec& exec = options_.exec;
  const parallel::TensorComm& ep = ep_rows();  // the rows: tensors
  const int64_t P = ep_size(), El = dims_.El, kept = a.routing->offsets[dims_.E];
  auto& s = *scratch_;
  const int32_t* recv = a.routing->ep_recv.data();  // the forward's
  ep_plan(*a.routing);
  const auto& r = ep_route_;
  k::moe_gather_slots(exec, s.moe_ep_gates, a.gates, a.slot_of_row, kept);
  ep.start_all_to_allv(ep_exchange_, s.moe_ep_gates, r.send_counts, r.send_displs, s.moe_ep_dgates,
                       r.recv_counts, r.recv_displs, 1);  // one gate per row
  ep.wait(ep_exchange_);
  k::moe_ep_reorder(exec, s.moe_ep_gates, s.moe_ep_dgates, recv, r.source_offsets.data(), P, El, 1,
                    true);
  return start_ep_exchange(s.moe_out, r.send_counts, r.send_displs, s.moe_ep_rows, r.recv_counts,
                           r.recv_displs);
}

void Model::moe_experts_ep_backward(LayerActs& a, const BlockCopies& copies, const ConstBlock& w,
                                    const BlockParams& g, RowsInFlight& dispatch,
                                    const LayerGrads* keep) {
  const k::Exec& exec = options_.exec;
  const parallel::TensorComm& ep = ep_rows();  // the rows: tensors
  const int64_t P = ep_size(), El = dims_.El, C = dims_.C, kept = a.routing->offsets[dims_.E];
  auto& s = *scratch_;
  const int32_t* recv = a.routing->ep_recv.data();  // the forward's
  const auto& r = ep_route_;
  finish_ep_exchange(dispatch);
  // With `keep` the gated output gradients and the gate and up gradients stay for W.
  float* dys = keep ? keep->expert_dy : s.moe_ep_out;
  k::moe_ep_reorder(exec, dys, s.moe_ep_rows, recv, r.source_offsets.data(), P, El, C, true);
  // The rows are their own slots here (moe_ep_index is the identity): gates and gate gradients
  // by row.
  const k::ExpertShape shape{El, C, dims_.Fe, P, r.source_offsets.data()};
  const k::ExpertGating gating{s.moe_ep_gates, s.moe_ep_dgates, s.moe_ep_index};
  const k::ExpertActs acts{a.egate, a.eup, a.eh};
  const k::ExpertWeights ew{w.expert_gate, w.expert_up, w.expert_down};
  if (keep)
    k::moe_experts_backward_input(exec, s.moe_ep_rows, gating,
                                  {s.moe_dh, keep->expert_dgate, keep->expert_dup}, dys, acts, ew,
                                  r.local_offsets.data(), shape, copies.experts());
  else
    k::moe_experts_backward(exec, s.moe_ep_rows, gating,
                            {g.expert_gate, g.expert_up, g.expert_down},
                            {s.moe_dh, s.moe_dgate, s.moe_dup}, dys, a.ex, acts, ew,
                            r.local_offsets.data(), shape, copies.experts());
  k::moe_ep_reorder(exec, s.moe_ep_out, s.moe_ep_rows, recv, r.source_offsets.data(), P, El, C,
                    false);
  ep_exchange(s.moe_ep_out, r.recv_counts, r.recv_displs, s.moe_grad, r.send_counts, r.send_displs);
  k::moe_ep_reorder(exec, s.moe_ep_gates, s.moe_ep_dgates, recv, r.source_offsets.data(), P, El, 1,
                    false);
  ep.start_all_to_allv(ep_exchange_, s.moe_ep_gates, r.recv_counts, r.recv_displs, s.moe_ep_dgates,
                       r.send_counts, r.send_displs, 1);  // one gate per row
  ep.wait(ep_exchange_);
  k::moe_scatter_slots(exec, s.moe_dgates, s.moe_ep_dgates, a.slot_of_row, kept);
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
  const parallel::TensorComm& ep = ep_rows();  // the rows: tensors
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
  k::float_to_bf16(options_.exec, s.ep16_send, send, sent_rows * config_.dim);
  ep.start_all_to_allv(ep_exchange_, s.ep16_send, sent, sent_at, s.ep16_recv, received, received_at,
                       C);
  return f;
}

void Model::finish_ep_exchange(RowsInFlight& rows) {
  ep_rows().wait(ep_exchange_);
  if (options_.bf16)
    k::bf16_to_float(options_.exec, rows.recv, scratch_->ep16_recv, rows.rows * config_.dim);
}

}  // namespace t3d::runtime
