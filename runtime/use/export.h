// Taking a model out of a snapshot: its whole (global) tensors under Hugging Face LLaMA names,
// for `titan3d export` (model.safetensors + config.json in the LlamaForCausalLM form) and for
// `titan3d generate`, which runs on one process and needs every tensor whole.
//
// Neither needs MPI: the snapshot's virtual datasets already describe global tensors, and the
// reader gathers any box from whatever layout wrote it (docs/snapshot-format.md). Both call HDF5
// from the calling thread; nothing else in these processes touches HDF5.
#pragma once

#include <cstdint>
#include <string>
#include <vector>

#include "runtime/data/text_tokenizer.h"
#include "runtime/recipe/recipe.h"

namespace t3d::runtime {

struct GlobalTensor {
  std::string name;  // e.g. "model.layers.0.self_attn.q_proj.weight"
  std::vector<int64_t> shape;
  std::vector<float> data;  // row-major, prod(shape) floats
};

// The whole model's tensors with their global shapes, in the model's order: embedding, blocks,
// final norm, LM head (absent with tie_embeddings): the model spec's parameter table
// (runtime/model/model_spec.h, param_table), data still empty.
std::vector<GlobalTensor> llama_tensor_table(const ModelConfig& config);

// The Hugging Face family `export` writes a model as and `import` reads back: LLaMA
// (LlamaForCausalLM) for a dense model, Qwen2's (Qwen2ForCausalLM) for a dense one with q/k/v
// biases, Qwen3's (Qwen3ForCausalLM) for one with q/k norms; for a mixture of experts with q/k
// norms Qwen3-MoE's (Qwen3MoeForCausalLM: no shared experts, leading dense blocks as its
// `mlp_only_layers`), else Mixtral's (MixtralForCausalLM) when every block is one without shared
// experts, else Qwen2-MoE's (Qwen2MoeForCausalLM: shared experts, leading dense blocks).
// kMistral (MistralForCausalLM without a sliding window: LLaMA's block and names) is read by
// `import` only: hf_layout never returns it, so such a model is exported as LlamaForCausalLM.
enum class HfLayout { kLlama, kMixtral, kQwen2Moe, kQwen2, kQwen3, kQwen3Moe, kMistral };
HfLayout hf_layout(const ModelConfig& config);

// A tensor's name in that family: the table's own name, except for a mixture of experts' router
// and experts. Mixtral: the router `mlp.router.weight` is `block_sparse_moe.gate.weight`, expert
// e's gate, down and up projections `block_sparse_moe.experts.<e>.w1 / w2 / w3.weight`.
// Qwen2-MoE: the router is `mlp.gate.weight`, the shared experts `mlp.shared_expert.*`.
std::string hf_tensor_name(const ModelConfig& config, const std::string& name);
// UserError unless hf_layout's family can hold the model `config` exactly (the key that prevents
// it named): no q/k/v biases in a mixture of experts but Qwen2-MoE's, nor with q/k norms (Qwen3's
// attention_bias would bias o_proj too); a softmax router without a selection bias or a gate
// scale; Mixtral's also over normalised gates; Qwen3-MoE's without shared experts.
// `what` names the model in the message.
void check_hf_layout(const ModelConfig& config, const std::string& what);

// Qwen2-MoE always has q/k/v biases and, per MoE block, a sigmoid gate on the shared experts'
// output (`mlp.shared_expert_gate.weight`, (1, dim)). A model with model.qkv_bias and
// model.shared_expert_gate has them as parameters; for one without, they are written as zeros,
// with the shared experts' down projection doubled where the gate is missing, and compute
// titan3d's block exactly (a bias of 0 adds nothing; sigmoid(0) = 1/2 halves the doubled output,
// both steps exact in fp32 and bf16). The zero tensors of `config`: the biases unless qkv_bias,
// the gates unless shared_expert_gate. `import` takes such zeros back as the model without them
// (the doubling undone).
std::vector<GlobalTensor> qwen2_moe_zero_tensors(const ModelConfig& config);
inline constexpr float kQwen2SharedDownScale = 2.0f;
bool is_shared_down_proj(const std::string& name);  // the table's name of a shared down projection

struct SnapshotWeights {
  std::string path;  // the snapshot's index file
  Recipe recipe;     // the recipe stored in the snapshot (its model shape)
  int64_t step = 0;
  std::vector<GlobalTensor> tensors;  // llama_tensor_table order, filled

  const GlobalTensor& at(const std::string& name) const;  // InternalError if absent
};

// Reads every parameter of a snapshot whole, verifying shard files and chunk hashes on the way.
// UserError naming the file when it is missing, incomplete, damaged or not a snapshot.
SnapshotWeights load_snapshot_weights(const std::string& snapshot);

// config.json for transformers' class of hf_layout(config) describing `config`. `dtype`:
// "float32" or "bfloat16" (torch_dtype). `bos_id`, `eos_id`: the tokenizer's (a SentencePiece
// model's <s> = 1 and </s> = 2; a byte-level BPE's BOS when its template has one), -1 for none
// (null; the byte tokenizer has none).
std::string llama_config_json(const ModelConfig& config, const std::string& dtype = "float32",
                              int bos_id = -1, int eos_id = -1);

// tokenizer_config.json for the run's tokenizer: in the LlamaTokenizer form for a SentencePiece
// model trained by titan3d (no EOS added, legacy encoding, no prefix space), in the
// PreTrainedTokenizerFast form beside a tokenizer.json (its BOS token named when it has one);
// add_bos_token as the run read its text (data.bos) in both.
std::string tokenizer_config_json(const ModelConfig& config, const TextTokenizer& tokenizer,
                                  bool add_bos);

struct ExportOptions {
  std::string dtype = "fp32";  // fp32 | bf16 (the safetensors tensors)
  // > 0: the weights as shards of at most this many MiB of tensors each (a larger tensor alone in
  // its shard), model-0000i-of-0000N.safetensors in the model's tensor order, and
  // model.safetensors.index.json naming each tensor's file, as transformers' save_pretrained
  // writes them; 0: one model.safetensors.
  double max_shard_mb = 0;
};

struct ExportSummary {
  std::string safetensors, config;  // paths written (the weights: the file, or the shards' index)
  std::string tokenizer;            // tokenizer.model written ("" for the byte tokenizer)
  int64_t step = 0, tensors = 0, parameters = 0, shards = 1;
  uint64_t bytes = 0;  // of the safetensors file(s)
};

// Writes <out_dir>/model.safetensors (or its shards and their index) and <out_dir>/config.json
// (creating out_dir), and with a SentencePiece data.tokenizer its tokenizer.model and
// tokenizer_config.json beside them. All or nothing: when one fails (a full disk), those already
// written are removed again, and out_dir too when this call created it.
ExportSummary export_snapshot(const std::string& snapshot, const std::string& out_dir,
                              const ExportOptions& options = {});

}  // namespace t3d::runtime
