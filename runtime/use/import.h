// `titan3d import`: a Hugging Face LLaMA-style directory into a titan3d snapshot at step 0, from
// which `titan3d resume` (with any --set of training, parallel, data or snapshot keys) fine-tunes
// on any layout. The inverse of `titan3d export`.
//
// Read: config.json (model_type llama, LlamaForCausalLM, Llama 3.x's included: `rope_scaling` of
// rope_type linear or llama3 and `head_dim` as the [model] keys, hf_rope.h; model_type qwen2,
// Qwen2ForCausalLM, with model.qkv_bias and no sliding window; a mixture of experts
// as Mixtral or as Qwen2-MoE in the form export writes it, export.h), the weights from
// model.safetensors or the shards model.safetensors.index.json names (F32, BF16 or F16, widened
// to fp32 exactly), tied or untied embeddings, grouped-query attention; tokenizer.model or
// tokenizer.json when present and usable becomes data.tokenizer, copied beside the snapshot.
// What titan3d cannot represent is refused with a UserError naming the config key (another
// rope_type or a key of rope_scaling it does not read, attention_bias, mlp_bias, hidden_act other
// than silu, partial_rotary_factor other than 1, another model_type or architecture) or the
// tensor (a name titan3d has no place for, a wrong shape).
//
// Written with the snapshot writer (checkpoint/snapshot.h) as one shard from rank 0: the weights
// under model/, zero AdamW moments, counters at step 0, and a recipe from the config, the keys the
// config does not give filled from defaults (each named in the summary).
#pragma once

#include <cstdint>
#include <string>
#include <vector>

#include "runtime/recipe/recipe.h"

namespace t3d::runtime {

// snapshot.every of an import's recipe: a fine-tune (`resume` of the import) snapshots every this
// many steps and at its last step, so it never ends with nothing saved.
inline constexpr int64_t kImportSnapshotEvery = 100;

struct ImportSummary {
  std::string snapshot;   // the index file written: <out_dir>/step_00000000.h5
  std::string tokenizer;  // data.tokenizer of the recipe ("bytes" when none was imported)
  Recipe recipe;
  std::vector<std::string> notes;  // what came from defaults, what was ignored, and why
  int64_t tensors = 0, parameters = 0;
  std::vector<std::string> files;   // safetensors files read
  std::vector<std::string> dtypes;  // their tensors' dtypes, once each
};

// The model shape config.json describes, with `notes` on keys filled from defaults. UserError
// naming the key for what titan3d cannot represent.
ModelConfig llama_model_from_config(const std::string& config_json_text, const std::string& source,
                                    std::vector<std::string>* notes);

// Reads `hf_dir` and writes a snapshot into the directory `out` (created; refused when it already
// holds snapshots), or, when `out` ends in .h5, at that path, which must then be
// DIR/step_00000000.h5. UserError naming the file, key or tensor at fault.
ImportSummary import_hf(const std::string& hf_dir, const std::string& out);

}  // namespace t3d::runtime
