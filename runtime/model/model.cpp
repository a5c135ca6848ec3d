#include "runtime/model/model.h"

#include <algorithm>
#include <cmath>
#include <cstring>
#include <limits>
#include <tuple>

#include "kernels/check.h"
#include "kernels/hash.h"
#include "kernels/ops.h"
#include "kernels/precision.h"
#include "runtime/model/model_scratch.h"

namespace t3d::runtime {

namespace k = t3d::kernels;

// Activations one transformer block keeps for its backward, for one micro-batch.
struct Model::LayerActs {
  float* rstd1;  // (N)
  float* xn1;    // (N, C) input_layernorm output
  float* q;      // (N, Hl·D) after RoPE
  float* kk;     // (N, Hkvl·D) after RoPE
  float* v;      // (N, Hkvl·D)
  float* att;    // (N, Hl·D) attention output, before o_proj
  float* lse;    // (B, Hl, T)
  float* xmid;   // (N, C) residual after attention
  float* rstd2;  // (N)
  float* xn2;    // (N, C) post_attention_layernorm output
  float* gate;   // (N, Fl)
  float* up;     // (N, Fl)
  float* h;      // (N, Fl) silu(gate)·up
};

// bf16 copies of the large tensors of a LayerActs (precision = bf16); the per-row statistics
// stay fp32. The block computes in fp32 buffers shared by all blocks, then stores here.
struct Model::LayerActs16 {
  uint16_t *xn1, *q, *kk, *v, *att, *xmid, *xn2, *gate, *up, *h;
  float *rstd1, *rstd2, *lse;
};

// Output gradients a block's deferred weight-gradient pass (W) needs, for one micro-batch.
struct Model::LayerGrads {
  float* dy_down = nullptr;  // (N, C) gradient of the block output
  float* dgate = nullptr;    // (N, Fl)
  float* dup = nullptr;      // (N, Fl)
  float* dy_o = nullptr;     // (N, C) gradient of xmid
  float* dq = nullptr;       // (N, Hl·D) before RoPE
  float* dk = nullptr;       // (N, Hkvl·D)
  float* dv = nullptr;       // (N, Hkvl·D)
};

struct Model::ChunkActs {
  std::vector<float*> x;  // L+1 residual streams (N, C): x[0] the chunk's input, x[L] its output
  std::vector<LayerActs> layers;
  std::vector<LayerGrads> wgrads;  // split backward only; empty pointers for recomputed blocks
  std::vector<LayerActs16> layers16;  // bf16 only: the stored copies (blocks not recomputed)
  int32_t* tokens = nullptr;  // (N) first chunk: ids, kept for the embedding backward
  float* xf = nullptr;        // (N, C) last chunk: model.norm output
  float* rstdf = nullptr;     // (N)
  float* dx_last = nullptr;   // (N, C) last chunk: gradient of x[L] from the loss
  float* dx_in = nullptr;     // (N, C) other than the first chunk: gradient of x[0]
};

namespace {

using k::splitmix64;

// Standard normal from a counter: Box-Muller on two hashed uniforms in (0, 1].
float normal_at(uint64_t key, uint64_t index) {
  const uint64_t a = splitmix64(key ^ splitmix64(2 * index)), b = splitmix64(key ^ splitmix64(2 * index + 1));
  const double u1 = (static_cast<double>(a >> 11) + 1.0) * 0x1.0p-53;
  const double u2 = static_cast<double>(b >> 11) * 0x1.0p-53;
  return static_cast<float>(std::sqrt(-2.0 * std::log(u1)) * std::cos(2.0 * M_PI * u2));
}

}  // namespace

Model::Model(const ModelConfig& config, std::vector<parallel::LayerRange> chunks,
             const parallel::Comm& tp, k::Arena& arena, const ModelOptions& options)
    : config_(config), chunks_(std::move(chunks)), tp_(tp), arena_(arena), options_(options) {
  const int64_t tps = tp_.size();
  T3D_ASSERT(config_.n_heads % tps == 0 && config_.n_kv_heads % tps == 0 &&
                 config_.vocab_size % tps == 0 && config_.ffn_dim % tps == 0,
             "recipe validation lets through a model tp cannot shard");
  heads_ = config_.n_heads / tps;
  kv_heads_ = config_.n_kv_heads / tps;
  ffn_ = config_.ffn_dim / tps;
  vocab_ = config_.vocab_size / tps;
  vocab_start_ = vocab_ * tp_.rank();
  cp_ = options_.cp && options_.cp->size() > 1;
  const int64_t cps = cp_ ? options_.cp->size() : 1;
  parts_ = cp_ ? 2 : 1;
  T3D_USER_CHECK(config_.seq_len % (parts_ * cps) == 0, "recipe error: `parallel.cp` = ", cps,
                 ": model.seq_len = ", config_.seq_len, " must divide into 2·cp equal parts");
  seq_local_ = config_.seq_len / cps;
  part_len_ = seq_local_ / parts_;
  rows_ = options_.micro_rows * seq_local_;
  sp_ = options_.sequence_parallel && tps > 1;
  T3D_USER_CHECK(!sp_ || rows_ % tps == 0, "recipe error: `parallel.sequence_parallel`: the ",
                 rows_, " tokens of a micro-batch do not split evenly over tp = ", tps,
                 "; change train.global_batch, train.micro_batches or model.seq_len");
  rows_local_ = sp_ ? rows_ / tps : rows_;
  bool first = false, last = false;
  for (const auto& c : chunks_) first |= c.first, last |= c.last;
  // Whoever holds one end of a tied model must hold the other (ZB-V: stage 0 holds both).
  T3D_USER_CHECK(!config_.tie_embeddings || first == last,
                 "recipe error: `model.tie_embeddings` needs the embedding and the LM head on the "
                 "same rank (parallel.pp = 1, or parallel.schedule = \"zb_v\", whose stage 0 "
                 "holds both)");

  build_param_table();
  size_t before = arena_.used();
  state_ = k::ModelState::allocate(arena_, layout_, options_.with_optimizer, options_.grad_region,
                                   options_.param_region);
  unit_begin_.assign(static_cast<size_t>(config_.n_layers + 2), -1);
  for (const auto& u : grad_units()) unit_begin_[static_cast<size_t>(u.unit + 1)] = u.range.begin;
  // Each block tensor's offset from the start of its unit, looked up once: a step does no name
  // lookups. Offsets, not pointers, because ZeRO moves a unit's gradients (and with ZeRO-3 its
  // gathered weights) between buffers; weights and gradients share the layout.
  block_offsets_.resize(static_cast<size_t>(config_.n_layers));
  for (const auto& range : chunks_)
    for (int64_t l = range.begin; l < range.end; ++l) {
      BlockOffsets& o = block_offsets_[l];
      const int64_t unit0 = unit_begin_[static_cast<size_t>(l + 1)];
      const auto at = [&](const char* suffix) { return layout_.at(layer_name(l, suffix)).offset - unit0; };
      o = {at("input_layernorm.weight"), at("self_attn.q_proj.weight"),
           at("self_attn.k_proj.weight"), at("self_attn.v_proj.weight"),
           at("self_attn.o_proj.weight"), at("post_attention_layernorm.weight"),
           at("mlp.gate_proj.weight"),    at("mlp.up_proj.weight"),
           at("mlp.down_proj.weight")};
    }
  const size_t region = static_cast<size_t>(layout_.total_floats()) * sizeof(float);
  footprint_.params = options_.param_region ? region : 0;
  footprint_.grads = options_.grad_region ? region : 0;
  footprint_.optimizer = options_.with_optimizer ? 2 * region : 0;
  before = arena_.used();

  const int64_t N = rows_, C = config_.dim, D = config_.head_dim(), T = seq_local_;
  const int64_t B = options_.micro_rows, Nl = rows_local_;  // Nl: this rank's rows (SP)
  auto alloc = [&](const std::string& name, int64_t floats) {
    return arena_.alloc_floats(name, static_cast<size_t>(floats));
  };
  auto alloc_layer = [&](const std::string& lp) {
    LayerActs la;
    la.rstd1 = alloc(lp + ".rstd1", Nl);
    la.xn1 = alloc(lp + ".xn1", N * C);
    la.q = alloc(lp + ".q", N * heads_ * D);
    la.kk = alloc(lp + ".k", N * kv_heads_ * D);
    la.v = alloc(lp + ".v", N * kv_heads_ * D);
    la.att = alloc(lp + ".attn", N * heads_ * D);
    la.lse = alloc(lp + ".lse", B * heads_ * T);
    la.xmid = alloc(lp + ".xmid", Nl * C);
    la.rstd2 = alloc(lp + ".rstd2", Nl);
    la.xn2 = alloc(lp + ".xn2", N * C);
    la.gate = alloc(lp + ".gate", N * ffn_);
    la.up = alloc(lp + ".up", N * ffn_);
    la.h = alloc(lp + ".h", N * ffn_);
    return la;
  };
  acts_.resize(chunks_.size());
  T3D_ASSERT(options_.chunk_slots.empty() || options_.chunk_slots.size() == chunks_.size(),
             options_.chunk_slots.size(), " slot counts for ", chunks_.size(), " chunks");
  for (size_t ci = 0; ci < chunks_.size(); ++ci) {
    const auto& range = chunks_[ci];
    const int64_t slots = options_.chunk_slots.empty() ? options_.slots : options_.chunk_slots[ci];
    for (int64_t s = 0; s < slots; ++s) {
      auto a = std::make_unique<ChunkActs>();
      const std::string p = "activations.chunk" + std::to_string(ci) + ".slot" + std::to_string(s);
      for (int64_t l = 0; l <= range.size(); ++l)
        a->x.push_back(alloc(p + ".residual" + std::to_string(l), Nl * C));
      auto alloc16 = [&](const std::string& name, int64_t n) {
        return static_cast<uint16_t*>(arena_.alloc_bytes(name, static_cast<size_t>(n) * 2));
      };
      for (int64_t l = range.begin; l < range.end; ++l) {
        const int64_t i = l - range.begin;
        const std::string lp = p + ".layer" + std::to_string(l);
        // Recomputed and bf16-stored blocks work in the shared fp32 buffers (filled in below).
        a->layers.push_back(recomputed(i) || stored16(i) ? LayerActs{} : alloc_layer(lp));
        if (!options_.bf16) continue;
        LayerActs16 s16{};
        if (stored16(i)) {
          s16.xn1 = alloc16(lp + ".xn1.bf16", N * C);
          s16.q = alloc16(lp + ".q.bf16", N * heads_ * D);
          s16.kk = alloc16(lp + ".k.bf16", N * kv_heads_ * D);
          s16.v = alloc16(lp + ".v.bf16", N * kv_heads_ * D);
          s16.att = alloc16(lp + ".attn.bf16", N * heads_ * D);
          s16.xmid = alloc16(lp + ".xmid.bf16", Nl * C);
          s16.xn2 = alloc16(lp + ".xn2.bf16", N * C);
          s16.gate = alloc16(lp + ".gate.bf16", N * ffn_);
          s16.up = alloc16(lp + ".up.bf16", N * ffn_);
          s16.h = alloc16(lp + ".h.bf16", N * ffn_);
          s16.rstd1 = alloc(lp + ".rstd1", Nl);
          s16.rstd2 = alloc(lp + ".rstd2", Nl);
          s16.lse = alloc(lp + ".lse", B * heads_ * T);
        }
        a->layers16.push_back(s16);
      }

      for (int64_t l = range.begin; options_.split_backward && l < range.end; ++l) {
        LayerGrads lg;
        if (!recomputed(l - range.begin)) {
          const std::string lp = p + ".layer" + std::to_string(l) + ".wgrad";
          lg.dy_down = alloc(lp + ".dy_down", N * C);
          lg.dgate = alloc(lp + ".dgate", N * ffn_);
          lg.dup = alloc(lp + ".dup", N * ffn_);
          lg.dy_o = alloc(lp + ".dy_o", N * C);
          lg.dq = alloc(lp + ".dq", N * heads_ * D);
          lg.dk = alloc(lp + ".dk", N * kv_heads_ * D);
          lg.dv = alloc(lp + ".dv", N * kv_heads_ * D);
        }
        a->wgrads.push_back(lg);
      }
      if (range.first)
        a->tokens = static_cast<int32_t*>(
            arena_.alloc_bytes(p + ".tokens", static_cast<size_t>(N) * sizeof(int32_t)));
      if (range.last) {
        a->xf = alloc(p + ".final_norm", N * C);
        a->rstdf = alloc(p + ".final_rstd", Nl);
        a->dx_last = alloc(p + ".loss_grad", Nl * C);
      }
      if (!range.first) a->dx_in = alloc(p + ".input_grad", Nl * C);
      acts_[ci].push_back(std::move(a));
    }
  }
  footprint_.activations = arena_.used() - before;
  before = arena_.used();

  scratch_ = std::make_unique<Scratch>();
  auto& s = *scratch_;
  const k::AttentionShape shape = attention_shape(0);
  s.tmp = alloc("scratch.tmp", N * C);
  s.dx = alloc("scratch.dx", Nl * C);
  if (sp_) {
    s.rows = alloc("scratch.sp_rows", Nl * C);
    s.all_rows = alloc("scratch.sp_all_rows", N * C);
  }
  s.dtmp = alloc("scratch.dtmp", N * C);
  s.dxn = alloc("scratch.dxn", N * C);
  s.datt = alloc("scratch.datt", N * heads_ * D);
  s.dq = alloc("scratch.dq", N * heads_ * D);
  s.dk = alloc("scratch.dk", N * kv_heads_ * D);
  s.dv = alloc("scratch.dv", N * kv_heads_ * D);
  s.dh = alloc("scratch.dh", N * ffn_);
  s.dgate = alloc("scratch.dgate", N * ffn_);
  s.dup = alloc("scratch.dup", N * ffn_);
  s.attn = alloc("scratch.attention_tiles", k::attention_scratch_floats(shape));
  if (last) {
    s.logits = alloc("scratch.logits", N * vocab_);
    s.losses = alloc("scratch.losses", N);
    s.row_max = alloc("scratch.ce_row_max", N);
    s.sum_exp = alloc("scratch.ce_sum_exp", N);
    s.target = alloc("scratch.ce_target_logit", N);
  }
  s.rope = alloc("scratch.rope_table", config_.seq_len * D);
  if (cp_) {
    const int64_t whole = B * config_.seq_len * kv_heads_ * D;
    s.k_all = alloc("scratch.cp_keys", whole);
    s.v_all = alloc("scratch.cp_values", whole);
    s.dk_all = alloc("scratch.cp_key_grads", whole);
    s.dv_all = alloc("scratch.cp_value_grads", whole);
    s.cp_stage = alloc("scratch.cp_staging", whole);
    s.cp_kv_part = alloc("scratch.cp_key_value_part_grads", 2 * whole);
  }
  if (options_.checkpoint_every > 0 || options_.bf16) {
    // One block's fp32 activations, shared by every recomputed or bf16-stored block: written by
    // its forward (then stored in bf16, or dropped), rebuilt right before its backward.
    const LayerActs shared = alloc_layer("scratch.layer_work");
    for (size_t ci = 0; ci < chunks_.size(); ++ci)
      for (auto& slot : acts_[ci])
        for (int64_t i = 0; i < chunks_[ci].size(); ++i)
          if (recomputed(i) || stored16(i)) slot->layers[i] = shared;
  }
  if (options_.bf16) {
    s.tp16 = static_cast<uint16_t*>(arena_.alloc_bytes("scratch.tp_bf16", N * C * 2));
    if (sp_)
      s.tp16_rows = static_cast<uint16_t*>(arena_.alloc_bytes("scratch.tp_bf16_rows", N * C * 2));
    s.recv16 = static_cast<uint16_t*>(arena_.alloc_bytes("scratch.recv_bf16", Nl * C * 2));
  }
  k::rope_table(s.rope, config_.seq_len, D, config_.rope_theta);
  footprint_.scratch = arena_.used() - before;
}

Model::~Model() = default;

std::string Model::layer_name(int64_t layer, const char* suffix) const {
  return "model.layers." + std::to_string(layer) + "." + suffix;
}

void Model::build_param_table() {
  const int64_t C = config_.dim, D = config_.head_dim(), V = config_.vocab_size;
  const int64_t H = config_.n_heads, Hkv = config_.n_kv_heads, F = config_.ffn_dim;
  for (const auto& range : chunks_) {
    if (range.first) params_.push_back({"model.embed_tokens.weight", {V, C}, 0, true});
    for (int64_t l = range.begin; l < range.end; ++l) {
      params_.push_back({layer_name(l, "input_layernorm.weight"), {C}, -1, false});
      params_.push_back({layer_name(l, "self_attn.q_proj.weight"), {H * D, C}, 0, true});
      params_.push_back({layer_name(l, "self_attn.k_proj.weight"), {Hkv * D, C}, 0, true});
      params_.push_back({layer_name(l, "self_attn.v_proj.weight"), {Hkv * D, C}, 0, true});
      params_.push_back({layer_name(l, "self_attn.o_proj.weight"), {C, H * D}, 1, true});
      params_.push_back({layer_name(l, "post_attention_layernorm.weight"), {C}, -1, false});
      params_.push_back({layer_name(l, "mlp.gate_proj.weight"), {F, C}, 0, true});
      params_.push_back({layer_name(l, "mlp.up_proj.weight"), {F, C}, 0, true});
      params_.push_back({layer_name(l, "mlp.down_proj.weight"), {C, F}, 1, true});
    }
    if (range.last) {
      params_.push_back({"model.norm.weight", {C}, -1, false});
      if (!config_.tie_embeddings) params_.push_back({"lm_head.weight", {V, C}, 0, true});
    }
  }
  std::vector<k::TensorSpec> table;
  for (const auto& p : params_) {
    auto shape = p.global_shape;
    if (p.split_dim >= 0) shape[p.split_dim] /= tp_.size();
    table.push_back({p.name, shape});
  }
  layout_ = k::ParamLayout(std::move(table));
}

const float* Model::unit_weights(int64_t unit) const {
  if (weight_source_) return weight_source_(unit);
  T3D_ASSERT(state_.params.data(), "a model without a parameter region needs a weight source");
  return state_.params.data() + unit_begin_.at(static_cast<size_t>(unit + 1));
}

const float* Model::w(const std::string& name, int64_t unit) const {
  return unit_weights(unit) +
         (layout_.at(name).offset - unit_begin_.at(static_cast<size_t>(unit + 1)));
}

Model::ConstBlock Model::block_weights(int64_t l) const {
  const BlockOffsets& o = block_offsets_.at(static_cast<size_t>(l));
  const float* base = unit_weights(l);
  return {base + o.ln1, base + o.q, base + o.k,  base + o.v,   base + o.o,
          base + o.ln2, base + o.gate, base + o.up, base + o.down};
}

float* Model::unit_grads(int64_t unit) const {
  if (grad_source_) return grad_source_(unit);
  T3D_ASSERT(state_.grads.data(), "a model without a gradient region needs a grad source");
  return state_.grads.data() + unit_begin_.at(static_cast<size_t>(unit + 1));
}

float* Model::g(const std::string& name, int64_t unit) const {
  return unit_grads(unit) + (layout_.at(name).offset - unit_begin_.at(static_cast<size_t>(unit + 1)));
}

Model::BlockParams Model::block_grads(int64_t l) const {
  const BlockOffsets& o = block_offsets_.at(static_cast<size_t>(l));
  float* base = unit_grads(l);
  return {base + o.ln1, base + o.q, base + o.k,  base + o.v,   base + o.o,
          base + o.ln2, base + o.gate, base + o.up, base + o.down};
}

// The stored tensors of a block, paired with their bf16 copies: one list for both directions.
template <typename Fn16, typename Fn32>
void Model::for_each_stored(const LayerActs& a, const LayerActs16& b, Fn16 on16, Fn32 on32) const {
  const int64_t N = rows_, C = config_.dim, D = config_.head_dim();
  on16(a.xn1, b.xn1, N * C);
  on16(a.q, b.q, N * heads_ * D);
  on16(a.kk, b.kk, N * kv_heads_ * D);
  on16(a.v, b.v, N * kv_heads_ * D);
  on16(a.att, b.att, N * heads_ * D);
  on16(a.xmid, b.xmid, rows_local_ * C);
  on16(a.xn2, b.xn2, N * C);
  on16(a.gate, b.gate, N * ffn_);
  on16(a.up, b.up, N * ffn_);
  on16(a.h, b.h, N * ffn_);
  on32(a.rstd1, b.rstd1, rows_local_);  // per-row statistics stay fp32
  on32(a.rstd2, b.rstd2, rows_local_);
  on32(a.lse, b.lse, options_.micro_rows * heads_ * seq_local_);
}

void Model::encode16(const LayerActs& from, const LayerActs16& to) const {
  for_each_stored(
      from, to, [](float* f, uint16_t* h, int64_t n) { k::float_to_bf16(h, f, n); },
      [](float* f, float* h, int64_t n) { std::memcpy(h, f, sizeof(float) * n); });
}

void Model::decode16(const LayerActs16& from, const LayerActs& to) const {
  for_each_stored(
      to, from, [](float* f, uint16_t* h, int64_t n) { k::bf16_to_float(f, h, n); },
      [](float* f, float* h, int64_t n) { std::memcpy(f, h, sizeof(float) * n); });
}

uint16_t* Model::recv16() { return scratch_->recv16; }

void Model::init(uint64_t seed, float* region) {
  if (!region) region = state_.params.data();
  T3D_ASSERT(region, "a model without a parameter region initialises into a caller's buffer");
  const double base_std = 0.02;
  // GPT-2 / Megatron: projections into the residual stream shrink with depth.
  const double out_std = base_std / std::sqrt(2.0 * config_.n_layers);
  for (const auto& p : params_) {
    const auto& e = layout_.at(p.name);
    float* data = region + e.offset;
    if (p.global_shape.size() == 1) {  // norm weights
      for (int64_t i = 0; i < e.numel; ++i) data[i] = 1.0f;
      continue;
    }
    const bool residual_out = p.name.find("o_proj") != std::string::npos ||
                              p.name.find("down_proj") != std::string::npos;
    const float std = static_cast<float>(residual_out ? out_std : base_std);
    const uint64_t key = splitmix64(static_cast<uint64_t>(seed) ^ k::fnv1a64(p.name));
    const int64_t rows = e.spec.shape[0], cols = e.spec.shape[1], global_cols = p.global_shape[1];
    const int64_t row0 = p.split_dim == 0 ? rows * tp_.rank() : 0;
    const int64_t col0 = p.split_dim == 1 ? cols * tp_.rank() : 0;
    for (int64_t r = 0; r < rows; ++r)
      for (int64_t c = 0; c < cols; ++c)
        data[r * cols + c] =
            std * normal_at(key, static_cast<uint64_t>((row0 + r) * global_cols + col0 + c));
  }
}

float* Model::input(int chunk, int slot) { return acts_.at(chunk).at(slot)->x[0]; }
const float* Model::output(int chunk, int slot) const {
  return acts_.at(chunk).at(slot)->x.back();
}
const float* Model::input_grad(int chunk, int slot) const {
  return acts_.at(chunk).at(slot)->dx_in;
}

void Model::forward_layer(int64_t l, LayerActs& a, const float* x_in, float* x_out) {
  const ConstBlock pw = block_weights(l);
  const int64_t N = rows_, C = config_.dim, D = config_.head_dim();
  const int64_t B = options_.micro_rows;
  const int64_t qd = heads_ * D, kvd = kv_heads_ * D;
  auto& s = *scratch_;
  const int64_t Nl = rows_local_;
  float* xn1_rows = sp_ ? s.rows : a.xn1;  // SP: normalise this rank's rows, then gather
  k::rmsnorm_forward(xn1_rows, a.rstd1, x_in, pw.ln1, Nl, C,
                     static_cast<float>(config_.norm_eps));
  gather_rows(xn1_rows, a.xn1);
  k::linear_forward(a.q, a.xn1, pw.q, N, C, qd);
  k::linear_forward(a.kk, a.xn1, pw.k, N, C, kvd);
  k::linear_forward(a.v, a.xn1, pw.v, N, C, kvd);
  // Each part of this rank's positions (one without context parallelism) is (B, len) rows.
  const int64_t len = part_len_, part_rows = B * len;
  for (int64_t part = 0; part < parts_; ++part) {
    k::rope_forward(a.q + part * part_rows * qd, a.q + part * part_rows * qd, s.rope, B, len,
                    heads_, D, part_begin(part));
    k::rope_forward(a.kk + part * part_rows * kvd, a.kk + part * part_rows * kvd, s.rope, B, len,
                    kv_heads_, D, part_begin(part));
  }
  if (cp_) {
    gather_sequence(a.kk, s.k_all, kvd);
    gather_sequence(a.v, s.v_all, kvd);
  }
  for (int64_t part = 0; part < parts_; ++part)
    k::attention_forward(a.att + part * part_rows * qd, a.lse + part * B * heads_ * len,
                         a.q + part * part_rows * qd, cp_ ? s.k_all : a.kk, cp_ ? s.v_all : a.v,
                         s.attn, attention_shape(part));
  k::linear_forward(s.tmp, a.att, pw.o, N, qd, C);
  const float* branch = reduce_rows(s.tmp);  // row-parallel: partial sums before the residual add
  std::memcpy(a.xmid, x_in, sizeof(float) * Nl * C);
  k::add_inplace(a.xmid, branch, Nl * C);

  float* xn2_rows = sp_ ? s.rows : a.xn2;
  k::rmsnorm_forward(xn2_rows, a.rstd2, a.xmid,
                     pw.ln2, Nl, C,
                     static_cast<float>(config_.norm_eps));
  gather_rows(xn2_rows, a.xn2);
  k::linear_forward(a.gate, a.xn2, pw.gate, N, C, ffn_);
  k::linear_forward(a.up, a.xn2, pw.up, N, C, ffn_);
  k::swiglu_forward(a.h, a.gate, a.up, N * ffn_);
  k::linear_forward(s.tmp, a.h, pw.down, N, ffn_, C);
  branch = reduce_rows(s.tmp);
  std::memcpy(x_out, a.xmid, sizeof(float) * Nl * C);
  k::add_inplace(x_out, branch, Nl * C);
}

void Model::backward_layer(int64_t l, LayerActs& a, const float* x_in, float* dx,
                           const LayerGrads* keep) {
  const ConstBlock pw = block_weights(l);
  const BlockParams pg = block_grads(l);
  // dx (N, C): gradient of the block's output on entry, of its input on return. With `keep` the
  // projections' weight gradients are left to backward_layer_weights (W), their inputs kept.
  const int64_t N = rows_, C = config_.dim, D = config_.head_dim();
  const int64_t B = options_.micro_rows;
  const int64_t qd = heads_ * D, kvd = kv_heads_ * D;
  auto& s = *scratch_;
  float* dgate = keep ? keep->dgate : s.dgate;
  float* dup = keep ? keep->dup : s.dup;
  float* dq = keep ? keep->dq : s.dq;
  float* dk = keep ? keep->dk : s.dk;
  float* dv = keep ? keep->dv : s.dv;
  const int64_t Nl = rows_local_;
  const float* dy = gather_rows(dx, s.all_rows);  // SP: the gradient of all rows
  if (keep) std::memcpy(keep->dy_down, dy, sizeof(float) * N * C);
  k::linear_backward_input(s.dh, dy, pw.down, N, ffn_, C);
  if (!keep) k::linear_backward_weight(pg.down, dy, a.h, N, ffn_, C);
  k::swiglu_backward(dgate, dup, s.dh, a.gate, a.up, N * ffn_);
  k::linear_backward_input(s.dxn, dgate, pw.gate, N, C, ffn_);
  k::linear_backward_input(s.dtmp, dup, pw.up, N, C, ffn_);
  k::add_inplace(s.dxn, s.dtmp, N * C);
  if (!keep) {
    k::linear_backward_weight(pg.gate, dgate, a.xn2, N, C, ffn_);
    k::linear_backward_weight(pg.up, dup, a.xn2, N, C, ffn_);
  }
  // Column-parallel: the shared input's gradient is a partial sum (SP: of this rank's rows).
  const float* dxn_rows = reduce_rows(s.dxn);
  k::rmsnorm_backward(s.dtmp, pg.ln2, dxn_rows, a.xmid, pw.ln2, a.rstd2, Nl, C);
  k::add_inplace(dx, s.dtmp, Nl * C);  // dx is now d xmid
  dy = gather_rows(dx, s.all_rows);

  if (keep) std::memcpy(keep->dy_o, dy, sizeof(float) * N * C);
  k::linear_backward_input(s.datt, dy, pw.o, N, qd, C);
  if (!keep) k::linear_backward_weight(pg.o, dy, a.att, N, qd, C);
  const int64_t len = part_len_, part_rows = B * len;
  if (cp_) {  // the whole sequence's keys and values again (not kept: cp times their memory)
    gather_sequence(a.kk, s.k_all, kvd);
    gather_sequence(a.v, s.v_all, kvd);
    // The kernel writes (not adds) dk, dv: the second part's go to a buffer, then added.
    const int64_t whole = B * config_.seq_len * kvd;
    for (int64_t part = 0; part < 2; ++part) {
      float* dk_part = part == 0 ? s.dk_all : s.cp_kv_part;
      float* dv_part = part == 0 ? s.dv_all : s.cp_kv_part + whole;
      k::attention_backward(dq + part * part_rows * qd, dk_part, dv_part,
                            s.datt + part * part_rows * qd, a.q + part * part_rows * qd, s.k_all,
                            s.v_all, a.att + part * part_rows * qd,
                            a.lse + part * B * heads_ * len, s.attn, attention_shape(part));
    }
    k::add_inplace(s.dk_all, s.cp_kv_part, whole);
    k::add_inplace(s.dv_all, s.cp_kv_part + whole, whole);
    scatter_sequence_grad(s.dk_all, dk, kvd);
    scatter_sequence_grad(s.dv_all, dv, kvd);
  } else {
    k::attention_backward(dq, dk, dv, s.datt, a.q, a.kk, a.v, a.att, a.lse, s.attn,
                          attention_shape(0));
  }
  for (int64_t part = 0; part < parts_; ++part) {
    k::rope_backward(dq + part * part_rows * qd, dq + part * part_rows * qd, s.rope, B, len,
                     heads_, D, part_begin(part));
    k::rope_backward(dk + part * part_rows * kvd, dk + part * part_rows * kvd, s.rope, B, len,
                     kv_heads_, D, part_begin(part));
  }
  k::linear_backward_input(s.dxn, dq, pw.q, N, C, qd);
  k::linear_backward_input(s.dtmp, dk, pw.k, N, C, kvd);
  k::add_inplace(s.dxn, s.dtmp, N * C);
  k::linear_backward_input(s.dtmp, dv, pw.v, N, C, kvd);
  k::add_inplace(s.dxn, s.dtmp, N * C);
  if (!keep) {
    k::linear_backward_weight(pg.q, dq, a.xn1, N, C, qd);
    k::linear_backward_weight(pg.k, dk, a.xn1, N, C, kvd);
    k::linear_backward_weight(pg.v, dv, a.xn1, N, C, kvd);
  }
  dxn_rows = reduce_rows(s.dxn);
  k::rmsnorm_backward(s.dtmp, pg.ln1, dxn_rows, x_in, pw.ln1, a.rstd1, Nl, C);
  k::add_inplace(dx, s.dtmp, Nl * C);  // dx is now d x_in
}

void Model::backward_layer_weights(int64_t l, const LayerActs& a, const LayerGrads& kg) {
  const BlockParams pg = block_grads(l);
  const int64_t N = rows_, C = config_.dim, qd = heads_ * config_.head_dim();
  const int64_t kvd = kv_heads_ * config_.head_dim();
  k::linear_backward_weight(pg.down, kg.dy_down, a.h, N, ffn_, C);
  k::linear_backward_weight(pg.gate, kg.dgate, a.xn2, N, C, ffn_);
  k::linear_backward_weight(pg.up, kg.dup, a.xn2, N, C, ffn_);
  k::linear_backward_weight(pg.o, kg.dy_o, a.att, N, qd, C);
  k::linear_backward_weight(pg.q, kg.dq, a.xn1, N, C, qd);
  k::linear_backward_weight(pg.k, kg.dk, a.xn1, N, C, kvd);
  k::linear_backward_weight(pg.v, kg.dv, a.xn1, N, C, kvd);
}

double Model::forward_head(ChunkActs& c, const int32_t* targets, float grad_scale,
                           bool training) {
  const int64_t N = rows_, C = config_.dim;
  auto& s = *scratch_;
  const std::string head = config_.tie_embeddings ? "model.embed_tokens.weight" : "lm_head.weight";
  const int64_t head_unit = config_.tie_embeddings ? -1 : config_.n_layers;
  const float* x_last = c.x.back();
  const int64_t Nl = rows_local_;
  float* xf_rows = sp_ ? s.rows : c.xf;
  const int64_t norm_unit = config_.n_layers;
  k::rmsnorm_forward(xf_rows, c.rstdf, x_last, w("model.norm.weight", norm_unit), Nl, C,
                     static_cast<float>(config_.norm_eps));
  gather_rows(xf_rows, c.xf);
  k::linear_forward(s.logits, c.xf, w(head, head_unit), N, C, vocab_);
  if (tp_.size() == 1) {
    k::cross_entropy_fused(s.logits, s.losses, targets, N, vocab_, grad_scale);
  } else {
    // Vocab-parallel cross-entropy: three all-reduces of N floats instead of N·V logits.
    k::ce_local_max(s.row_max, s.logits, N, vocab_);
    tp_.all_reduce(s.row_max, static_cast<size_t>(N), parallel::ReduceOp::max);
    k::ce_local_sum_exp(s.sum_exp, s.logits, s.row_max, N, vocab_);
    tp_.all_reduce(s.sum_exp, static_cast<size_t>(N));
    k::ce_local_target_logit(s.target, s.logits, targets, N, vocab_, vocab_start_);
    tp_.all_reduce(s.target, static_cast<size_t>(N));
    k::ce_loss_and_grad(s.logits, s.losses, targets, s.row_max, s.sum_exp, s.target, N, vocab_,
                        vocab_start_, grad_scale);
  }
  double loss_sum = 0;
  for (int64_t i = 0; i < N; ++i) loss_sum += s.losses[i];
  if (training) {
    k::linear_backward_input(s.dxn, s.logits, w(head, head_unit), N, C, vocab_);
    k::linear_backward_weight(g(head, head_unit), s.logits, c.xf, N, C, vocab_);
    const float* dxn_rows = reduce_rows(s.dxn);
    k::rmsnorm_backward(c.dx_last, g("model.norm.weight", norm_unit), dxn_rows, x_last,
                        w("model.norm.weight", norm_unit), c.rstdf, Nl, C);
    if (grad_hook_) grad_hook_(config_.n_layers);
  }
  return loss_sum;
}

double Model::forward(int chunk, int slot, const int32_t* tokens, const int32_t* targets,
                      float grad_scale, bool training) {
  const auto& range = chunks_.at(chunk);
  ChunkActs& a = *acts_.at(chunk).at(slot);
  const int64_t N = rows_, C = config_.dim;
  if (range.first) {
    k::check_token_ids(tokens, N, config_.vocab_size);
    std::memcpy(a.tokens, tokens, sizeof(int32_t) * N);
    const float* emb = w("model.embed_tokens.weight", -1);
    // Vocab-parallel: each id's row comes from the rank owning it (SP: scattered by rows).
    k::embedding_forward(scratch_->tmp, tokens, emb, N, C, vocab_start_, vocab_start_ + vocab_);
    std::memcpy(a.x[0], reduce_rows(scratch_->tmp), sizeof(float) * rows_local_ * C);
  }
  for (int64_t l = range.begin; l < range.end; ++l) {
    const int64_t i = l - range.begin;
    forward_layer(l, a.layers[i], a.x[i], a.x[i + 1]);
    if (stored16(i)) encode16(a.layers[i], a.layers16[i]);
  }
  return range.last ? forward_head(a, targets, grad_scale, training) : 0.0;
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
    if (stored16(i)) decode16(a.layers16[i], a.layers[i]);
    backward_layer_weights(l, a.layers[i], a.wgrads[i]);
    if (grad_hook_) grad_hook_(l);
  }
}

