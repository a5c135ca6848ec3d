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

Decoder::Decoder(const SnapshotWeights& w, k::GemmKind gemm)
    : config_(w.recipe.model), gemm_(gemm) {
  const auto& m = config_;
  const int64_t C = m.dim, D = m.head_dim(), T = m.seq_len;
  const auto at = [&](const std::string& name) { return w.at(name).data.data(); };
  embed_ = at("model.embed_tokens.weight");
  norm_ = at("model.norm.weight");
  head_ = m.tie_embeddings ? embed_ : at("lm_head.weight");
  for (int64_t l = 0; l < m.n_layers; ++l) {
    Layer L;
    for (const BlockWeight t : kAllBlockWeights) {
      if (!block_has(m, l, t)) continue;
      if (!is_expert_weight(t)) {
        L[t] = at(block_param_name(l, t));
        continue;
      }
      auto& stack = L.expert_stacks.emplace_back();
      for (int64_t e = 0; e < m.n_experts; ++e) {
        const auto& x = w.at(block_param_name(l, t, e)).data;
        stack.insert(stack.end(), x.begin(), x.end());
      }
      L[t] = stack.data();
    }
    L.k_cache.assign(static_cast<size_t>(T * m.n_kv_heads * D), 0.0f);
    L.v_cache.assign(L.k_cache.size(), 0.0f);
    layers_.push_back(std::move(L));
  }
  const auto n = [](int64_t x) { return static_cast<size_t>(x); };
  x_.resize(n(C));
  xn_.resize(n(C));
  q_.resize(n(m.n_heads * D));
  att_.resize(n(m.n_heads * D));
  if (m.qk_norm) {
    q_raw_.resize(q_.size());
    k_raw_.resize(n(m.n_kv_heads * D));
    head_rstd_.resize(n(m.n_heads));
  }
  const int64_t F = std::max(m.ffn_dim, m.shared_ffn_dim());  // dense or shared experts' SwiGLU
  gate_.resize(n(F));
  up_.resize(n(F));
  h_.resize(n(F));
  if (m.moe()) {
    const int64_t E = m.n_experts, K = m.experts_per_token, Fe = m.moe_ffn_dim;
    router_scores_.resize(n(E));
    gates_.resize(n(K));
    chosen_.resize(n(K));
    row_of_slot_.resize(n(K));
    slot_of_row_.resize(n(K));
    expert_offsets_.resize(n(E + 1));
    rows_in_.resize(n(K * C));
    rows_out_.resize(n(K * C));
    egate_.resize(n(K * Fe));
    eup_.resize(n(K * Fe));
    eh_.resize(n(K * Fe));
    branch_.resize(n(C));
  }
  rope_.resize(n(T * D));
  scores_.resize(n(T));
  logits_.resize(n(m.vocab_size));
  k::rope_table(rope_.data(), T, D, m.rope_theta, m.rope());  // the Model's table
}

