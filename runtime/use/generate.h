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
#include <memory>
#include <random>
#include <span>
#include <vector>

#include "kernels/arena.h"
#include "kernels/exec.h"
#include "runtime/data/text_tokenizer.h"
#include "runtime/model/model_spec.h"
#include "runtime/use/export.h"

namespace t3d::runtime {

class Decoder {
 public:
  // `weights` must outlive the decoder: on the CPU it reads their tensors in place; on a GPU
  // (`exec` a GPU execution) it copies them into device memory. `exec`: where it computes, and
  // the kind of its linear layers (kernels/gemm.h). Its caches and buffers come from an arena of
  // the exec's memory, sized once here.
  Decoder(const SnapshotWeights& weights, const kernels::Exec& exec);
  ~Decoder();
  Decoder(const Decoder&) = delete;
  Decoder& operator=(const Decoder&) = delete;

  // Appends `token` at position position() and returns the logits (vocab_size) of the next
  // token, in host memory (on a GPU: the step's one crossing); valid until the next call.
  // UserError once the context (model.seq_len) is full.
  std::span<const float> step(int32_t token);
  void reset() { pos_ = 0; }  // empties the cache
  int64_t position() const { return pos_; }
  int64_t context() const { return config_.seq_len; }
  const ModelConfig& config() const { return config_; }

 private:
  struct Layer : BlockTensors<const float*> {  // the block's weights, by the spec's rows
    float* k_cache = nullptr;                  // (seq_len, Hkv·D), keys after RoPE
    float* v_cache = nullptr;                  // (seq_len, Hkv·D)
  };
  // Points every weight, cache and buffer into `arena`'s memory (weights in place on the CPU),
  // or with `arena` null only adds up the bytes that takes: the constructor sizes the arena so.
  std::size_t place(const SnapshotWeights& w, kernels::Arena* arena);
  // A MoE block's MLP part for the row (the training forward's kernels, N = 1): its output added
  // to the residual x_.
  void moe_step(const Layer& L);

  ModelConfig config_;
  kernels::Exec exec_;
  std::unique_ptr<kernels::Arena> arena_;
  // A MoE block's routed experts' rows, each stacked (E matrices back to back) as the grouped
  // pass reads them: host memory, copied into the arena on a GPU.
  std::vector<std::vector<float>> expert_stacks_;
  const float* embed_ = nullptr;
  const float* norm_ = nullptr;
  const float* head_ = nullptr;
  std::vector<Layer> layers_;
  int64_t pos_ = 0;
  // One row's buffers: residual, normed, q, attention output, gate, up, silu(gate)·up, the RoPE
  // table (seq_len, D), attention scratch (seq_len or H), logits (vocab), RMSNorm's 1/rms, the
  // token; model.qk_norm: q and k before their per-head norms (H·D, Hkv·D), the heads' 1/rms (H).
  float *x_ = nullptr, *xn_ = nullptr, *q_ = nullptr, *att_ = nullptr, *gate_ = nullptr,
        *up_ = nullptr, *h_ = nullptr, *rope_ = nullptr, *scores_ = nullptr, *logits_ = nullptr,
        *rstd_ = nullptr, *q_raw_ = nullptr, *k_raw_ = nullptr, *head_rstd_ = nullptr;
  int32_t* token_ = nullptr;
  std::vector<float> logits_host_;  // a GPU's logits, crossed
  // A MoE block's: router scores (E), chosen experts and gates (K), the permutation, the K
  // permuted rows in and out (K, C), the experts' gate, up and h (K, Fe), the branch (C), the
  // shared expert's gate (1). The routing is permuted on the host (the block's named crossing).
  float *router_scores_ = nullptr, *gates_ = nullptr, *rows_in_ = nullptr, *rows_out_ = nullptr,
        *egate_ = nullptr, *eup_ = nullptr, *eh_ = nullptr, *branch_ = nullptr,
        *shared_g_ = nullptr;
  int32_t *chosen_ = nullptr, *row_of_slot_ = nullptr, *slot_of_row_ = nullptr;
  std::vector<int32_t> chosen_host_, row_of_slot_host_, slot_of_row_host_;
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