void Model::backward_impl(int chunk, int slot, const float* dout, bool defer_weights) {
  const auto& range = chunks_.at(chunk);
  ChunkActs& a = *acts_.at(chunk).at(slot);
  const int64_t N = rows_, C = config_.dim;
  float* dx = range.first ? scratch_->dx : a.dx_in;
  std::memcpy(dx, range.last ? a.dx_last : dout, sizeof(float) * rows_local_ * C);
  for (int64_t l = range.end - 1; l >= range.begin; --l) {
    const int64_t i = l - range.begin;
    // Recompute: the same forward on the same input gives the same bits, so rewriting x[i + 1]
    // (already consumed by the blocks above) is harmless and needs no extra buffer.
    if (recomputed(i)) forward_layer(l, a.layers[i], a.x[i], a.x[i + 1]);
    if (stored16(i)) decode16(a.layers16[i], a.layers[i]);
    const bool defer = defer_weights && !recomputed(i);
    backward_layer(l, a.layers[i], a.x[i], dx, defer ? &a.wgrads[i] : nullptr);
    if (!defer && grad_hook_) grad_hook_(l);
  }
  if (range.first) {
    const float* dy = gather_rows(dx, scratch_->all_rows);
    k::embedding_backward(g("model.embed_tokens.weight", -1), dy,
                          a.tokens, N, C, vocab_start_,
                          vocab_start_ + vocab_);
    if (grad_hook_) grad_hook_(-1);
  }
}

