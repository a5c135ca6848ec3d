#include "runtime/model.h"

#include <algorithm>
#include <cmath>
#include <cstring>
#include <limits>

#include "kernels/check.h"
#include "kernels/ops.h"

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

struct Model::ChunkActs {
  std::vector<float*> x;  // L+1 residual streams (N, C): x[0] the chunk's input, x[L] its output
  std::vector<LayerActs> layers;
  int32_t* tokens = nullptr;  // (N) first chunk: ids, kept for the embedding backward
  float* xf = nullptr;        // (N, C) last chunk: model.norm output
  float* rstdf = nullptr;     // (N)
  float* dx_last = nullptr;   // (N, C) last chunk: gradient of x[L] from the loss
  float* dx_in = nullptr;     // (N, C) other than the first chunk: gradient of x[0]
};

// Per-rank buffers shared by every chunk and slot: only one forward or backward runs at a time.
struct Model::Scratch {
  float* tmp;      // (N, C)
  float* dx;       // (N, C) running residual gradient of the first chunk
  float* dtmp;     // (N, C)
  float* dxn;      // (N, C)
  float* datt;     // (N, Hl·D)
  float* dq;       // (N, Hl·D)
  float* dk;       // (N, Hkvl·D)
  float* dv;       // (N, Hkvl·D)
  float* dh;       // (N, Fl)
  float* dgate;    // (N, Fl)
  float* dup;      // (N, Fl)
  float* attn;     // attention tiles
  float* logits;   // (N, Vl)
  float* losses;   // (N)
  float* row_max;  // (N)
  float* sum_exp;  // (N)
  float* target;   // (N)
  float* rope;     // (T, D)
};

