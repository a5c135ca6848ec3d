#include "runtime/use/generate.h"

#include <algorithm>
#include <cmath>
#include <cstdio>
#include <string_view>

#include "kernels/check.h"
#include "kernels/ops.h"
#include "kernels/ops_decode.h"
#include "kernels/ops_gate.h"
#include "kernels/ops_moe.h"
#include "kernels/ops_swiglu.h"
#include "runtime/model/moe_block.h"

namespace t3d::runtime {

namespace k = t3d::kernels;

Decoder::Decoder(const SnapshotWeights& w, const k::Exec& exec)
    : config_(w.recipe.model), exec_(exec) {
  const std::size_t bytes = place(w, nullptr);
  arena_ = std::make_unique<k::Arena>(bytes, k::device_memory(exec));
  place(w, arena_.get());
  const auto& m = config_;
  std::vector<float> rope(static_cast<size_t>(m.seq_len * m.head_dim()));
  k::rope_table(rope.data(), m.seq_len, m.head_dim(), m.rope_theta, m.rope());  // the Model's
  k::copy_from_host(exec_, rope_, rope.data(), sizeof(float) * rope.size());
  if (!k::host_shares_device_memory(exec_)) logits_host_.resize(static_cast<size_t>(m.vocab_size));
}

Decoder::~Decoder() = default;

std::size_t Decoder::place(const SnapshotWeights& w, k::Arena* arena) {
  const auto& m = config_;
  const int64_t C = m.dim, D = m.head_dim(), T = m.seq_len;
  std::size_t bytes = 0;
  const auto take = [&](int64_t n, std::size_t size = sizeof(float)) -> void* {
    const std::size_t b = static_cast<std::size_t>(std::max<int64_t>(n, 1)) * size;
    bytes += k::aligned_bytes(b);
    return arena ? arena->alloc_bytes("decoder", b) : nullptr;
  };
  const auto floats = [&](int64_t n) { return static_cast<float*>(take(n)); };
  const auto ints = [&](int64_t n) { return static_cast<int32_t*>(take(n, sizeof(int32_t))); };
  // A weight: in place on the CPU; on a GPU (or guarded) its copy in the arena.
  const auto weight = [&](const float* host, int64_t n) -> const float* {
    if (k::host_shares_device_memory(exec_)) return host;
    float* dev = floats(n);
    if (arena) k::copy_from_host(exec_, dev, host, sizeof(float) * static_cast<size_t>(n));
    return dev;
  };
  const auto named = [&](const std::string& name) {
    const auto& t = w.at(name).data;
    return weight(t.data(), static_cast<int64_t>(t.size()));
  };
  embed_ = named("model.embed_tokens.weight");
  norm_ = named("model.norm.weight");
  head_ = m.tie_embeddings ? embed_ : named("lm_head.weight");
  layers_.clear();
  expert_stacks_.clear();
  for (int64_t l = 0; l < m.n_layers; ++l) {
    Layer L;
    for (const BlockWeight t : kAllBlockWeights) {
      if (!block_has(m, l, t)) continue;
      if (!is_expert_weight(t)) {
        L[t] = named(block_param_name(l, t));
        continue;
      }
      auto& stack = expert_stacks_.emplace_back();
      for (int64_t e = 0; e < m.n_experts; ++e) {
        const auto& x = w.at(block_param_name(l, t, e)).data;
        stack.insert(stack.end(), x.begin(), x.end());
      }
      L[t] = weight(stack.data(), static_cast<int64_t>(stack.size()));
    }
    L.k_cache = floats(T * m.n_kv_heads * D);
    L.v_cache = floats(T * m.n_kv_heads * D);
    layers_.push_back(L);
  }
  x_ = floats(C), xn_ = floats(C), q_ = floats(m.n_heads * D), att_ = floats(m.n_heads * D);
  if (m.qk_norm)
    q_raw_ = floats(m.n_heads * D), k_raw_ = floats(m.n_kv_heads * D),
    head_rstd_ = floats(m.n_heads);
  const int64_t F = std::max(m.ffn_dim, m.shared_ffn_dim());  // dense or shared experts' SwiGLU
  gate_ = floats(F), up_ = floats(F), h_ = floats(F);
  if (m.moe()) {
    const int64_t E = m.n_experts, K = m.experts_per_token, Fe = m.moe_ffn_dim;
    router_scores_ = floats(E), gates_ = floats(K), chosen_ = ints(K), row_of_slot_ = ints(K),
    slot_of_row_ = ints(K);
    rows_in_ = floats(K * C), rows_out_ = floats(K * C);
    egate_ = floats(K * Fe), eup_ = floats(K * Fe), eh_ = floats(K * Fe);
    branch_ = floats(C), shared_g_ = floats(1);
    chosen_host_.resize(static_cast<size_t>(K));
    row_of_slot_host_.resize(static_cast<size_t>(K));
    slot_of_row_host_.resize(static_cast<size_t>(K));
    expert_offsets_.resize(static_cast<size_t>(E + 1));
  }
  rope_ = floats(T * D);
  scores_ = floats(std::max(T, m.n_heads));  // the CPU's scores (seq_len), a GPU's lse (H)
  logits_ = floats(m.vocab_size);
  rstd_ = floats(m.n_heads);  // one row's 1/rms (the per-head norms reuse head_rstd_)
  token_ = ints(1);
  return bytes;
}

std::span<const float> Decoder::step(int32_t token) {
  const auto& m = config_;
  T3D_USER_CHECK(pos_ < m.seq_len, "the decoder's context of model.seq_len = ", m.seq_len,
                 " positions is full; reset() it (generate() does)");
  k::check_token_ids(&token, 1, m.vocab_size);
  const int64_t C = m.dim, D = m.head_dim(), H = m.n_heads, Hkv = m.n_kv_heads, F = m.ffn_dim;
  const float eps = static_cast<float>(m.norm_eps);
  const k::Exec& ex = exec_;
  k::copy_from_host(ex, token_, &token, sizeof token);  // the token's crossing
  // One row through the same ops as Model::forward_layer, N = 1, positions pos_ .. pos_.
  k::embedding_forward(ex, x_, token_, embed_, 1, C, 0, m.vocab_size);
  for (auto& L : layers_) {
    float* kc = L.k_cache + pos_ * Hkv * D;  // this position's row of the caches
    float* vc = L.v_cache + pos_ * Hkv * D;
    k::rmsnorm_forward(ex, xn_, rstd_, x_, L.ln1, 1, C, eps);
    // model.qk_norm: q and k into their raw buffers, then normalised per head into q_ and kc.
    float* q = L.q_norm ? q_raw_ : q_;
    float* kk = L.q_norm ? k_raw_ : kc;
    k::linear_forward(ex, q, xn_, L.q, 1, C, H * D);
    k::linear_forward(ex, kk, xn_, L.k, 1, C, Hkv * D);
    k::linear_forward(ex, vc, xn_, L.v, 1, C, Hkv * D);
    if (L.q_bias) {  // model.qkv_bias, as Model::add_qkv_bias (an fp32 addition)
      k::add_inplace(ex, q, L.q_bias, H * D);
      k::add_inplace(ex, kk, L.k_bias, Hkv * D);
      k::add_inplace(ex, vc, L.v_bias, Hkv * D);
    }
    if (L.q_norm) {  // as Model::forward_layer: rows = heads, width = D
      k::rmsnorm_forward(ex, q_, head_rstd_, q, L.q_norm, H, D, eps);
      k::rmsnorm_forward(ex, kc, head_rstd_, kk, L.k_norm, Hkv, D, eps);
    }
    k::rope_forward(ex, q_, q_, rope_, 1, 1, H, D, pos_);
    k::rope_forward(ex, kc, kc, rope_, 1, 1, Hkv, D, pos_);
    k::attention_decode(ex, att_, q_, L.k_cache, L.v_cache, scores_, pos_ + 1, H, Hkv, D);
    k::linear_forward(ex, x_, att_, L.o, 1, H * D, C, k::Out::kAccumulate);
    k::rmsnorm_forward(ex, xn_, rstd_, x_, L.ln2, 1, C, eps);
    if (L.router) {
      moe_step(L);
      continue;
    }
    k::swiglu_mlp_forward(ex, x_, k::Out::kAccumulate, k::LinearInput(ex, xn_, 1, C),
                          {L.gate, L.up, L.down}, {gate_, up_, h_}, {}, F);
  }
  k::rmsnorm_forward(ex, xn_, rstd_, x_, norm_, 1, C, eps);
  k::linear_forward(ex, logits_, xn_, head_, 1, C, m.vocab_size);
  ++pos_;
  if (k::host_shares_device_memory(ex)) return {logits_, static_cast<size_t>(m.vocab_size)};
  k::copy_to_host(ex, logits_host_.data(), logits_, sizeof(float) * logits_host_.size());
  return logits_host_;
}

// The MoE block as training computes it on one rank without a capacity (one token never drops):
// the same router (runtime/model/moe_block.h), experts and shared experts. The K chosen experts
// cross to the host to be permuted there (as training's routing does), the permutation back.
void Decoder::moe_step(const Layer& L) {
  const auto& m = config_;
  const int64_t C = m.dim, E = m.n_experts, K = m.experts_per_token;
  const k::Exec& ex = exec_;
  const k::RouterShape r = router_shape(m, 1);
  route(ex, router_scores_, chosen_, gates_, xn_, L.router, L.router_bias, r, C);
  const std::size_t routing = sizeof(int32_t) * static_cast<size_t>(K);
  k::copy_to_host(ex, chosen_host_.data(), chosen_, routing);
  k::moe_permute(expert_offsets_.data(), row_of_slot_host_.data(), slot_of_row_host_.data(),
                 chosen_host_.data(), 1, E, K);
  k::copy_from_host(ex, row_of_slot_, row_of_slot_host_.data(), routing);
  k::copy_from_host(ex, slot_of_row_, slot_of_row_host_.data(), routing);
  k::moe_gather(ex, rows_in_, xn_, slot_of_row_, K, K, C);
  k::moe_experts_forward(ex, rows_out_, {egate_, eup_, eh_}, rows_in_,
                         {L.expert_gate, L.expert_up, L.expert_down}, expert_offsets_.data(),
                         {E, C, m.moe_ffn_dim});
  k::moe_combine(ex, branch_, rows_out_, gates_, row_of_slot_, 1, K, C, k::Out::kWrite);
  // The shared experts: added to the routed output, or behind their sigmoid gate (model.shared_
  // expert_gate) written into rows_out_ (read by the combine already) and added gated, as
  // training's shared_experts_down does.
  if (L.shared_gate) {
    const bool gated = L.shared_expert_gate != nullptr;
    k::swiglu_mlp_forward(
        ex, gated ? rows_out_ : branch_, gated ? k::Out::kWrite : k::Out::kAccumulate,
        k::LinearInput(ex, xn_, 1, C), {L.shared_gate, L.shared_up, L.shared_down},
        {gate_, up_, h_}, {}, m.shared_ffn_dim());
    if (gated)
      k::shared_gate_forward(ex, branch_, shared_g_, xn_, L.shared_expert_gate, rows_out_, 1, C);
  }
  k::add_inplace(ex, x_, branch_, C);
}

int32_t pick_token(std::span<const float> logits, int64_t vocab_limit,
                   const SamplingOptions& options, std::mt19937_64& rng) {
  const int64_t n = std::min<int64_t>(vocab_limit, static_cast<int64_t>(logits.size()));
  T3D_ASSERT(n > 0, "no token to pick from");
  if (options.temperature <= 0) {
    return static_cast<int32_t>(std::max_element(logits.begin(), logits.begin() + n) -
                                logits.begin());
  }
  // Top-k: the k-th largest logit is the cut-off; ties at the cut-off all stay in (deterministic).
  float cutoff = -INFINITY;
  if (options.top_k > 0 && options.top_k < n) {
    std::vector<float> sorted(logits.begin(), logits.begin() + n);
    std::nth_element(sorted.begin(), sorted.begin() + (options.top_k - 1), sorted.end(),
                     std::greater<float>());
    cutoff = sorted[static_cast<size_t>(options.top_k - 1)];
  }
  const float max = *std::max_element(logits.begin(), logits.begin() + n);
  const double inv_t = 1.0 / options.temperature;
  double sum = 0;
  for (int64_t i = 0; i < n; ++i)
    if (logits[i] >= cutoff) sum += std::exp((logits[i] - max) * inv_t);
  // One uniform in [0, 1) from the top 53 bits: the same on every platform, unlike
  // std::uniform_real_distribution, whose algorithm the standard leaves open.
  const double u = static_cast<double>(rng() >> 11) * 0x1.0p-53 * sum;
  double acc = 0;
  int64_t last = 0;
  for (int64_t i = 0; i < n; ++i) {
    if (logits[i] < cutoff) continue;
    acc += std::exp((logits[i] - max) * inv_t);
    last = i;
    if (u < acc) return static_cast<int32_t>(i);
  }
  return static_cast<int32_t>(last);  // u rounded up to sum
}

std::vector<int32_t> generate(Decoder& decoder, std::span<const int32_t> prompt, int64_t max_tokens,
                              int64_t vocab_limit, const SamplingOptions& options,
                              const std::function<void(int32_t)>& emit) {
  T3D_USER_CHECK(!prompt.empty(), "the prompt is empty; give at least one character (--prompt)");
  const int64_t context = decoder.context();
  const int64_t keep = std::max<int64_t>(1, context / 2);
  std::vector<int32_t> history(prompt.begin(), prompt.end());
  std::mt19937_64 rng(options.seed);
  // Feeds the last `n` tokens of the history into an empty cache; returns the next logits.
  const auto refill = [&](int64_t n) {
    decoder.reset();
    std::span<const float> logits;
    for (auto it = history.end() - n; it != history.end(); ++it) logits = decoder.step(*it);
    return logits;
  };
  // A prompt longer than the context keeps its end: the tokens nearest what comes next.
  std::span<const float> logits =
      refill(std::min<int64_t>(static_cast<int64_t>(history.size()), context));
  std::vector<int32_t> out;
  for (int64_t i = 0; i < max_tokens; ++i) {
    const int32_t next = pick_token(logits, vocab_limit, options, rng);
    history.push_back(next);
    out.push_back(next);
    if (emit) emit(next);
    if (i + 1 == max_tokens) break;
    // A full cache: start over from the last half, so the next `keep` tokens are cheap again.
    logits = decoder.position() < context ? decoder.step(next) : refill(keep);
  }
  return out;
}

CompletionPrinter::CompletionPrinter(const TextTokenizer& tokenizer,
                                     std::span<const int32_t> prompt)
    : tokenizer_(tokenizer), ids_(prompt.begin(), prompt.end()) {
  prompt_chars_ = tokenizer_.decode(std::span<const int32_t>(ids_)).size();
}

void CompletionPrinter::add(int32_t token) {
  ids_.push_back(token);
  print(false);
}

void CompletionPrinter::finish() { print(true); }

void CompletionPrinter::print(bool all) {
  const std::string text = tokenizer_.decode(std::span<const int32_t>(ids_));
  static constexpr std::string_view kReplacement = "\xef\xbf\xbd";
  if (!all && text.size() >= kReplacement.size() &&
      text.compare(text.size() - kReplacement.size(), kReplacement.size(), kReplacement) == 0)
    return;
  // Decoding more tokens only appends, except where a held-back character completed.
  const size_t start = std::min(text.size(), prompt_chars_ + printed_);
  std::fwrite(text.data() + start, 1, text.size() - start, stdout);
  std::fflush(stdout);
  printed_ += text.size() - start;
}

}  // namespace t3d::runtime
