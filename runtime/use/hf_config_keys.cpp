#include "runtime/use/hf_config_keys.h"

#include <fmt/format.h>

#include <set>

#include "kernels/check.h"

namespace t3d::runtime {

namespace {

// Keys that leave the model's function alone: the file's provenance, dtype and inference
// settings, and the special token ids (the tokenizer files say which tokens those are).
const std::set<std::string>& without_effect() {
  static const std::set<std::string> keys = {
      "_name_or_path",     "transformers_version", "torch_dtype",  "dtype",       "use_cache",
      "initializer_range", "bos_token_id",         "eos_token_id", "pad_token_id"};
  return keys;
}

// What llama_model_from_config reads or checks for every family (import.cpp, hf_rope.cpp).
const std::set<std::string>& common_keys() {
  static const std::set<std::string> keys = {"model_type",          "architectures",
                                             "vocab_size",          "hidden_size",
                                             "num_hidden_layers",   "num_attention_heads",
                                             "num_key_value_heads", "head_dim",
                                             "intermediate_size",   "max_position_embeddings",
                                             "rms_norm_eps",        "rope_theta",
                                             "rope_scaling",        "partial_rotary_factor",
                                             "tie_word_embeddings", "hidden_act",
                                             "attention_bias",      "mlp_bias",
                                             "attention_dropout",   "pretraining_tp"};
  return keys;
}

// A family's own keys: its mixture of experts, and the settings its export writes that change
// nothing here (router logits returned, a sliding window's layers while there is none; Qwen2-MoE's
// q/k/v biases are read as tensors whatever qkv_bias says).
const std::set<std::string>& family_keys(HfLayout layout) {
  static const std::set<std::string> none;
  static const std::set<std::string> mixtral = {"num_local_experts",    "num_experts_per_tok",
                                                "router_aux_loss_coef", "router_jitter_noise",
                                                "output_router_logits", "sliding_window"};
  static const std::set<std::string> qwen2_moe = {
      "num_experts",           "num_experts_per_tok",
      "moe_intermediate_size", "shared_expert_intermediate_size",
      "norm_topk_prob",        "decoder_sparse_step",
      "mlp_only_layers",       "router_aux_loss_coef",
      "output_router_logits",  "use_sliding_window",
      "sliding_window",        "max_window_layers",
      "layer_types",           "qkv_bias"};
  // Qwen2: the sliding window's settings, used only with use_sliding_window (refused), and the
  // blocks' attention kinds (newer transformers; refused unless all full attention).
  static const std::set<std::string> qwen2 = {"use_sliding_window", "sliding_window",
                                              "max_window_layers", "layer_types"};
  // Mistral: its sliding window (must be null: refused otherwise).
  static const std::set<std::string> mistral = {"sliding_window"};
  // Qwen3: those and the blocks' attention kinds (refused unless all full attention).
  static const std::set<std::string> qwen3 = {"use_sliding_window", "sliding_window",
                                              "max_window_layers", "layer_types"};
  // Qwen3-MoE: Qwen3's and its mixture of experts (no shared expert).
  static const std::set<std::string> qwen3_moe = {
      "use_sliding_window",    "sliding_window",       "max_window_layers",
      "layer_types",           "num_experts",          "num_experts_per_tok",
      "moe_intermediate_size", "norm_topk_prob",       "decoder_sparse_step",
      "mlp_only_layers",       "router_aux_loss_coef", "output_router_logits"};
  switch (layout) {
    case HfLayout::kMixtral:
      return mixtral;
    case HfLayout::kQwen2Moe:
      return qwen2_moe;
    case HfLayout::kQwen2:
      return qwen2;
    case HfLayout::kQwen3:
      return qwen3;
    case HfLayout::kQwen3Moe:
      return qwen3_moe;
    case HfLayout::kMistral:
      return mistral;
    case HfLayout::kLlama:
      break;
  }
  return none;
}

}  // namespace

void refuse_unknown_config_keys(const nlohmann::json& c, const std::string& src, HfLayout layout) {
  for (const auto& [key, value] : c.items()) {
    if (common_keys().count(key) || family_keys(layout).count(key) || without_effect().count(key))
      continue;
    throw UserError(fmt::format(
        "{}: `{}` is {}; titan3d's import does not know this key of a {} config, so it cannot "
        "say whether the model it imports would compute what the checkpoint's does. If the key "
        "changes nothing the model computes, remove it from config.json and import again; "
        "otherwise the model cannot be imported (docs/tokenizers-and-import.md, \"Families\").",
        src, key, value.dump().substr(0, 200), c.value("model_type", std::string("?"))));
  }
}

}  // namespace t3d::runtime