namespace {

uint64_t mix(uint64_t x) {  // splitmix64 finaliser
  x += 0x9E3779B97F4A7C15ull;
  x = (x ^ (x >> 30)) * 0xBF58476D1CE4E5B9ull;
  x = (x ^ (x >> 27)) * 0x94D049BB133111EBull;
  return x ^ (x >> 31);
}

uint64_t fnv1a(const std::string& s) {
  uint64_t h = 1469598103934665603ull;
  for (unsigned char c : s) h = (h ^ c) * 1099511628211ull;
  return h;
}

// Standard normal from a counter: Box-Muller on two hashed uniforms in (0, 1].
float normal_at(uint64_t key, uint64_t index) {
  const uint64_t a = mix(key ^ mix(2 * index)), b = mix(key ^ mix(2 * index + 1));
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
  rows_ = options_.micro_rows * config_.seq_len;
  bool first = false, last = false;
  for (const auto& c : chunks_) first |= c.first, last |= c.last;
  T3D_USER_CHECK(!config_.tie_embeddings || (first && last),
                 "recipe error: `model.tie_embeddings` needs the embedding and the LM head on the "
                 "same rank (parallel.pp = 1)");

  build_param_table();
  size_t before = arena_.used();
  state_ = k::ModelState::allocate(arena_, layout_, options_.with_optimizer);
  const size_t region = static_cast<size_t>(layout_.total_floats()) * sizeof(float);
  footprint_.params = footprint_.grads = region;
  footprint_.optimizer = options_.with_optimizer ? 2 * region : 0;
  before = arena_.used();

  const int64_t N = rows_, C = config_.dim, D = config_.head_dim(), T = config_.seq_len;
  const int64_t B = options_.micro_rows;
  auto alloc = [&](const std::string& name, int64_t floats) {
    return arena_.alloc_floats(name, static_cast<size_t>(floats));
  };
  auto alloc_layer = [&](const std::string& lp) {
    LayerActs la;
    la.rstd1 = alloc(lp + ".rstd1", N);
    la.xn1 = alloc(lp + ".xn1", N * C);
    la.q = alloc(lp + ".q", N * heads_ * D);
    la.kk = alloc(lp + ".k", N * kv_heads_ * D);
    la.v = alloc(lp + ".v", N * kv_heads_ * D);
    la.att = alloc(lp + ".attn", N * heads_ * D);
    la.lse = alloc(lp + ".lse", B * heads_ * T);
    la.xmid = alloc(lp + ".xmid", N * C);
    la.rstd2 = alloc(lp + ".rstd2", N);
    la.xn2 = alloc(lp + ".xn2", N * C);
    la.gate = alloc(lp + ".gate", N * ffn_);
    la.up = alloc(lp + ".up", N * ffn_);
    la.h = alloc(lp + ".h", N * ffn_);
    return la;
  };
  acts_.resize(chunks_.size());
  for (size_t ci = 0; ci < chunks_.size(); ++ci) {
    const auto& range = chunks_[ci];
    for (int64_t s = 0; s < options_.slots; ++s) {
      auto a = std::make_unique<ChunkActs>();
      const std::string p = "activations.chunk" + std::to_string(ci) + ".slot" + std::to_string(s);
      for (int64_t l = 0; l <= range.size(); ++l)
        a->x.push_back(alloc(p + ".residual" + std::to_string(l), N * C));
      for (int64_t l = range.begin; l < range.end; ++l)
        a->layers.push_back(recomputed(l - range.begin)
                                ? LayerActs{}  // filled in below: the shared recompute buffers
                                : alloc_layer(p + ".layer" + std::to_string(l)));
      if (range.first)
        a->tokens = static_cast<int32_t*>(
            arena_.alloc_bytes(p + ".tokens", static_cast<size_t>(N) * sizeof(int32_t)));
      if (range.last) {
        a->xf = alloc(p + ".final_norm", N * C);
        a->rstdf = alloc(p + ".final_rstd", N);
        a->dx_last = alloc(p + ".loss_grad", N * C);
      }
      if (!range.first) a->dx_in = alloc(p + ".input_grad", N * C);
      acts_[ci].push_back(std::move(a));
    }
  }
  footprint_.activations = arena_.used() - before;
  before = arena_.used();

  scratch_ = std::make_unique<Scratch>();
  auto& s = *scratch_;
  k::AttentionShape shape{B, T, heads_, kv_heads_, D};
  s.tmp = alloc("scratch.tmp", N * C);
  s.dx = alloc("scratch.dx", N * C);
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
  s.rope = alloc("scratch.rope_table", T * D);
  if (options_.checkpoint_every > 0) {
    // One block's activations, shared by every recomputed block: written by its forward (and
    // overwritten by the next), rebuilt by the recompute right before its backward.
    const LayerActs shared = alloc_layer("scratch.recompute_layer");
    for (size_t ci = 0; ci < chunks_.size(); ++ci)
      for (auto& slot : acts_[ci])
        for (int64_t i = 0; i < chunks_[ci].size(); ++i)
          if (recomputed(i)) slot->layers[i] = shared;
  }
  k::rope_table(s.rope, T, D, config_.rope_theta);
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

float* Model::w(const std::string& name) const { return state_.params.view(name).data; }
float* Model::g(const std::string& name) const { return state_.grads.view(name).data; }

void Model::tp_sum(float* data, int64_t n) const {
  if (tp_.size() > 1) tp_.all_reduce(data, static_cast<size_t>(n));
}

void Model::init(uint64_t seed) {
  const double base_std = 0.02;
  // GPT-2 / Megatron: projections into the residual stream shrink with depth.
  const double out_std = base_std / std::sqrt(2.0 * config_.n_layers);
  for (const auto& p : params_) {
    float* data = w(p.name);
    const auto& e = layout_.at(p.name);
    if (p.global_shape.size() == 1) {  // norm weights
      for (int64_t i = 0; i < e.numel; ++i) data[i] = 1.0f;
      continue;
    }
    const bool residual_out = p.name.find("o_proj") != std::string::npos ||
                              p.name.find("down_proj") != std::string::npos;
    const float std = static_cast<float>(residual_out ? out_std : base_std);
    const uint64_t key = mix(static_cast<uint64_t>(seed) ^ fnv1a(p.name));
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
  const int64_t N = rows_, C = config_.dim, D = config_.head_dim();
  const int64_t B = options_.micro_rows, T = config_.seq_len;
  const int64_t qd = heads_ * D, kvd = kv_heads_ * D;
  auto& s = *scratch_;
  k::rmsnorm_forward(a.xn1, a.rstd1, x_in, w(layer_name(l, "input_layernorm.weight")), N, C,
                     static_cast<float>(config_.norm_eps));
  k::linear_forward(a.q, a.xn1, w(layer_name(l, "self_attn.q_proj.weight")), N, C, qd);
  k::linear_forward(a.kk, a.xn1, w(layer_name(l, "self_attn.k_proj.weight")), N, C, kvd);
  k::linear_forward(a.v, a.xn1, w(layer_name(l, "self_attn.v_proj.weight")), N, C, kvd);
  k::rope_forward(a.q, a.q, s.rope, B, T, heads_, D, 0);
  k::rope_forward(a.kk, a.kk, s.rope, B, T, kv_heads_, D, 0);
  k::attention_forward(a.att, a.lse, a.q, a.kk, a.v, s.attn, {B, T, heads_, kv_heads_, D});
  k::linear_forward(s.tmp, a.att, w(layer_name(l, "self_attn.o_proj.weight")), N, qd, C);
  tp_sum(s.tmp, N * C);  // row-parallel: partial sums before the residual add
  std::memcpy(a.xmid, x_in, sizeof(float) * N * C);
  k::add_inplace(a.xmid, s.tmp, N * C);

  k::rmsnorm_forward(a.xn2, a.rstd2, a.xmid, w(layer_name(l, "post_attention_layernorm.weight")),
                     N, C, static_cast<float>(config_.norm_eps));
  k::linear_forward(a.gate, a.xn2, w(layer_name(l, "mlp.gate_proj.weight")), N, C, ffn_);
  k::linear_forward(a.up, a.xn2, w(layer_name(l, "mlp.up_proj.weight")), N, C, ffn_);
  k::swiglu_forward(a.h, a.gate, a.up, N * ffn_);
  k::linear_forward(s.tmp, a.h, w(layer_name(l, "mlp.down_proj.weight")), N, ffn_, C);
  tp_sum(s.tmp, N * C);
  std::memcpy(x_out, a.xmid, sizeof(float) * N * C);
  k::add_inplace(x_out, s.tmp, N * C);
}

void Model::backward_layer(int64_t l, LayerActs& a, const float* x_in, float* dx) {
  // dx (N, C): gradient of the block's output on entry, of its input on return.
  const int64_t N = rows_, C = config_.dim, D = config_.head_dim();
  const int64_t B = options_.micro_rows, T = config_.seq_len;
  const int64_t qd = heads_ * D, kvd = kv_heads_ * D;
  auto& s = *scratch_;
  const std::string down = layer_name(l, "mlp.down_proj.weight");
  const std::string gate = layer_name(l, "mlp.gate_proj.weight");
  const std::string up = layer_name(l, "mlp.up_proj.weight");
  const std::string ln2 = layer_name(l, "post_attention_layernorm.weight");
  k::linear_backward_input(s.dh, dx, w(down), N, ffn_, C);
  k::linear_backward_weight(g(down), dx, a.h, N, ffn_, C);
  k::swiglu_backward(s.dgate, s.dup, s.dh, a.gate, a.up, N * ffn_);
  k::linear_backward_input(s.dxn, s.dgate, w(gate), N, C, ffn_);
  k::linear_backward_input(s.dtmp, s.dup, w(up), N, C, ffn_);
  k::add_inplace(s.dxn, s.dtmp, N * C);
  k::linear_backward_weight(g(gate), s.dgate, a.xn2, N, C, ffn_);
  k::linear_backward_weight(g(up), s.dup, a.xn2, N, C, ffn_);
  tp_sum(s.dxn, N * C);  // column-parallel: the shared input's gradient is a partial sum
  k::rmsnorm_backward(s.dtmp, g(ln2), s.dxn, a.xmid, w(ln2), a.rstd2, N, C);
  k::add_inplace(dx, s.dtmp, N * C);  // dx is now d xmid

  const std::string o = layer_name(l, "self_attn.o_proj.weight");
  const std::string q = layer_name(l, "self_attn.q_proj.weight");
  const std::string kn = layer_name(l, "self_attn.k_proj.weight");
  const std::string v = layer_name(l, "self_attn.v_proj.weight");
  const std::string ln1 = layer_name(l, "input_layernorm.weight");
  k::linear_backward_input(s.datt, dx, w(o), N, qd, C);
  k::linear_backward_weight(g(o), dx, a.att, N, qd, C);
  k::attention_backward(s.dq, s.dk, s.dv, s.datt, a.q, a.kk, a.v, a.att, a.lse, s.attn,
                        {B, T, heads_, kv_heads_, D});
  k::rope_backward(s.dq, s.dq, s.rope, B, T, heads_, D, 0);
  k::rope_backward(s.dk, s.dk, s.rope, B, T, kv_heads_, D, 0);
  k::linear_backward_input(s.dxn, s.dq, w(q), N, C, qd);
  k::linear_backward_input(s.dtmp, s.dk, w(kn), N, C, kvd);
  k::add_inplace(s.dxn, s.dtmp, N * C);
  k::linear_backward_input(s.dtmp, s.dv, w(v), N, C, kvd);
  k::add_inplace(s.dxn, s.dtmp, N * C);
  k::linear_backward_weight(g(q), s.dq, a.xn1, N, C, qd);
  k::linear_backward_weight(g(kn), s.dk, a.xn1, N, C, kvd);
  k::linear_backward_weight(g(v), s.dv, a.xn1, N, C, kvd);
  tp_sum(s.dxn, N * C);
  k::rmsnorm_backward(s.dtmp, g(ln1), s.dxn, x_in, w(ln1), a.rstd1, N, C);
  k::add_inplace(dx, s.dtmp, N * C);  // dx is now d x_in
}

double Model::forward_head(ChunkActs& c, const int32_t* targets, float grad_scale,
                           bool training) {
  const int64_t N = rows_, C = config_.dim;
  auto& s = *scratch_;
  const std::string head = config_.tie_embeddings ? "model.embed_tokens.weight" : "lm_head.weight";
  const float* x_last = c.x.back();
  k::rmsnorm_forward(c.xf, c.rstdf, x_last, w("model.norm.weight"), N, C,
                     static_cast<float>(config_.norm_eps));
  k::linear_forward(s.logits, c.xf, w(head), N, C, vocab_);
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
    k::linear_backward_input(s.dxn, s.logits, w(head), N, C, vocab_);
    k::linear_backward_weight(g(head), s.logits, c.xf, N, C, vocab_);
    tp_sum(s.dxn, N * C);
    k::rmsnorm_backward(c.dx_last, g("model.norm.weight"), s.dxn, x_last, w("model.norm.weight"),
                        c.rstdf, N, C);
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
    const float* emb = w("model.embed_tokens.weight");
    k::embedding_forward(a.x[0], tokens, emb, N, C, vocab_start_, vocab_start_ + vocab_);
    tp_sum(a.x[0], N * C);  // vocab-parallel: each id's row comes from the rank owning it
  }
  for (int64_t l = range.begin; l < range.end; ++l) {
    const int64_t i = l - range.begin;
    forward_layer(l, a.layers[i], a.x[i], a.x[i + 1]);
  }
  return range.last ? forward_head(a, targets, grad_scale, training) : 0.0;
}

void Model::backward(int chunk, int slot, const float* dout) {
  const auto& range = chunks_.at(chunk);
  ChunkActs& a = *acts_.at(chunk).at(slot);
  const int64_t N = rows_, C = config_.dim;
  float* dx = range.first ? scratch_->dx : a.dx_in;
  std::memcpy(dx, range.last ? a.dx_last : dout, sizeof(float) * N * C);
  for (int64_t l = range.end - 1; l >= range.begin; --l) {
    const int64_t i = l - range.begin;
    // Recompute: the same forward on the same input gives the same bits, so rewriting x[i + 1]
    // (already consumed by the blocks above) is harmless and needs no extra buffer.
    if (recomputed(i)) forward_layer(l, a.layers[i], a.x[i], a.x[i + 1]);
    backward_layer(l, a.layers[i], a.x[i], dx);
    if (grad_hook_) grad_hook_(l);
  }
  if (range.first) {
    k::embedding_backward(g("model.embed_tokens.weight"), dx, a.tokens, N, C, vocab_start_,
                          vocab_start_ + vocab_);
    if (grad_hook_) grad_hook_(-1);
  }
}

double Model::grad_sum_of_squares(const std::vector<parallel::FloatRange>& ranges) const {
  double sum = 0;
  const float* grads = state_.grads.data();
  for (const auto& p : params_) {
    if (p.split_dim < 0 && tp_.rank() != 0) continue;  // replicated: identical on every tp rank
    const auto& e = layout_.at(p.name);
    for (const auto& r : ranges) {
      const int64_t lo = std::max(r.begin, e.offset), hi = std::min(r.end, e.offset + e.numel);
      if (lo < hi) sum += k::sum_of_squares(grads + lo, hi - lo);
    }
  }
  return sum;
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
    for (int64_t i = 0; i < rows_ * config_.dim; ++i)
      if (!std::isfinite(x[i])) return false;
    return true;
  };
  for (size_t ci = 0; ci < chunks_.size(); ++ci) {
    const auto& range = chunks_[ci];
    const auto& a = *acts_[ci].at(slot);
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