std::vector<Model::GradUnit> Model::grad_units() const {
  std::vector<GradUnit> units;
  for (const auto& p : params_) {
    int64_t unit = config_.n_layers;  // model.norm, lm_head
    if (p.name == "model.embed_tokens.weight") unit = -1;
    else if (p.name.rfind("model.layers.", 0) == 0) unit = std::stoll(p.name.substr(13));
    const auto& e = layout_.at(p.name);
    if (units.empty() || units.back().unit != unit)
      units.push_back({unit, {e.offset, e.offset + e.numel}});
    else
      units.back().range.end = e.offset + e.numel;
  }
  return units;
}

int64_t Model::first_nonfinite_layer(int slot) const {
  const auto finite = [&](const float* x) {
    for (int64_t i = 0; i < rows_local_ * config_.dim; ++i)
      if (!std::isfinite(x[i])) return false;
    return true;
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

double model_train_flops_per_token(const ModelConfig& m) {
  const double C = m.dim, D = m.head_dim(), T = m.seq_len, L = m.n_layers;
  const double per_layer = C * m.n_heads * D * 2 + 2 * C * m.n_kv_heads * D + 3 * C * m.ffn_dim;
  const double matmul = L * per_layer + C * m.vocab_size;  // + LM head; the embedding is a lookup
  return 6.0 * matmul + 12.0 * L * m.n_heads * D * T;
}

}  // namespace t3d::runtime
