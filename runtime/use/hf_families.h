// Reading config.json for `titan3d import` (import.cpp): the checks every family's keys share,
// and the keys of the families past LLaMA's own (the Qwen mixtures of experts, Qwen3's attention).
// Each either sets the recipe's [model] key it maps to or is refused naming `src` and the key.
#pragma once

#include <fmt/format.h>

#include <cstdint>
#include <nlohmann/json.hpp>
#include <string>
#include <type_traits>
#include <vector>

#include "kernels/check.h"
#include "runtime/recipe/recipe.h"

namespace t3d::runtime {

// A config value that must be absent, null or `allowed` (false for the biases): titan3d has no
// place for anything else.
void refuse_unless(const nlohmann::json& c, const std::string& src, const char* key,
                   const nlohmann::json& allowed, const char* why);
// An integer the config must give.
int64_t required_int(const nlohmann::json& c, const std::string& src, const char* key);
// A mixture's expert count (Mixtral's num_local_experts, the Qwen MoEs' num_experts): at least 1.
int64_t required_experts(const nlohmann::json& c, const std::string& src, const char* key);
// `router_aux_loss_coef`, when given, said in `notes` as not taken (titan3d's is per sequence).
void note_aux_loss_coef(const nlohmann::json& c, std::vector<std::string>* notes);

// A value the config may leave out: transformers' LlamaConfig default then, said in `notes`.
// Present, it must have T's JSON type (an integer, any number, a boolean).
template <typename T>
T optional_value(const nlohmann::json& c, const std::string& src, const char* key, T fallback,
                 const std::string& what, std::vector<std::string>* notes) {
  if (c.contains(key) && !c.at(key).is_null()) {
    const nlohmann::json& v = c.at(key);
    const bool typed = std::is_same_v<T, bool> ? v.is_boolean()
                       : std::is_integral_v<T> ? v.is_number_integer()
                                               : v.is_number();
    T3D_USER_CHECK(typed, src, ": `", key, "` is ", v.dump(), "; it must be ",
                   std::is_same_v<T, bool> ? "true or false"
                   : std::is_integral_v<T> ? "an integer"
                                           : "a number");
    return v.get<T>();
  }
  notes->push_back(fmt::format("config.json has no `{}`: {}", key, what));
  return fallback;
}

// transformers' Qwen2-MoE and Qwen3-MoE make block l dense when l is in `mlp_only_layers` or
// (l + 1) % `decoder_sparse_step` != 0 (both optional: [] and 1). titan3d's dense blocks are the
// leading model.dense_layers: returns their count, or refuses naming the key that puts a dense
// block after a mixture of experts, or leaves no mixture at all.
int64_t leading_dense_layers(const nlohmann::json& c, const std::string& src, int64_t n_layers);

// The Qwen families' sliding window, refused: `use_sliding_window` true, or `layer_types` (newer
// transformers' per-block attention kinds) other than all "full_attention".
void refuse_sliding_window(const nlohmann::json& c, const std::string& src);
// Qwen2-MoE (Qwen2MoeConfig): experts, shared experts a whole number of experts wide, dense blocks,
// norm_topk_prob (default false), the sliding window refused.
void qwen2_moe_keys(const nlohmann::json& c, const std::string& src, ModelConfig& m,
                    std::vector<std::string>* notes);
// Qwen3 (Qwen3Config) and Qwen3-MoE: per-head q/k norms always (model.qk_norm); the sliding
// window refused (refuse_sliding_window).
void qwen3_keys(const nlohmann::json& c, const std::string& src, ModelConfig& m);
// Qwen3-MoE (Qwen3MoeConfig): no shared expert, softmax router, norm_topk_prob (default false),
// dense blocks as leading_dense_layers says; then qwen3_keys.
void qwen3_moe_keys(const nlohmann::json& c, const std::string& src, ModelConfig& m,
                    std::vector<std::string>* notes);

}  // namespace t3d::runtime