std::span<const float> Decoder::step(int32_t token) {
  const auto& m = config_;
  T3D_USER_CHECK(pos_ < m.seq_len, "the decoder's context of model.seq_len = ", m.seq_len,
                 " positions is full; reset() it (generate() does)");
  k::check_token_ids(&token, 1, m.vocab_size);
  const int64_t C = m.dim, D = m.head_dim(), H = m.n_heads, Hkv = m.n_kv_heads, F = m.ffn_dim;
  const float eps = static_cast<float>(m.norm_eps);
  // One row through the same ops as Model::forward_layer, N = 1, positions pos_ .. pos_.
  k::embedding_forward(k::kCpu, x_.data(), &token, embed_, 1, C, 0, m.vocab_size);
  for (auto& L : layers_) {
    float* kc = L.k_cache.data() + pos_ * Hkv * D;  // this position's row of the caches
    float* vc = L.v_cache.data() + pos_ * Hkv * D;
    k::rmsnorm_forward(k::kCpu, xn_.data(), &rstd_, x_.data(), L.ln1, 1, C, eps);
    // model.qk_norm: q and k into their raw buffers, then normalised per head into q_ and kc.
    float* q = L.q_norm ? q_raw_.data() : q_.data();
    float* kk = L.q_norm ? k_raw_.data() : kc;
    k::linear_forward(gemm_, q, xn_.data(), L.q, 1, C, H * D);
    k::linear_forward(gemm_, kk, xn_.data(), L.k, 1, C, Hkv * D);
    k::linear_forward(gemm_, vc, xn_.data(), L.v, 1, C, Hkv * D);
    if (L.q_bias) {  // model.qkv_bias, as Model::add_qkv_bias (an fp32 addition)
      k::add_inplace(k::kCpu, q, L.q_bias, H * D);
      k::add_inplace(k::kCpu, kk, L.k_bias, Hkv * D);
      k::add_inplace(k::kCpu, vc, L.v_bias, Hkv * D);
    }
    if (L.q_norm) {  // as Model::forward_layer: rows = heads, width = D
      k::rmsnorm_forward(k::kCpu, q_.data(), head_rstd_.data(), q, L.q_norm, H, D, eps);
      k::rmsnorm_forward(k::kCpu, kc, head_rstd_.data(), kk, L.k_norm, Hkv, D, eps);
    }
    k::rope_forward(k::kCpu, q_.data(), q_.data(), rope_.data(), 1, 1, H, D, pos_);
    k::rope_forward(k::kCpu, kc, kc, rope_.data(), 1, 1, Hkv, D, pos_);
    k::attention_decode(att_.data(), q_.data(), L.k_cache.data(), L.v_cache.data(), scores_.data(),
                        pos_ + 1, H, Hkv, D);
    k::linear_forward(gemm_, x_.data(), att_.data(), L.o, 1, H * D, C, k::Out::kAccumulate);
    k::rmsnorm_forward(k::kCpu, xn_.data(), &rstd_, x_.data(), L.ln2, 1, C, eps);
    if (L.router) {
      moe_step(L);
      continue;
    }
    k::swiglu_mlp_forward(gemm_, x_.data(), k::Out::kAccumulate,
                          k::LinearInput(gemm_, xn_.data(), 1, C), {L.gate, L.up, L.down},
                          {gate_.data(), up_.data(), h_.data()}, {}, F);
  }
  k::rmsnorm_forward(k::kCpu, xn_.data(), &rstd_, x_.data(), norm_, 1, C, eps);
  k::linear_forward(gemm_, logits_.data(), xn_.data(), head_, 1, C, m.vocab_size);
  ++pos_;
  return logits_;
}

// The MoE block as training computes it on one rank without a capacity (one token never drops):
// the same router (runtime/model/moe_block.h), experts and shared experts.
void Decoder::moe_step(const Layer& L) {
  const auto& m = config_;
  const int64_t C = m.dim, E = m.n_experts, K = m.experts_per_token;
  const k::RouterShape r = router_shape(m, 1);
  route(gemm_, router_scores_.data(), chosen_.data(), gates_.data(), xn_.data(), L.router,
        L.router_bias, r, C);
  k::moe_permute(expert_offsets_.data(), row_of_slot_.data(), slot_of_row_.data(), chosen_.data(),
                 1, E, K);
  k::moe_gather(gemm_, rows_in_.data(), xn_.data(), slot_of_row_.data(), K, K, C);
  k::moe_experts_forward(gemm_, rows_out_.data(), {egate_.data(), eup_.data(), eh_.data()},
                         rows_in_.data(), {L.expert_gate, L.expert_up, L.expert_down},
                         expert_offsets_.data(), {E, C, m.moe_ffn_dim});
  k::moe_combine(gemm_, branch_.data(), rows_out_.data(), gates_.data(), row_of_slot_.data(), 1, K,
                 C, k::Out::kWrite);
  // The shared experts: added to the routed output, or behind their sigmoid gate (model.shared_
  // expert_gate) written into rows_out_ (read by the combine already) and added gated, as
  // training's shared_experts_down does.
  if (L.shared_gate) {
    const bool gated = L.shared_expert_gate != nullptr;
    k::swiglu_mlp_forward(gemm_, gated ? rows_out_.data() : branch_.data(),
                          gated ? k::Out::kWrite : k::Out::kAccumulate,
                          k::LinearInput(gemm_, xn_.data(), 1, C),
                          {L.shared_gate, L.shared_up, L.shared_down},
                          {gate_.data(), up_.data(), h_.data()}, {}, m.shared_ffn_dim());
    float g = 0;
    if (gated)
      k::shared_gate_forward(k::kCpu, branch_.data(), &g, xn_.data(), L.shared_expert_gate,
                             rows_out_.data(), 1, C);
  }
  k::add_inplace(k::kCpu, x_.data(), branch_.data(), C);
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
