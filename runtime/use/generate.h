// Autoregressive sampling from a trained model on one process, with a KV cache.
//
// Training runs whole sequences through a sharded, pipelined Model; decoding feeds one token at a
// time and needs every earlier position's keys and values, which the training path does not
// keep. So this is a separate single-rank forward over the whole (global) tensors, built from the
// same kernels (rmsnorm, linear, rope_forward at the token's position, swiglu) plus
// attention_decode over the cache. A test checks its logits against a whole-sequence forward.
#pragma once

#include <cstdint>
#include <functional>
#include <random>
#include <span>
#include <vector>

#include "kernels/gemm.h"
#include "runtime/data/text_tokenizer.h"
#include "runtime/model/model_spec.h"
#include "runtime/use/export.h"

namespace t3d::runtime {

class Decoder {
 public:
  // `weights` must outlive the decoder (it points into their tensors). `gemm`: the kind of its
  // linear layers (kernels/gemm.h).
  Decoder(const SnapshotWeights& weights, kernels::GemmKind gemm);

  // Appends `token` at position position() and returns the logits (vocab_size) of the next
  // token; valid until the next call. UserError once the context (model.seq_len) is full.
  std::span<const float> step(int32_t token);
  void reset() { pos_ = 0; }  // empties the cache
  int64_t position() const { return pos_; }
  int64_t context() const { return config_.seq_len; }
  const ModelConfig& config() const { return config_; }

 private:
  struct Layer : BlockTensors<const float*> {  // the block's weights, by the spec's rows
    std::vector<float> k_cache, v_cache;       // (seq_len, Hkv·D) each, keys after RoPE
    // A MoE block's routed experts' rows, each stacked (E matrices back to back) as the
    // grouped pass reads them.
    std::vector<std::vector<float>> expert_stacks;
  };
  ModelConfig config_;
  kernels::GemmKind gemm_;
  const float* embed_;
  const float* norm_;
  const float* head_;
  std::vector<Layer> layers_;
  int64_t pos_ = 0;
  // Work buffers for one row: residual, normed, q, attention output, gate,
  // up, silu(gate)·up, the RoPE table (seq_len, D), attention scores (seq_len), logits (vocab).
  std::vector<float> x_, xn_, q_, att_, gate_, up_, h_, rope_, scores_, logits_;
  float rstd_ = 0;
  // model.qk_norm: q and k before their per-head norms (H·D, Hkv·D), the heads' 1/rms (H).
  std::vector<float> q_raw_, k_raw_, head_rstd_;
  // A mixture-of-experts block's MLP part for the row (the training forward's kernels, N = 1):
  // its output added to the residual x_.
  void moe_step(const Layer& L);
  // Its buffers: router scores (E), chosen experts and gates (K), the permutation, the K
  // permuted rows in and out (K, C), the experts' gate, up and h (K, Fe), the branch (C).
  std::vector<float> router_scores_, gates_, rows_in_, rows_out_, egate_, eup_, eh_, branch_;
  std::vector<int32_t> chosen_, row_of_slot_, slot_of_row_;
  std::vector<int64_t> expert_offsets_;
};

// The most tokens one `generate` samples (--max-tokens): beyond the context the cache is rebuilt
// and the streamed text decoded again per token, so an unbounded count would run for hours.
inline constexpr int64_t kMaxGenerateTokens = 100000;

struct SamplingOptions {
  double temperature = 0.8;  // 0: greedy (argmax, the lowest id on ties)
  int64_t top_k = 0;         // > 0: sample among the k most likely tokens only
  uint64_t seed = 1234;
};

// The next token from `logits`, among ids [0, vocab_limit). Deterministic for a given RNG state:
// one draw of the 64-bit Mersenne twister (whose output the C++ standard fixes) per token.
int32_t pick_token(std::span<const float> logits, int64_t vocab_limit,
                   const SamplingOptions& options, std::mt19937_64& rng);

// Feeds `prompt` and samples up to `max_tokens` more, calling `emit` with each as it comes.
// When the context is full, the cache is rebuilt from the last half of the tokens so far (RoPE
// positions restart at 0), so generation can run past model.seq_len. Returns the new tokens.
std::vector<int32_t> generate(Decoder& decoder, std::span<const int32_t> prompt, int64_t max_tokens,
                              int64_t vocab_limit, const SamplingOptions& options,
                              const std::function<void(int32_t)>& emit = {});

// Streams a completion to stdout as text while it is generated. A subword token may end inside a
// UTF-8 character (byte pieces), and SentencePiece decodes a whole sequence, not token by token
// (its leading-space rule depends on what came before), so each call decodes prompt + completion
// and prints what is new, holding back text that ends in U+FFFD (a character still incomplete).
class CompletionPrinter {
 public:
  CompletionPrinter(const TextTokenizer& tokenizer, std::span<const int32_t> prompt);
  void add(int32_t token);
  void finish();  // prints what was held back

 private:
  void print(bool all);
  const TextTokenizer& tokenizer_;
  std::vector<int32_t> ids_;
  size_t prompt_chars_ = 0;  // of the decoded prompt
  size_t printed_ = 0;       // of the completion's text
};

}  // namespace t3d::runtime
