#include "runtime/model/model.h"

#include <algorithm>
#include <cmath>
#include <cstring>
#include <limits>
#include <utility>

#include "kernels/check.h"
#include "kernels/ops.h"
#include "kernels/ops_swiglu.h"
#include "kernels/precision.h"
#include "runtime/model/model_scratch.h"

namespace t3d::runtime {

namespace k = t3d::kernels;

namespace {
k::SwigluWeights dense_weights(const BlockTensors<const float*>& w) {
  return {w.gate, w.up, w.down};
}
}  // namespace

const float* Model::unit_weights(int64_t unit) const {
  const auto& source = weight_source_[static_cast<size_t>(state_group(config_, unit))];
  if (source) return source(unit);
  T3D_ASSERT(state_.params.data(), "a model without a parameter region needs a weight source");
  return state_.params.data() + unit_begin_.at(static_cast<size_t>(unit + 1));
}

const float* Model::w(const std::string& name, int64_t unit) const {
  return unit_weights(unit) +
         (layout_.at(name).offset - unit_begin_.at(static_cast<size_t>(unit + 1)));
}

Model::ConstBlock Model::block_weights(int64_t l) const {
  const BlockTensors<int64_t>& o = block_offsets_.at(static_cast<size_t>(l));
  const float* base = unit_weights(l);
  const float* experts = moe_block(l) ? unit_weights(experts_unit(config_, l)) : nullptr;
  ConstBlock b;
  for (const BlockWeight t : kAllBlockWeights) b[t] = (is_expert_weight(t) ? experts : base) + o[t];
  return b;
}

float* Model::unit_grads(int64_t unit) const {
  const auto& source = grad_source_[static_cast<size_t>(state_group(config_, unit))];
  if (source) return source(unit);
  T3D_ASSERT(state_.grads.data(), "a model without a gradient region needs a grad source");
  return state_.grads.data() + unit_begin_.at(static_cast<size_t>(unit + 1));
}

float* Model::g(const std::string& name, int64_t unit) const {
  return unit_grads(unit) +
         (layout_.at(name).offset - unit_begin_.at(static_cast<size_t>(unit + 1)));
}

Model::BlockParams Model::block_grads(int64_t l) const {
  const BlockTensors<int64_t>& o = block_offsets_.at(static_cast<size_t>(l));
  float* base = unit_grads(l);
  float* experts = moe_block(l) ? unit_grads(experts_unit(config_, l)) : nullptr;
  BlockParams b;
  for (const BlockWeight t : kAllBlockWeights) b[t] = (is_expert_weight(t) ? experts : base) + o[t];
  return b;
}

void Model::unit_done(int64_t unit) const {
  const auto& hook = grad_hook_[static_cast<size_t>(state_group(config_, unit))];
  if (hook) hook(unit);
}

void Model::block_done(int64_t l) const {
  unit_done(l);
  if (moe_block(l)) unit_done(experts_unit(config_, l));
}

float* Model::input(int chunk, int slot) { return acts_.at(chunk).at(slot)->x[0]; }
const float* Model::output(int chunk, int slot) const { return acts_.at(chunk).at(slot)->x.back(); }
const float* Model::input_grad(int chunk, int slot) const {
  return acts_.at(chunk).at(slot)->dx_in;
}

void Model::forward_layer(int64_t l, LayerActs& a, const BlockCopies& copies, const float* x_in,
                          float* x_out, BlockPass pass) {
  const k::Exec& exec = options_.exec;
  const ConstBlock pw = block_weights(l);
  const int64_t N = rows_, C = config_.dim, D = config_.head_dim();
  const int64_t B = options_.micro_rows;
  const int64_t qd = heads_ * D, kvd = kv_heads_ * D;
  auto& s = *scratch_;
  const int64_t Nl = rows_local_;
  float* xn1_rows = sp_ ? s.rows : a.xn1;  // SP: normalise this rank's rows, then gather
  // Without SP the norms write the bf16 copies their GEMMs read (with SP those are filled after
  // the gather).
  using Copy = k::LinearInput::Copy;
  const Copy normed = sp_ ? Copy::kFill : Copy::kFilled;
  k::rmsnorm_forward(exec, xn1_rows, a.rstd1, x_in, pw.ln1, Nl, C,
                     static_cast<float>(config_.norm_eps), sp_ ? nullptr : copies.xn1);
  gather_rows(xn1_rows, a.xn1);
  // model.qk_norm: the projections (and biases) into qraw, kraw, normalised per head into q, kk.
  float* q = config_.qk_norm ? a.qraw : a.q;
  float* kk = config_.qk_norm ? a.kraw : a.kk;
  {
    const k::LinearInput x(exec, a.xn1, copies.xn1, normed, N, C);
    k::linear_forward(q, x, pw.q, qd);
    k::linear_forward(kk, x, pw.k, kvd);
    k::linear_forward(a.v, x, pw.v, kvd);
  }
  if (config_.qkv_bias) add_qkv_bias(pw, q, kk, a.v);
  if (config_.qk_norm) {
    const auto eps = static_cast<float>(config_.norm_eps);
    k::rmsnorm_forward(exec, a.q, a.rstdq, a.qraw, pw.q_norm, N * heads_, D, eps);
    k::rmsnorm_forward(exec, a.kk, a.rstdk, a.kraw, pw.k_norm, N * kv_heads_, D, eps);
  }
  // Each part of this rank's positions (one without context parallelism) is (B, len) rows.
  const int64_t len = part_len_, part_rows = B * len;
  for (int64_t part = 0; part < parts_; ++part) {
    k::rope_forward(exec, a.q + part * part_rows * qd, a.q + part * part_rows * qd, s.rope, B, len,
                    heads_, D, part_begin(part));
    k::rope_forward(exec, a.kk + part * part_rows * kvd, a.kk + part * part_rows * kvd, s.rope, B,
                    len, kv_heads_, D, part_begin(part));
  }
  if (cp_) {
    gather_sequence(a.kk, s.k_all, kvd);
    gather_sequence(a.v, s.v_all, kvd);
  }
  for (int64_t part = 0; part < parts_; ++part)
    k::attention_forward(exec, a.att + part * part_rows * qd, a.lse + part * B * heads_ * len,
                         a.q + part * part_rows * qd, cp_ ? s.k_all : a.kk, cp_ ? s.v_all : a.v,
                         s.attn, attention_shape(part));
  // Without tensor parallelism the residual adds are the projections' (their GEMMs' epilogues on a
  // GPU); the row-parallel projections' partial sums are reduced first.
  const bool residual_in_gemm = tp_.size() == 1;
  if (residual_in_gemm) {
    k::linear_forward_residual(
        a.xmid, x_in, k::LinearInput(exec, a.att, copies.att, Copy::kFill, N, qd), pw.o, C);
  } else {
    k::linear_forward(s.tmp, k::LinearInput(exec, a.att, copies.att, Copy::kFill, N, qd), pw.o, C);
    k::add(exec, a.xmid, x_in, reduce_rows(s.tmp), Nl * C);
  }

  float* xn2_rows = sp_ ? s.rows : a.xn2;
  k::rmsnorm_forward(exec, xn2_rows, a.rstd2, a.xmid, pw.ln2, Nl, C,
                     static_cast<float>(config_.norm_eps), sp_ ? nullptr : copies.xn2);
  gather_rows(xn2_rows, a.xn2);
  if (moe_block(l)) {
    moe_forward(l, a, copies, pw, pass);
  } else {
    const k::LinearInput x(exec, a.xn2, copies.xn2, normed, N, C);
    k::swiglu_mlp_forward(exec, residual_in_gemm ? x_out : s.tmp, k::Out::kWrite, x,
                          dense_weights(pw), {a.gate, a.up, a.h}, copies.mlp(), ffn_,
                          residual_in_gemm ? a.xmid : nullptr);
    if (residual_in_gemm) return;
  }
  k::add(exec, x_out, a.xmid, reduce_rows(s.tmp), Nl * C);
}

namespace {

// The biases' K = 1 GEMMs in fp32 whatever the model's GEMM kind: y + 1·b and Σ_rows dy·1 then
// round once, as fp32 additions do (a bf16 kind would round the bias and the gradient to 8 bits).
k::Exec fp32_gemms(k::Exec exec) {
  if (k::gemm_kind_is_bf16(exec.gemm)) exec.gemm = k::GemmKind::kOneDnnF32;
  return exec;
}

}  // namespace

void Model::add_qkv_bias(const ConstBlock& w, float* q, float* kk, float* v) const {
  const k::Exec exec = fp32_gemms(options_.exec);
  const int64_t N = rows_, qd = heads_ * config_.head_dim(), kvd = kv_heads_ * config_.head_dim();
  const float* ones = scratch_->ones;  // (N, 1)
  k::linear_forward(exec, q, ones, w.q_bias, N, 1, qd, k::Out::kAccumulate);
  k::linear_forward(exec, kk, ones, w.k_bias, N, 1, kvd, k::Out::kAccumulate);
  k::linear_forward(exec, v, ones, w.v_bias, N, 1, kvd, k::Out::kAccumulate);
}

void Model::qk_norm_backward(const LayerActs& a, const ConstBlock& w, const BlockParams& g,
                             float* dq, float* dk) const {
  const k::Exec& exec = options_.exec;
  const int64_t N = rows_, D = config_.head_dim();
  float* staged = scratch_->datt;  // (N, H·D): free once attention's backward has read it
  k::rmsnorm_backward(exec, staged, g.q_norm, dq, a.qraw, w.q_norm, a.rstdq, N * heads_, D);
  k::copy(exec, dq, staged, N * heads_ * D);
  k::rmsnorm_backward(exec, staged, g.k_norm, dk, a.kraw, w.k_norm, a.rstdk, N * kv_heads_, D);
  k::copy(exec, dk, staged, N * kv_heads_ * D);
}

void Model::qkv_bias_grads(const BlockParams& g, const float* dq, const float* dk,
                           const float* dv) const {
  const k::Exec exec = fp32_gemms(options_.exec);
  const int64_t N = rows_, qd = heads_ * config_.head_dim(), kvd = kv_heads_ * config_.head_dim();
  const float* ones = scratch_->ones;
  k::linear_backward_weight(exec, g.q_bias, dq, ones, N, 1, qd);  // (qd, 1) += dq^T · 1
  k::linear_backward_weight(exec, g.k_bias, dk, ones, N, 1, kvd);
  k::linear_backward_weight(exec, g.v_bias, dv, ones, N, 1, kvd);
}

// Attention's backward from s.datt to dq, dk, dv (after RoPE's inverse): with context
// parallelism over the whole sequence's keys and values, their gradients reduce-scattered back.
void Model::backward_attention(const LayerActs& a, float* dq, float* dk, float* dv) {
  const k::Exec& exec = options_.exec;
  const int64_t D = config_.head_dim(), B = options_.micro_rows;
  const int64_t qd = heads_ * D, kvd = kv_heads_ * D;
  auto& s = *scratch_;
  const int64_t len = part_len_, part_rows = B * len;
  if (cp_) {  // the whole sequence's keys and values again (not kept: cp times their memory)
    gather_sequence(a.kk, s.k_all, kvd);
    gather_sequence(a.v, s.v_all, kvd);
    // The kernel writes (not adds) dk, dv: the second part's go to a buffer, then added.
    const int64_t whole = B * config_.seq_len * kvd;
    for (int64_t part = 0; part < 2; ++part) {
      float* dk_part = part == 0 ? s.dk_all : s.cp_kv_part;
      float* dv_part = part == 0 ? s.dv_all : s.cp_kv_part + whole;
      k::attention_backward(exec, dq + part * part_rows * qd, dk_part, dv_part,
                            s.datt + part * part_rows * qd, a.q + part * part_rows * qd, s.k_all,
                            s.v_all, a.att + part * part_rows * qd, a.lse + part * B * heads_ * len,
                            s.attn, attention_shape(part));
    }
    k::add_inplace(exec, s.dk_all, s.cp_kv_part, whole);
    k::add_inplace(exec, s.dv_all, s.cp_kv_part + whole, whole);
    scatter_sequence_grad(s.dk_all, dk, kvd);
    scatter_sequence_grad(s.dv_all, dv, kvd);
  } else {
    k::attention_backward(exec, dq, dk, dv, s.datt, a.q, a.kk, a.v, a.att, a.lse, s.attn,
                          attention_shape(0));
  }
  for (int64_t part = 0; part < parts_; ++part) {
    k::rope_backward(exec, dq + part * part_rows * qd, dq + part * part_rows * qd, s.rope, B, len,
                     heads_, D, part_begin(part));
    k::rope_backward(exec, dk + part * part_rows * kvd, dk + part * part_rows * kvd, s.rope, B, len,
                     kv_heads_, D, part_begin(part));
  }
}

void Model::backward_layer(int64_t l, LayerActs& a, const BlockCopies& copies, const float* x_in,
                           float* dx, const LayerGrads* keep) {
  const k::Exec& exec = options_.exec;
  const ConstBlock pw = block_weights(l);
  const BlockParams pg = block_grads(l);
  // dx (N, C): gradient of the block's output on entry, of its input on return. With `keep` the
  // projections' weight gradients are left to backward_layer_weights (W), their inputs kept.
  const int64_t N = rows_, C = config_.dim, D = config_.head_dim();
  const int64_t qd = heads_ * D, kvd = kv_heads_ * D;
  auto& s = *scratch_;
  float* dgate = keep ? keep->dgate : s.dgate;
  float* dup = keep ? keep->dup : s.dup;
  float* dq = keep ? keep->dq : s.dq;
  float* dk = keep ? keep->dk : s.dk;
  float* dv = keep ? keep->dv : s.dv;
  const int64_t Nl = rows_local_;
  const float* dy = gather_rows(dx, s.all_rows);  // SP: the gradient of all rows
  // A SwiGLU's down projection (the dense MLP's, or the shared experts') reads dy in W.
  if (keep && keep->dy_down) k::copy(exec, keep->dy_down, dy, N * C);
  // Each GEMM input read twice or more is rounded once (bf16 GEMMs): k::LinearInput. The
  // block's own inputs come from its bf16 copies when it has them.
  using Copy = k::LinearInput::Copy;
  if (moe_block(l)) {
    moe_backward(l, a, copies, pw, pg, dy, keep);
  } else {
    const k::SwigluActs acts{a.gate, a.up, a.h};
    const k::LinearInput dy_down(exec, dy, N, C);
    k::swiglu_mlp_backward_hidden(exec, dgate, dup, s.dh, dy_down, dense_weights(pw), acts,
                                  copies.mlp(), ffn_);
    k::swiglu_mlp_backward_input(exec, s.dxn, k::Out::kWrite, s.dtmp, dgate, dup, dense_weights(pw),
                                 copies.mlp(), N, C, ffn_);
    if (!keep) {
      const k::LinearInput x(exec, a.xn2, copies.xn2, Copy::kFilled, N, C);
      k::swiglu_mlp_backward_weight(exec, {pg.gate, pg.up, pg.down}, dy_down, x, dgate, dup, acts,
                                    copies.mlp(), ffn_);
    }
  }
  // Column-parallel: the shared input's gradient is a partial sum (SP: of this rank's rows).
  const float* dxn_rows = reduce_rows(s.dxn);
  k::rmsnorm_backward(exec, dx, pg.ln2, dxn_rows, a.xmid, pw.ln2, a.rstd2, Nl, C,
                      k::Out::kAccumulate);  // dx is now d xmid
  dy = gather_rows(dx, s.all_rows);

  if (keep) k::copy(exec, keep->dy_o, dy, N * C);
  {
    const k::LinearInput dy_o(exec, dy, N, C);
    k::linear_backward_input(s.datt, dy_o, pw.o, qd);
    if (!keep)
      k::linear_backward_weight(pg.o, dy_o,
                                k::LinearInput(exec, a.att, copies.att, Copy::kFilled, N, qd));
  }
  backward_attention(a, dq, dk, dv);
  if (config_.qk_norm) qk_norm_backward(a, pw, pg, dq, dk);  // now of the projections' outputs
  {
    const k::LinearInput dq_in(exec, dq, N, qd), dk_in(exec, dk, N, kvd), dv_in(exec, dv, N, kvd);
    k::linear_backward_input(s.dxn, dq_in, pw.q, C);
    k::linear_backward_input(s.dtmp, dk_in, pw.k, C);
    k::add_inplace(exec, s.dxn, s.dtmp, N * C);
    k::linear_backward_input(s.dtmp, dv_in, pw.v, C);
    k::add_inplace(exec, s.dxn, s.dtmp, N * C);
    if (!keep) {
      const k::LinearInput x(exec, a.xn1, copies.xn1, Copy::kFilled, N, C);
      k::linear_backward_weight(pg.q, dq_in, x);
      k::linear_backward_weight(pg.k, dk_in, x);
      k::linear_backward_weight(pg.v, dv_in, x);
      if (config_.qkv_bias) qkv_bias_grads(pg, dq, dk, dv);
    }
  }
  dxn_rows = reduce_rows(s.dxn);
  k::rmsnorm_backward(exec, dx, pg.ln1, dxn_rows, x_in, pw.ln1, a.rstd1, Nl, C,
                      k::Out::kAccumulate);  // dx is now d x_in
}

void Model::backward_layer_weights(int64_t l, const LayerActs& a, const BlockCopies& copies,
                                   const LayerGrads& kg) {
  const k::Exec& exec = options_.exec;
  const BlockParams pg = block_grads(l);
  const int64_t N = rows_, C = config_.dim, qd = heads_ * config_.head_dim();
  const int64_t kvd = kv_heads_ * config_.head_dim();
  using Copy = k::LinearInput::Copy;
  if (moe_block(l)) {
    moe_backward_weights(l, a, copies, pg, kg);
  } else {
    const k::LinearInput dy(exec, kg.dy_down, N, C);
    const k::LinearInput x(exec, a.xn2, copies.xn2, Copy::kFilled, N, C);  // rounded once for both
    // B's fused SwiGLU left dgate and dup rounded, in the first half of their buffers.
    k::swiglu_mlp_backward_weight(exec, {pg.gate, pg.up, pg.down}, dy, x, kg.dgate, kg.dup,
                                  {a.gate, a.up, a.h}, copies.mlp(), ffn_);
  }
  k::linear_backward_weight(pg.o, k::LinearInput(exec, kg.dy_o, N, C),
                            k::LinearInput(exec, a.att, copies.att, Copy::kFilled, N, qd));
  const k::LinearInput x(exec, a.xn1, copies.xn1, Copy::kFilled, N, C);
  k::linear_backward_weight(pg.q, k::LinearInput(exec, kg.dq, N, qd), x);
  k::linear_backward_weight(pg.k, k::LinearInput(exec, kg.dk, N, kvd), x);
  k::linear_backward_weight(pg.v, k::LinearInput(exec, kg.dv, N, kvd), x);
  if (config_.qkv_bias) qkv_bias_grads(pg, kg.dq, kg.dk, kg.dv);
}

void Model::keep_loss_sum(const float* losses, int64_t n) {
  const k::Exec& exec = options_.exec;
  if (loss_sums_.bytes() == 0) {
    loss_sums_.reserve(exec, kKeptLossSums * sizeof(double), "the micro-batches' loss sums");
    loss_sums_on_host_.resize(kKeptLossSums);
  }
  if (kept_loss_sums_ == kKeptLossSums) gather_loss_sums();
  k::sum_in_order_into(exec, loss_sums_.as<double>() + kept_loss_sums_++, losses, n);
}

void Model::gather_loss_sums() {
  if (kept_loss_sums_ == 0) return;
  k::copy_to_host(options_.exec, loss_sums_on_host_.data(), loss_sums_.as<double>(),
                  static_cast<size_t>(kept_loss_sums_) * sizeof(double));
  for (int i = 0; i < kept_loss_sums_; ++i) loss_sum_ += loss_sums_on_host_[i];
  kept_loss_sums_ = 0;
}

double Model::take_loss_sum() {
  gather_loss_sums();
  return std::exchange(loss_sum_, 0.0);
}

void Model::forward_head(ChunkActs& c, const int32_t* host_targets, float grad_scale,
                         bool training) {
  const k::Exec& exec = options_.exec;
  const int64_t N = rows_, C = config_.dim;
  auto& s = *scratch_;
  const int32_t* targets = s.targets;
  k::copy_from_host(exec, s.targets, host_targets, sizeof(int32_t) * N);  // the data's crossing
  const std::string head = config_.tie_embeddings ? "model.embed_tokens.weight" : "lm_head.weight";
  const int64_t head_unit = config_.tie_embeddings ? -1 : config_.n_layers;
  const float* x_last = c.x.back();
  const int64_t Nl = rows_local_;
  float* xf_rows = sp_ ? s.rows : c.xf;
  const int64_t norm_unit = config_.n_layers;
  k::rmsnorm_forward(exec, xf_rows, c.rstdf, x_last, w("model.norm.weight", norm_unit), Nl, C,
                     static_cast<float>(config_.norm_eps));
  gather_rows(xf_rows, c.xf);
  k::linear_forward(exec, s.logits, c.xf, w(head, head_unit), N, C, vocab_);
  if (tp_.size() == 1) {
    k::cross_entropy_fused(exec, s.logits, s.losses, targets, N, vocab_, grad_scale);
  } else {
    // Vocab-parallel cross-entropy: three all-reduces of N floats instead of N·V logits.
    k::ce_local_max(exec, s.row_max, s.logits, N, vocab_);
    tp_.all_reduce(s.row_max, static_cast<size_t>(N), parallel::ReduceOp::max);
    k::ce_local_sum_exp(exec, s.sum_exp, s.logits, s.row_max, N, vocab_);
    tp_.all_reduce(s.sum_exp, static_cast<size_t>(N));
    k::ce_local_target_logit(exec, s.target, s.logits, targets, N, vocab_, vocab_start_);
    tp_.all_reduce(s.target, static_cast<size_t>(N));
    k::ce_loss_and_grad(exec, s.logits, s.losses, targets, s.row_max, s.sum_exp, s.target, N,
                        vocab_, vocab_start_, grad_scale);
  }
  keep_loss_sum(s.losses, N);
  if (training) {
    k::linear_backward_input(exec, s.dxn, s.logits, w(head, head_unit), N, C, vocab_);
    k::linear_backward_weight(exec, g(head, head_unit), s.logits, c.xf, N, C, vocab_);
    const float* dxn_rows = reduce_rows(s.dxn);
    k::rmsnorm_backward(exec, c.dx_last, g("model.norm.weight", norm_unit), dxn_rows, x_last,
                        w("model.norm.weight", norm_unit), c.rstdf, Nl, C);
    unit_done(config_.n_layers);
  }
}

void Model::forward(int chunk, int slot, const int32_t* tokens, const int32_t* targets,
                    float grad_scale, bool training) {
  const k::Exec& exec = options_.exec;
  const auto& range = chunks_.at(chunk);
  ChunkActs& a = *acts_.at(chunk).at(slot);
  const int64_t N = rows_, C = config_.dim;
  if (range.first) {
    k::check_token_ids(tokens, N, config_.vocab_size);
    k::copy_from_host(exec, a.tokens, tokens, sizeof(int32_t) * N);  // the data's crossing
    const float* emb = w("model.embed_tokens.weight", -1);
    // Vocab-parallel: each id's row comes from the rank owning it (SP: scattered by rows).
    k::embedding_forward(exec, scratch_->tmp, a.tokens, emb, N, C, vocab_start_,
                         vocab_start_ + vocab_);
    k::copy(exec, a.x[0], reduce_rows(scratch_->tmp), rows_local_ * C);
  }
  for (int64_t l = range.begin; l < range.end; ++l) {
    const int64_t i = l - range.begin;
    forward_layer(l, a.layers[i], block_copies(a, i), a.x[i], a.x[i + 1],
                  training ? BlockPass::kTraining : BlockPass::kEvaluation);
    if (stored16(i)) encode16(a.layers[i], a.stored[i]);
  }
  if (range.last) forward_head(a, targets, grad_scale, training);
}

void Model::backward(int chunk, int slot, const float* dout) {
  backward_impl(chunk, slot, dout, false);
}

void Model::backward_input(int chunk, int slot, const float* dout) {
  T3D_ASSERT(options_.split_backward, "backward_input needs ModelOptions::split_backward");
  backward_impl(chunk, slot, dout, true);
}

void Model::backward_weight(int chunk, int slot) {
  const auto& range = chunks_.at(chunk);
  ChunkActs& a = *acts_.at(chunk).at(slot);
  for (int64_t l = range.end - 1; l >= range.begin; --l) {
    const int64_t i = l - range.begin;
    if (recomputed(i)) continue;  // done in B
    if (stored16(i)) decode16(a.stored[i], a.layers[i]);
    backward_layer_weights(l, a.layers[i], block_copies(a, i), a.wgrads[i]);
    block_done(l);
  }
}

void Model::backward_impl(int chunk, int slot, const float* dout, bool defer_weights) {
  const k::Exec& exec = options_.exec;
  const auto& range = chunks_.at(chunk);
  ChunkActs& a = *acts_.at(chunk).at(slot);
  const int64_t N = rows_, C = config_.dim;
  float* dx = range.first ? scratch_->dx : a.dx_in;
  k::copy(exec, dx, range.last ? a.dx_last : dout, rows_local_ * C);
  for (int64_t l = range.end - 1; l >= range.begin; --l) {
    const int64_t i = l - range.begin;
    // Recompute: the same forward on the same input gives the same bits, so rewriting x[i + 1]
    // (already consumed by the blocks above) is harmless and needs no extra buffer.
    if (recomputed(i)) forward_layer(l, a.layers[i], {}, a.x[i], a.x[i + 1], BlockPass::kRecompute);
    if (stored16(i)) decode16(a.stored[i], a.layers[i]);
    const bool defer = defer_weights && !recomputed(i);
    backward_layer(l, a.layers[i], block_copies(a, i), a.x[i], dx, defer ? &a.wgrads[i] : nullptr);
    if (!defer) block_done(l);  // otherwise in W
  }
  if (range.first) {
    const float* dy = gather_rows(dx, scratch_->all_rows);
    k::embedding_backward(exec, g("model.embed_tokens.weight", -1), dy, a.tokens, N, C,
                          vocab_start_, vocab_start_ + vocab_);
    unit_done(-1);
  }
}

int64_t Model::first_nonfinite_layer(int slot) const {
  const k::Exec& exec = options_.exec;
  const auto finite = [&](const float* x) {
    return k::count_nonfinite(exec, x, rows_local_ * config_.dim) == 0;
  };
  for (size_t ci = 0; ci < chunks_.size(); ++ci) {
    const auto& range = chunks_[ci];
    if (acts_[ci].empty()) continue;
    // Chunks may have fewer slots than asked for (per-chunk counts): look at their last one.
    const auto& a = *acts_[ci][std::min(static_cast<size_t>(slot), acts_[ci].size() - 1)];
    if (range.first && !finite(a.x[0])) return -1;
    for (int64_t l = range.begin; l < range.end; ++l)
      if (!finite(a.x[l - range.begin + 1])) return l;
  }
  return INT64_MAX;
}

}  // namespace t3d::runtime
