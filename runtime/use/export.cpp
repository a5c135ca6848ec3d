#include "runtime/use/export.h"

#include <fmt/format.h>
#include <fmt/ranges.h>

#include <filesystem>
#include <fstream>
#include <nlohmann/json.hpp>

#include "checkpoint/paths.h"
#include "checkpoint/safetensors.h"
#include "checkpoint/snapshot.h"
#include "kernels/check.h"
#include "runtime/data/text_tokenizer.h"
#include "runtime/model/model_spec.h"
#include "runtime/provenance/provenance.h"
#include "runtime/use/hf_rope.h"

namespace t3d::runtime {

namespace fs = std::filesystem;
namespace ck = checkpoint;

std::vector<GlobalTensor> llama_tensor_table(const ModelConfig& m) {
  std::vector<GlobalTensor> t;
  for (ParamInfo& p : param_table(m))
    t.push_back({std::move(p.name), std::move(p.global_shape), {}});
  return t;
}

HfLayout hf_layout(const ModelConfig& m) {
  if (!m.moe())
    return m.qk_norm ? HfLayout::kQwen3 : m.qkv_bias ? HfLayout::kQwen2 : HfLayout::kLlama;
  if (m.qk_norm) return HfLayout::kQwen3Moe;
  return m.n_shared_experts > 0 || m.dense_layers > 0 ? HfLayout::kQwen2Moe : HfLayout::kMixtral;
}

namespace {

std::string swapped(std::string s, const std::string& from, const std::string& to) {
  const size_t at = s.find(from);
  if (at != std::string::npos) s.replace(at, from.size(), to);
  return s;
}

// 0, 1, ..., n - 1: the leading dense blocks as mlp_only_layers.
std::vector<int64_t> leading(int64_t n) {
  std::vector<int64_t> v(static_cast<size_t>(n));
  for (int64_t l = 0; l < n; ++l) v[static_cast<size_t>(l)] = l;
  return v;
}

const char* family_name(HfLayout layout) {
  return layout == HfLayout::kMixtral    ? "Mixtral's layout"
         : layout == HfLayout::kQwen3Moe ? "Qwen3-MoE's layout"
                                         : "Qwen2-MoE's layout";
}

}  // namespace

std::string hf_tensor_name(const ModelConfig& m, const std::string& name) {
  switch (hf_layout(m)) {
    case HfLayout::kLlama:
    case HfLayout::kQwen2:
    case HfLayout::kQwen3:
    case HfLayout::kMistral:
      return name;
    case HfLayout::kQwen3Moe:  // its experts are named as titan3d's, with no shared ones
      return swapped(name, ".mlp.router.weight", ".mlp.gate.weight");
    case HfLayout::kQwen2Moe:
      if (name.ends_with(".mlp.router.weight"))
        return swapped(name, ".mlp.router.weight", ".mlp.gate.weight");
      return swapped(name, ".mlp.shared_experts.", ".mlp.shared_expert.");
    case HfLayout::kMixtral:
      break;
  }
  if (name.ends_with(".mlp.router.weight"))
    return swapped(name, ".mlp.router.weight", ".block_sparse_moe.gate.weight");
  if (name.find(".mlp.experts.") == std::string::npos) return name;
  const std::string s = swapped(name, ".mlp.experts.", ".block_sparse_moe.experts.");
  for (const auto& [from, to] : {std::pair<std::string, std::string>{".gate_proj.", ".w1."},
                                 {".down_proj.", ".w2."},
                                 {".up_proj.", ".w3."}})
    if (s.find(from) != std::string::npos) return swapped(s, from, to);
  return s;
}

void check_hf_layout(const ModelConfig& m, const std::string& what) {
  // A dense model's biases go out as Qwen2's, a mixture's as Qwen2-MoE's (LLaMA's, Mixtral's and
  // Qwen3-MoE's attention_bias would bias o_proj too).
  T3D_USER_CHECK(!m.qkv_bias || !m.moe() || hf_layout(m) == HfLayout::kQwen2Moe, what,
                 ": model.qkv_bias = true in a mixture of experts without shared experts or "
                 "dense blocks; Qwen2-MoE (the one family with q/k/v biases and experts) always "
                 "has a shared expert, and Mixtral's and Qwen3-MoE's attention_bias would bias "
                 "o_proj too");
  T3D_USER_CHECK(!m.qkv_bias || !m.qk_norm, what,
                 ": model.qkv_bias = true with model.qk_norm; Qwen3's attention_bias (the family "
                 "of q/k norms) would bias o_proj too, so titan3d does not export the pair");
  const HfLayout layout = hf_layout(m);
  if (layout == HfLayout::kLlama || layout == HfLayout::kQwen2 || layout == HfLayout::kQwen3)
    return;
  const auto refuse = [&](bool bad, const char* key, const std::string& why,
                          const std::string& instead = "") {
    T3D_USER_CHECK(!bad, what, ": ", key, " = ", why, "; ", family_name(layout),
                   " (the one Hugging Face family titan3d exports such a mixture of experts as) "
                   "has no place for it",
                   instead);
  };
  // Qwen2-MoE always has a shared expert: a model with dense blocks but none has no family.
  refuse(layout == HfLayout::kQwen3Moe && m.n_shared_experts > 0, "model.n_shared_experts",
         std::to_string(m.n_shared_experts));
  refuse(layout != HfLayout::kQwen3Moe && m.n_shared_experts == 0 && m.dense_layers > 0,
         "model.dense_layers", std::to_string(m.dense_layers) + " without shared experts",
         " (Mixtral's has no dense blocks either)");
  refuse(m.router_score != kernels::RouterScore::kSoftmax, "model.router_score", "\"sigmoid\"");
  refuse(layout == HfLayout::kMixtral && !m.router_norm_topk, "model.router_norm_topk", "false");
  refuse(m.router_scale != 1.0, "model.router_scale", fmt::format("{}", m.router_scale));
  refuse(m.router_bias_rate > 0, "model.router_bias_rate",
         fmt::format("{} (a selection bias)", m.router_bias_rate));
}

bool is_shared_down_proj(const std::string& name) {
  return name.ends_with(".mlp.shared_experts.down_proj.weight");
}

std::vector<GlobalTensor> qwen2_moe_zero_tensors(const ModelConfig& m) {
  std::vector<GlobalTensor> t;
  const auto zeros = [&](std::string name, std::vector<int64_t> shape) {
    int64_t n = 1;
    for (const int64_t d : shape) n *= d;
    t.push_back({std::move(name), std::move(shape), std::vector<float>(static_cast<size_t>(n))});
  };
  const int64_t D = m.head_dim();
  for (int64_t l = 0; l < m.n_layers; ++l) {
    const std::string p = "model.layers." + std::to_string(l) + ".";
    if (!m.qkv_bias) {
      zeros(p + "self_attn.q_proj.bias", {m.n_heads * D});
      zeros(p + "self_attn.k_proj.bias", {m.n_kv_heads * D});
      zeros(p + "self_attn.v_proj.bias", {m.n_kv_heads * D});
    }
    if (m.moe_block(l) && !m.shared_expert_gate)
      zeros(p + "mlp.shared_expert_gate.weight", {1, m.dim});
  }
  return t;
}

const GlobalTensor& SnapshotWeights::at(const std::string& name) const {
  for (const auto& t : tensors)
    if (t.name == name) return t;
  throw InternalError(detail::concat("no tensor `", name, "` in the weights of ", path));
}

SnapshotWeights load_snapshot_weights(const std::string& snapshot) {
  SnapshotWeights w;
  w.path = snapshot;
  ck::SnapshotReader reader(snapshot);
  w.recipe = parse_recipe(reader.info().recipe, snapshot + " (recipe)");
  w.step = reader.info().step;
  w.tensors = llama_tensor_table(w.recipe.model);
  for (auto& t : w.tensors) {
    int64_t n = 1;
    for (const int64_t d : t.shape) n *= d;
    t.data.assign(static_cast<size_t>(n), 0.0f);
    // The whole tensor as one box: the reader gathers it from the writers' pieces.
    reader.read({"model/" + t.name, t.shape, std::vector<int64_t>(t.shape.size(), 0), t.shape,
                 t.data.data()},
                kernels::kCpu);  // a host copy of the model, for the file
  }
  // The tokenizer the weights were trained with: still the file the snapshot recorded.
  check_same_tokenizer(reader.info().counters, w.recipe, snapshot, "read");
  return w;
}

std::string llama_config_json(const ModelConfig& m, const std::string& dtype, int bos_id,
                              int eos_id) {
  // Keys as transformers' config classes name them. Weights are in Hugging Face's own layout
  // ([out, in], rotate-half RoPE on the q/k projections' outputs): no permutation is needed.
  const HfLayout layout = hf_layout(m);
  std::string family;  // the keys of the mixture of experts' family
  if (layout == HfLayout::kMixtral)
    // titan3d's auxiliary loss is per sequence (docs/moe.md), not Mixtral's.
    family = fmt::format(
        ",\n  \"num_local_experts\": {},\n  \"num_experts_per_tok\": {},\n"
        "  \"router_aux_loss_coef\": {},\n  \"output_router_logits\": false,\n"
        "  \"router_jitter_noise\": 0.0,\n  \"sliding_window\": null",
        m.n_experts, m.experts_per_token, m.router_aux_coef);
  if (layout == HfLayout::kQwen2Moe) {
    family = fmt::format(
        ",\n  \"num_experts\": {},\n  \"num_experts_per_tok\": {},\n"
        "  \"moe_intermediate_size\": {},\n  \"shared_expert_intermediate_size\": {},\n"
        "  \"norm_topk_prob\": {},\n  \"decoder_sparse_step\": 1,\n  \"mlp_only_layers\": [{}],\n"
        "  \"qkv_bias\": true,\n  \"router_aux_loss_coef\": {},\n"
        "  \"output_router_logits\": false,\n  \"use_sliding_window\": false,\n"
        "  \"sliding_window\": null,\n  \"max_window_layers\": {}",
        m.n_experts, m.experts_per_token, m.moe_ffn_dim, m.shared_ffn_dim(),
        m.router_norm_topk ? "true" : "false", fmt::join(leading(m.dense_layers), ", "),
        m.router_aux_coef, m.n_layers);
  }
  // Qwen2: q/k/v biases always (transformers' Qwen2Attention), no sliding window; Qwen3 (q/k
  // norms always) likewise, and Qwen3-MoE's experts (no shared expert) before them.
  if (layout == HfLayout::kQwen3Moe)
    family = fmt::format(
        ",\n  \"num_experts\": {},\n  \"num_experts_per_tok\": {},\n"
        "  \"moe_intermediate_size\": {},\n  \"norm_topk_prob\": {},\n"
        "  \"decoder_sparse_step\": 1,\n  \"mlp_only_layers\": [{}],\n"
        "  \"router_aux_loss_coef\": {},\n  \"output_router_logits\": false",
        m.n_experts, m.experts_per_token, m.moe_ffn_dim, m.router_norm_topk ? "true" : "false",
        fmt::join(leading(m.dense_layers), ", "), m.router_aux_coef);
  if (layout == HfLayout::kQwen2 || layout == HfLayout::kQwen3 || layout == HfLayout::kQwen3Moe)
    family += fmt::format(
        ",\n  \"use_sliding_window\": false,\n  \"sliding_window\": null,\n"
        "  \"max_window_layers\": {}",
        m.n_layers);
  static const char* const kNames[][2] = {
      {"LlamaForCausalLM", "llama"},        {"MixtralForCausalLM", "mixtral"},
      {"Qwen2MoeForCausalLM", "qwen2_moe"}, {"Qwen2ForCausalLM", "qwen2"},
      {"Qwen3ForCausalLM", "qwen3"},        {"Qwen3MoeForCausalLM", "qwen3_moe"},
      {"MistralForCausalLM", "mistral"}};  // not chosen by hf_layout: exported as LLaMA
  const char* architecture = kNames[static_cast<int>(layout)][0];
  const char* model_type = kNames[static_cast<int>(layout)][1];
  const bool llama_keys = layout == HfLayout::kLlama || layout == HfLayout::kMixtral;
  // Qwen3's attention_bias (false: titan3d's Qwen3 has none) would bias q, k, v and o.
  const bool attention_bias_key =
      llama_keys || layout == HfLayout::kQwen3 || layout == HfLayout::kQwen3Moe;
  // Mixtral's intermediate_size is an expert's; Qwen2-MoE's the dense blocks' MLP.
  const int64_t intermediate = layout == HfLayout::kMixtral ? m.moe_ffn_dim : m.ffn_dim;
  return fmt::format(
      "{{\n"
      "  \"architectures\": [\"{}\"],\n"
      "  \"model_type\": \"{}\",\n"
      "  \"vocab_size\": {},\n"
      "  \"hidden_size\": {},\n"
      "  \"intermediate_size\": {},\n"
      "  \"num_hidden_layers\": {},\n"
      "  \"num_attention_heads\": {},\n"
      "  \"num_key_value_heads\": {},\n"
      "  \"head_dim\": {},\n"
      "  \"max_position_embeddings\": {},\n"
      "  \"rms_norm_eps\": {},\n"
      "  \"rope_theta\": {},\n"
      "  \"rope_scaling\": {},\n"
      "  \"hidden_act\": \"silu\",\n{}"
      "  \"attention_dropout\": 0.0,\n{}"
      "  \"tie_word_embeddings\": {},\n"
      "  \"initializer_range\": 0.02,\n"
      "  \"use_cache\": true,\n"
      "  \"bos_token_id\": {},\n"
      "  \"eos_token_id\": {},\n"
      "  \"torch_dtype\": \"{}\"{}\n"
      "}}\n",
      architecture, model_type, m.vocab_size, m.dim, intermediate, m.n_layers, m.n_heads,
      m.n_kv_heads, m.head_dim(), m.seq_len, m.norm_eps, m.rope_theta, rope_scaling_json(m),
      // LlamaConfig's keys (Mixtral's loaders ignore them); Qwen2's q/k/v have biases.
      attention_bias_key ? "  \"attention_bias\": false,\n" : "",
      llama_keys ? "  \"mlp_bias\": false,\n  \"pretraining_tp\": 1,\n" : "",
      m.tie_embeddings ? "true" : "false", bos_id >= 0 ? std::to_string(bos_id) : "null",
      eos_id >= 0 ? std::to_string(eos_id) : "null", dtype, family);
}

std::string tokenizer_config_json(const ModelConfig& m, const TextTokenizer& tokenizer,
                                  bool add_bos) {
  if (tokenizer.is_byte_level_bpe()) {
    const int bos = tokenizer.bos_id();
    const std::string bos_token =
        bos >= 0 ? nlohmann::json(tokenizer.decode(std::vector<int32_t>{bos})).dump() : "null";
    return fmt::format(
        "{{\n"
        "  \"tokenizer_class\": \"PreTrainedTokenizerFast\",\n"
        "  \"bos_token\": {},\n"
        "  \"eos_token\": null,\n"
        "  \"add_bos_token\": {},\n"
        "  \"clean_up_tokenization_spaces\": false,\n"
        "  \"model_max_length\": {}\n"
        "}}\n",
        bos_token, add_bos ? "true" : "false", m.seq_len);
  }
  return fmt::format(
      "{{\n"
      "  \"tokenizer_class\": \"LlamaTokenizer\",\n"
      "  \"bos_token\": \"<s>\",\n"
      "  \"eos_token\": \"</s>\",\n"
      "  \"unk_token\": \"<unk>\",\n"
      "  \"pad_token\": null,\n"
      "  \"add_bos_token\": {},\n"
      "  \"add_eos_token\": false,\n"
      "  \"legacy\": true,\n"
      "  \"clean_up_tokenization_spaces\": false,\n"
      "  \"model_max_length\": {},\n"
      "  \"sp_model_kwargs\": {{}}\n"
      "}}\n",
      add_bos ? "true" : "false", m.seq_len);
}

namespace {

// The weights as one file, or in shards of at most max_shard_mb MiB of tensors and their index.
// Each path written is appended to `written` as soon as it exists.
uint64_t write_weights(const std::vector<ck::TensorRef>& refs, const std::string& out_dir,
                       const ExportOptions& options,
                       const std::map<std::string, std::string>& metadata, ExportSummary& s,
                       std::vector<std::string>& written) {
  const bool bf16 = options.dtype == "bf16";
  const ck::StDtype dtype = bf16 ? ck::StDtype::kBF16 : ck::StDtype::kF32;
  if (options.max_shard_mb == 0) {
    s.safetensors = (fs::path(out_dir) / "model.safetensors").string();
    const uint64_t bytes = ck::write_safetensors(s.safetensors, refs, metadata, dtype);
    written.push_back(s.safetensors);
    return bytes;
  }
  const auto limit = static_cast<uint64_t>(options.max_shard_mb * 1024 * 1024);
  std::vector<std::vector<ck::TensorRef>> shards;
  uint64_t in_last = 0, total = 0;
  for (const auto& t : refs) {
    uint64_t bytes = bf16 ? 2 : 4;
    for (const int64_t d : t.shape) bytes *= static_cast<uint64_t>(d);
    if (shards.empty() || (in_last > 0 && in_last + bytes > limit))
      shards.emplace_back(), in_last = 0;
    shards.back().push_back(t);
    in_last += bytes, total += bytes;
  }
  nlohmann::json index = {{"metadata", {{"total_size", total}}},
                          {"weight_map", nlohmann::json::object()}};
  uint64_t file_bytes = 0;
  for (size_t i = 0; i < shards.size(); ++i) {
    const std::string name =
        fmt::format("model-{:05d}-of-{:05d}.safetensors", i + 1, shards.size());
    const std::string path = (fs::path(out_dir) / name).string();
    file_bytes += ck::write_safetensors(path, shards[i], metadata, dtype);
    written.push_back(path);
    for (const auto& t : shards[i]) index["weight_map"][t.name] = name;
  }
  s.safetensors = (fs::path(out_dir) / "model.safetensors.index.json").string();
  ck::write_file_atomically(s.safetensors, index.dump(2) + "\n", "--out");
  written.push_back(s.safetensors);
  s.shards = static_cast<int64_t>(shards.size());
  return file_bytes;
}

}  // namespace

ExportSummary export_snapshot(const std::string& snapshot, const std::string& out_dir,
                              const ExportOptions& options) {
  T3D_USER_CHECK(options.dtype == "fp32" || options.dtype == "bf16", "--dtype is `", options.dtype,
                 "`; give fp32 or bf16");
  T3D_USER_CHECK(options.max_shard_mb >= 0 && options.max_shard_mb <= 1e9, "--max-shard-mb is ",
                 options.max_shard_mb, "; give a size in MiB (0: one model.safetensors)");
  const bool bf16 = options.dtype == "bf16";
  SnapshotWeights w = load_snapshot_weights(snapshot);
  const ModelConfig& m = w.recipe.model;
  check_hf_layout(m, "`" + snapshot + "`");
  const TextTokenizer tokenizer = TextTokenizer::open(w.recipe.data.tokenizer);
  // The weights' other form from an earlier export would be read instead of this one's.
  const char* other =
      options.max_shard_mb > 0 ? "model.safetensors" : "model.safetensors.index.json";
  T3D_USER_CHECK(!fs::exists(fs::path(out_dir) / other), "`", out_dir, "` (--out) already holds ",
                 other,
                 " of another export, which loaders would read instead of the weights this "
                 "export writes; remove it or give another directory");
  std::error_code ec;
  const bool existed = fs::exists(out_dir);
  fs::create_directories(out_dir, ec);
  T3D_USER_CHECK(fs::is_directory(out_dir), "cannot create the export directory `", out_dir,
                 "` (--out): ", ec.message());
  ExportSummary s;
  s.step = w.step;
  s.config = (fs::path(out_dir) / "config.json").string();
  for (const auto& t : w.tensors) s.parameters += static_cast<int64_t>(t.data.size());
  // Hugging Face's names and values, in place (no second copy of the model in host memory),
  // and the parts of its family titan3d's model has not.
  std::vector<GlobalTensor> extra;
  if (hf_layout(m) == HfLayout::kQwen2Moe) {
    for (auto& t : w.tensors)  // the missing gate's 1/2 (a gate of its own: as it is)
      if (!m.shared_expert_gate && is_shared_down_proj(t.name))
        for (float& v : t.data) v *= kQwen2SharedDownScale;
    extra = qwen2_moe_zero_tensors(m);
  }
  for (auto& t : w.tensors) t.name = hf_tensor_name(m, t.name);
  std::vector<ck::TensorRef> refs;
  for (const auto* group : {&w.tensors, &extra})
    for (const auto& t : *group) refs.push_back({t.name, t.shape, t.data.data()});
  s.tensors = static_cast<int64_t>(refs.size());
  std::vector<std::string> written;  // removed again if a later file fails
  try {
    // "format": "pt" is what transformers expects of a PyTorch-style safetensors file.
    s.bytes = write_weights(refs, out_dir, options,
                            {{"format", "pt"},
                             {"producer", "titan3d export"},
                             {"snapshot", fs::path(snapshot).filename().string()},
                             {"step", std::to_string(w.step)}},
                            s, written);
    const auto write = [&](const std::string& path, const std::string& text) {
      ck::write_file_atomically(path, text, "--out");
      written.push_back(path);
    };
    write(s.config, llama_config_json(w.recipe.model, bf16 ? "bfloat16" : "float32",
                                      tokenizer.bos_id(), tokenizer.eos_id()));
    if (!tokenizer.is_bytes()) {
      s.tokenizer = (fs::path(out_dir) / tokenizer.file_name()).string();
      write(s.tokenizer, tokenizer.model_bytes());
      write((fs::path(out_dir) / "tokenizer_config.json").string(),
            tokenizer_config_json(w.recipe.model, tokenizer, w.recipe.data.bos));
    }
  } catch (...) {
    for (const auto& path : written) fs::remove(path, ec);
    if (!existed) fs::remove(out_dir, ec);  // only if empty
    throw;
  }
  return s;
}

}  // namespace t3d::runtime
