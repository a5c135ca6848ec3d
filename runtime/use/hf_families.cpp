#include "runtime/use/hf_families.h"

#include <algorithm>

namespace t3d::runtime {

using nlohmann::json;

// A config value that must be absent, null or `allowed` (false for the biases): titan3d has no
// place for anything else.
void refuse_unless(const json& c, const std::string& src, const char* key, const json& allowed,
                   const char* why) {
  if (!c.contains(key) || c.at(key).is_null() || c.at(key) == allowed) return;
  throw UserError(
      fmt::format("{}: `{}` is {}; titan3d cannot represent it ({}). Import a "
                  "model without it, or convert the model first.",
                  src, key, c.at(key).dump(), why));
}

// An integer the config must give.
int64_t required_int(const json& c, const std::string& src, const char* key) {
  T3D_USER_CHECK(c.contains(key) && c.at(key).is_number_integer(), src, ": `", key,
                 "` is missing or not an integer; a LLaMA config.json gives it");
  return c.at(key).get<int64_t>();
}

// A mixture's expert count (Mixtral's num_local_experts, Qwen2-MoE's num_experts): at least 1, as
// titan3d's n_experts = 0 is a dense model, whose tensors a mixture's checkpoint has not.
int64_t required_experts(const json& c, const std::string& src, const char* key) {
  const int64_t n = required_int(c, src, key);
  T3D_USER_CHECK(n > 0, src, ": `", key, "` is ", n,
                 "; a mixture of experts needs at least one expert (a dense model is "
                 "model_type \"llama\")");
  return n;
}

// Mixtral's and the Qwen MoEs' auxiliary loss is over the batch, titan3d's per sequence: not taken.
void note_aux_loss_coef(const json& c, std::vector<std::string>* notes) {
  if (c.contains("router_aux_loss_coef") && !c.at("router_aux_loss_coef").is_null())
    notes->push_back("`router_aux_loss_coef` " + c.at("router_aux_loss_coef").dump() +
                     " not taken: titan3d's auxiliary loss is per sequence (docs/moe.md); set "
                     "model.router_aux_coef to fine-tune with one");
}

// Qwen2-MoE's keys (transformers' Qwen2MoeConfig) as titan3d's block: its dense blocks the
// leading ones (leading_dense_layers), shared experts a whole number of experts
// wide (titan3d's shared width is n_shared_experts · moe_ffn_dim).
void qwen2_moe_keys(const json& c, const std::string& src, ModelConfig& m,
                    std::vector<std::string>* notes) {
  refuse_sliding_window(c, src);
  m.n_experts = required_experts(c, src, "num_experts");
  m.experts_per_token = required_int(c, src, "num_experts_per_tok");
  m.moe_ffn_dim = required_int(c, src, "moe_intermediate_size");
  const int64_t shared = required_int(c, src, "shared_expert_intermediate_size");
  T3D_USER_CHECK(
      m.moe_ffn_dim > 0 && shared > 0 && shared % m.moe_ffn_dim == 0, src,
      ": `shared_expert_intermediate_size` is ", shared,
      "; titan3d's shared experts are a whole number (at least 1) of experts wide, so it "
      "must be a multiple of `moe_intermediate_size` (",
      m.moe_ffn_dim, ")");
  m.n_shared_experts = shared / m.moe_ffn_dim;
  // transformers' Qwen2MoeConfig leaves the gates unnormalised unless told.
  m.router_norm_topk =
      optional_value<bool>(c, src, "norm_topk_prob", false,
                           "model.router_norm_topk = false (Qwen2-MoE's default)", notes);
  m.dense_layers = leading_dense_layers(c, src, m.n_layers);
  note_aux_loss_coef(c, notes);
}

int64_t leading_dense_layers(const json& c, const std::string& src, int64_t n_layers) {
  // Far beyond the recipe's bounds (2^14 layers): check_model_limits refuses `num_hidden_layers`
  // itself, without a table of them here.
  if (n_layers < 1 || n_layers > (int64_t{1} << 20)) return 0;
  int64_t step = 1;
  if (c.contains("decoder_sparse_step") && !c.at("decoder_sparse_step").is_null()) {
    step = required_int(c, src, "decoder_sparse_step");
    T3D_USER_CHECK(step >= 1, src, ": `decoder_sparse_step` is ", step, "; it must be at least 1");
  }
  std::vector<bool> listed(static_cast<size_t>(n_layers), false);
  if (c.contains("mlp_only_layers") && !c.at("mlp_only_layers").is_null()) {
    const json& dense = c.at("mlp_only_layers");
    T3D_USER_CHECK(dense.is_array(), src, ": `mlp_only_layers` is ", dense.dump(),
                   "; it must be a list of layer indices");
    for (const json& l : dense) {
      T3D_USER_CHECK(l.is_number_integer() && l.get<int64_t>() >= 0 && l.get<int64_t>() < n_layers,
                     src, ": `mlp_only_layers` holds ", l.dump(), "; give layer indices below ",
                     "`num_hidden_layers` (", n_layers, ")");
      listed[static_cast<size_t>(l.get<int64_t>())] = true;
    }
  }
  const auto dense = [&](int64_t l) {
    return listed[static_cast<size_t>(l)] || (l + 1) % step != 0;
  };
  int64_t leading = 0;
  while (leading < n_layers && dense(leading)) ++leading;
  T3D_USER_CHECK(leading < n_layers, src, ": `mlp_only_layers` and `decoder_sparse_step` (", step,
                 ") leave no mixture-of-experts block; import such a model as a dense one");
  for (int64_t l = leading; l < n_layers; ++l) {
    if (!dense(l)) continue;
    const char* key = listed[static_cast<size_t>(l)] ? "mlp_only_layers" : "decoder_sparse_step";
    throw UserError(fmt::format(
        "{}: `{}` makes block {} dense after a mixture-of-experts block; titan3d's dense blocks "
        "are the leading ones (model.dense_layers): mlp_only_layers [0, 1, ..., k-1] or [] with "
        "decoder_sparse_step 1 (or blocks that give the same leading set)",
        src, key, l));
  }
  return leading;
}

void refuse_sliding_window(const json& c, const std::string& src) {
  refuse_unless(c, src, "use_sliding_window", false, "titan3d's attention is fully causal");
  if (c.contains("layer_types") && !c.at("layer_types").is_null()) {
    const json& kinds = c.at("layer_types");
    const bool full =
        kinds.is_array() && std::all_of(kinds.begin(), kinds.end(),
                                        [](const json& k) { return k == "full_attention"; });
    T3D_USER_CHECK(full, src, ": `layer_types` is ", kinds.dump().substr(0, 200),
                   "; titan3d's attention is fully causal in every block (\"full_attention\")");
  }
}

void qwen3_keys(const json& c, const std::string& src, ModelConfig& m) {
  refuse_sliding_window(c, src);
  m.qk_norm = true;
}

void qwen3_moe_keys(const json& c, const std::string& src, ModelConfig& m,
                    std::vector<std::string>* notes) {
  m.n_experts = required_experts(c, src, "num_experts");
  m.experts_per_token = required_int(c, src, "num_experts_per_tok");
  m.moe_ffn_dim = required_int(c, src, "moe_intermediate_size");
  m.n_shared_experts = 0;  // Qwen3MoeSparseMoeBlock has none
  m.router_norm_topk =
      optional_value<bool>(c, src, "norm_topk_prob", false,
                           "model.router_norm_topk = false (Qwen3-MoE's default)", notes);
  m.dense_layers = leading_dense_layers(c, src, m.n_layers);
  note_aux_loss_coef(c, notes);
  qwen3_keys(c, src, m);
}

}  // namespace t3d::runtime
