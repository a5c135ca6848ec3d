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

// A tensor's name in the Hugging Face model `export` writes and `import` reads: the table's own
// name, except in a mixture of experts, which is Mixtral's (MixtralForCausalLM): the router
// `mlp.router.weight` is `block_sparse_moe.gate.weight`, expert e's gate, down and up
// projections `block_sparse_moe.experts.<e>.w1 / w2 / w3.weight`.
std::string hf_tensor_name(const ModelConfig& config, const std::string& name);
// UserError unless Mixtral's layout can hold the mixture of experts `config` (the key that
// prevents it named): softmax router over normalised top-k gates, no shared experts, no dense
// blocks, no selection bias, no gate scale. `what` names the model in the message.
void check_mixtral_layout(const ModelConfig& config, const std::string& what);

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

// config.json for transformers' LlamaForCausalLM (MixtralForCausalLM for a mixture of experts)
// describing `config`. `dtype`: "float32" or
// "bfloat16" (torch_dtype). `special_ids`: a SentencePiece tokenizer's <s> = 1 and </s> = 2 are
// named as bos / eos; the byte tokenizer has none (null).
std::string llama_config_json(const ModelConfig& config, const std::string& dtype = "float32",
                              bool special_ids = false);

// tokenizer_config.json in the LlamaTokenizer form for a SentencePiece model trained by titan3d:
// add_bos_token as the run read its text (data.bos), no EOS added, legacy encoding, no prefix
// space.
std::string llama_tokenizer_config_json(const ModelConfig& config, bool add_bos);

struct ExportOptions {
  std::string dtype = "fp32";  // fp32 | bf16 (the safetensors tensors)
};

struct ExportSummary {
  std::string safetensors, config;  // paths written
  std::string tokenizer;            // tokenizer.model written ("" for the byte tokenizer)
  int64_t step = 0, tensors = 0, parameters = 0;
  uint64_t bytes = 0;  // of model.safetensors
};

// Writes <out_dir>/model.safetensors and <out_dir>/config.json (creating out_dir), and with a
// SentencePiece data.tokenizer its tokenizer.model and tokenizer_config.json beside them. All or
// nothing: when one fails (a full disk), those already written are removed again, and out_dir
// too when this call created it.
ExportSummary export_snapshot(const std::string& snapshot, const std::string& out_dir,
                              const ExportOptions& options = {});

}  // namespace t3d::runtime
