#include "runtime/use/import.h"

#include <fmt/format.h>
#include <fmt/ranges.h>

#include <algorithm>
#include <cmath>
#include <filesystem>
#include <map>
#include <memory>
#include <nlohmann/json.hpp>
#include <random>
#include <set>
#include <tuple>

#include "checkpoint/paths.h"
#include "checkpoint/safetensors.h"
#include "checkpoint/snapshot.h"
#include "kernels/check.h"
#include "runtime/data/data.h"
#include "runtime/data/text_tokenizer.h"
#include "runtime/provenance/provenance.h"
#include "runtime/use/export.h"
#include "runtime/use/hf_config_keys.h"
#include "runtime/use/hf_families.h"
#include "runtime/use/hf_rope.h"

namespace t3d::runtime {

namespace fs = std::filesystem;
namespace ck = checkpoint;
using nlohmann::json;

namespace {

// The recipe's own bounds and consistency checks on the shape, before anything is sized from it
// (2^31 layers would be a tensor table of 2^34 entries); the message names the config key too.
void check_model_limits(const ModelConfig& m, const std::string& src, HfLayout layout) {
  Recipe r;
  r.model = m;
  try {
    parse_recipe(r.to_toml(), src + " (the model it describes)");
  } catch (const UserError& e) {
    static const std::pair<const char*, const char*> keys[] = {
        {"model.vocab_size", "vocab_size"},
        {"model.dim", "hidden_size"},
        {"model.n_layers", "num_hidden_layers"},
        {"model.n_heads", "num_attention_heads"},
        {"model.n_kv_heads", "num_key_value_heads"},
        {"model.ffn_dim", "intermediate_size"},
        {"model.seq_len", "max_position_embeddings"},
        {"model.norm_eps", "rms_norm_eps"},
        {"model.rope_theta", "rope_theta"},
        {"model.head_dim", "head_dim"},
        {"model.rope_original_seq_len", "rope_scaling.original_max_position_embeddings"},
        {"model.n_experts", "num_local_experts"},
        {"model.experts_per_token", "num_experts_per_tok"},
        {"model.moe_ffn_dim", "intermediate_size"},
        {"model.dense_layers", "mlp_only_layers"},
        {"model.n_shared_experts", "shared_expert_intermediate_size"}};
    const bool qwen = layout == HfLayout::kQwen2Moe || layout == HfLayout::kQwen3Moe;
    std::string named;
    for (auto [recipe_key, config_key] : keys) {
      if (qwen && recipe_key == std::string("model.n_experts")) config_key = "num_experts";
      if (qwen && recipe_key == std::string("model.moe_ffn_dim"))
        config_key = "moe_intermediate_size";
      if (std::string(e.what()).find(recipe_key) != std::string::npos)
        named += fmt::format("{}`{}` sets {}", named.empty() ? " (config.json's " : ", ",
                             config_key, recipe_key);
    }
    throw UserError(e.what() + named + (named.empty() ? "" : ")"));
  }
}

// `head_dim` (transformers: hidden_size / num_attention_heads when absent or null; Qwen3's
// config classes: 128) as model.head_dim, left 0 (derived) when it is that quotient.
void head_dim_from_config(const json& c, const std::string& src, HfLayout layout, ModelConfig& m,
                          std::vector<std::string>* notes) {
  const bool absent = !c.contains("head_dim") || c.at("head_dim").is_null();
  if (absent && (layout == HfLayout::kQwen3 || layout == HfLayout::kQwen3Moe)) {
    notes->push_back("config.json has no `head_dim`: 128 (Qwen3's default)");
    m.explicit_head_dim = m.dim % m.n_heads == 0 && m.dim / m.n_heads == 128 ? 0 : 128;
    return;
  }
  if (absent) {
    T3D_USER_CHECK(m.dim % m.n_heads == 0, src, ": `hidden_size` ", m.dim,
                   " is not a multiple of `num_attention_heads` ", m.n_heads,
                   " and there is no `head_dim`; give the heads' width as `head_dim`");
    return;
  }
  T3D_USER_CHECK(c.at("head_dim").is_number_integer() && c.at("head_dim").get<int64_t>() > 0, src,
                 ": `head_dim` is ", c.at("head_dim").dump(), "; it must be a positive integer");
  const int64_t head_dim = c.at("head_dim").get<int64_t>();
  const bool derived = m.dim % m.n_heads == 0 && head_dim == m.dim / m.n_heads;
  m.explicit_head_dim = derived ? 0 : head_dim;
}

// The family config.json names (model_type, and architectures when given); UserError for a
// family titan3d does not import.
HfLayout check_architecture(const json& c, const std::string& src) {
  static const std::tuple<const char*, const char*, HfLayout> families[] = {
      {"llama", "LlamaForCausalLM", HfLayout::kLlama},
      {"mixtral", "MixtralForCausalLM", HfLayout::kMixtral},
      {"qwen2_moe", "Qwen2MoeForCausalLM", HfLayout::kQwen2Moe},
      {"qwen2", "Qwen2ForCausalLM", HfLayout::kQwen2},
      {"qwen3", "Qwen3ForCausalLM", HfLayout::kQwen3},
      {"qwen3_moe", "Qwen3MoeForCausalLM", HfLayout::kQwen3Moe},
      {"mistral", "MistralForCausalLM", HfLayout::kMistral}};
  const std::string type = c.contains("model_type") && c.at("model_type").is_string()
                               ? c.at("model_type").get<std::string>()
                               : "";
  for (const auto& [model_type, architecture, layout] : families) {
    if (type != model_type) continue;
    if (!c.contains("architectures")) return layout;
    const auto& a = c.at("architectures");
    T3D_USER_CHECK(a.is_array() && std::find(a.begin(), a.end(), architecture) != a.end(), src,
                   ": `architectures` is ", a.dump(), "; titan3d imports ", architecture,
                   " for this model_type");
    return layout;
  }
  throw UserError(fmt::format(
      "{}: `model_type` is {}; titan3d imports LLaMA models (model_type \"llama\"), Qwen2 and "
      "Qwen2.5 (\"qwen2\"), Qwen3 (\"qwen3\"), Mistral (\"mistral\") and the mixtures of "
      "experts of Mixtral "
      "(\"mixtral\"), Qwen2-MoE (\"qwen2_moe\") and Qwen3-MoE (\"qwen3_moe\")",
      src, c.contains("model_type") ? c.at("model_type").dump() : "absent"));
}

}  // namespace

ModelConfig llama_model_from_config(const std::string& text, const std::string& src,
                                    std::vector<std::string>* notes) {
  const json c = ck::parse_json_text(text, src);
  T3D_USER_CHECK(c.is_object(), src, " is not a JSON object");
  const HfLayout layout = check_architecture(c, src);
  refuse_unknown_config_keys(c, src, layout);
  const bool mixtral = layout == HfLayout::kMixtral;
  refuse_unless(c, src, "attention_bias", false, "titan3d's attention projections have no bias");
  refuse_unless(c, src, "mlp_bias", false, "titan3d's MLP projections have no bias");
  refuse_unless(c, src, "attention_dropout", 0, "titan3d's attention has no dropout");
  refuse_unless(c, src, "hidden_act", "silu", "titan3d's MLP is SwiGLU, silu only");
  ModelConfig m;
  m.vocab_size = required_int(c, src, "vocab_size");
  m.dim = required_int(c, src, "hidden_size");
  m.n_layers = required_int(c, src, "num_hidden_layers");
  m.n_heads = required_int(c, src, "num_attention_heads");
  T3D_USER_CHECK(m.n_heads > 0, src, ": `num_attention_heads` is ", m.n_heads,
                 "; it must be positive");
  head_dim_from_config(c, src, layout, m, notes);
  m.n_kv_heads = optional_value<int64_t>(c, src, "num_key_value_heads", m.n_heads,
                                         "num_attention_heads (no grouped-query attention)", notes);
  m.ffn_dim = required_int(c, src, "intermediate_size");
  m.seq_len = optional_value<int64_t>(c, src, "max_position_embeddings", 2048,
                                      "model.seq_len = 2048 (transformers' default)", notes);
  m.norm_eps = optional_value<double>(c, src, "rms_norm_eps", 1e-6,
                                      "model.norm_eps = 1e-6 (transformers' default)", notes);
  m.rope_theta = optional_value<double>(c, src, "rope_theta", 10000.0,
                                        "model.rope_theta = 10000 (transformers' default)", notes);
  m.tie_embeddings = optional_value<bool>(c, src, "tie_word_embeddings", false,
                                          "untied (transformers' default)", notes);
  rope_scaling_from_config(c, src, m);
  if (mixtral) {
    // Mixtral: every block a mixture of experts of intermediate_size each, softmax router over
    // normalised top-k gates (docs/moe.md).
    refuse_unless(c, src, "sliding_window", nullptr, "titan3d's attention is fully causal");
    m.n_experts = required_experts(c, src, "num_local_experts");
    m.experts_per_token = required_int(c, src, "num_experts_per_tok");
    m.moe_ffn_dim = m.ffn_dim;
    note_aux_loss_coef(c, notes);
    if (c.contains("router_jitter_noise") && c.at("router_jitter_noise") != 0 &&
        !c.at("router_jitter_noise").is_null())
      notes->push_back("`router_jitter_noise` " + c.at("router_jitter_noise").dump() +
                       " ignored: titan3d's router adds no noise");
  }
  if (layout == HfLayout::kQwen2Moe) qwen2_moe_keys(c, src, m, notes);
  if (layout == HfLayout::kQwen3) qwen3_keys(c, src, m);  // q/k norms always (Qwen3Attention)
  if (layout == HfLayout::kMistral)  // LLaMA's block, unless its attention has a window
    refuse_unless(c, src, "sliding_window", nullptr, "titan3d's attention is fully causal");
  if (layout == HfLayout::kQwen3Moe) qwen3_moe_keys(c, src, m, notes);
  if (layout == HfLayout::kQwen2) {  // Qwen2 / Qwen2.5: q/k/v biases always (Qwen2Attention)
    refuse_sliding_window(c, src);
    m.qkv_bias = true;
  }
  if (c.contains("pretraining_tp") && c.at("pretraining_tp") != 1)
    notes->push_back("`pretraining_tp` is " + c.at("pretraining_tp").dump() +
                     ": ignored (it slices the same products; the values do not change)");
  check_model_limits(m, src, layout);
  return m;
}

namespace {

// A file of the model directory by its fixed name; refused when a symlink leads outside it.
fs::path in_model_dir(const fs::path& dir, const std::string& name) {
  return ck::path_inside(dir.string(), name, "the model directory `" + dir.string() + "`");
}

// That file opened: its checks hold for the descriptor that is read (ReadOnlyFile::open_inside).
ck::ReadOnlyFile open_in_model_dir(const fs::path& dir, const std::string& name) {
  return ck::ReadOnlyFile::open_inside(dir.string(), name,
                                       "the model directory `" + dir.string() + "`");
}

// The weights' files: model.safetensors, or the shards model.safetensors.index.json names.
// Returns tensor name -> opened file.
std::map<std::string, std::shared_ptr<ck::SafetensorsFile>> open_weights(
    const fs::path& dir, std::vector<std::string>* files) {
  std::map<std::string, std::shared_ptr<ck::SafetensorsFile>> where;
  const fs::path index = in_model_dir(dir, "model.safetensors.index.json");
  std::vector<std::string> names;
  std::string source = "the model directory";
  // transformers reads model.safetensors where both are (from_pretrained); which one is current
  // only the user knows (export refuses to write one beside the other).
  T3D_USER_CHECK(!fs::exists(index) || !fs::exists(dir / "model.safetensors"), "`", dir.string(),
                 "` holds both model.safetensors and model.safetensors.index.json (the shards): "
                 "transformers would read model.safetensors, and one of the two is stale; remove "
                 "it and import again");
  if (fs::exists(index)) {
    json j;
    try {
      j = ck::parse_json_text(open_in_model_dir(dir, "model.safetensors.index.json").read_all(),
                              index.string());
      for (const auto& [tensor, file] : j.at("weight_map").items())
        names.push_back(file.get<std::string>());
    } catch (const json::exception& e) {
      throw UserError(fmt::format("{}: no usable `weight_map`: {}", index.string(), e.what()));
    }
    std::sort(names.begin(), names.end());
    names.erase(std::unique(names.begin(), names.end()), names.end());
    source = "`" + index.string() + "` (weight_map)";
  } else {
    T3D_USER_CHECK(fs::exists(dir / "model.safetensors"), "`", dir.string(),
                   "` has neither model.safetensors nor model.safetensors.index.json; give a "
                   "Hugging Face model directory (PyTorch .bin weights are not read)");
    names.push_back("model.safetensors");
  }
  for (const auto& name : names) {
    const auto file = std::make_shared<ck::SafetensorsFile>(
        ck::ReadOnlyFile::open_inside(dir.string(), name, source));
    files->push_back(file->path());
    for (const auto& [tensor, entry] : file->entries()) {
      T3D_USER_CHECK(!where.count(tensor), "tensor `", tensor, "` is in both `",
                     where[tensor]->path(), "` and `", file->path(), "`");
      where[tensor] = file;
    }
  }
  return where;
}

// Tensor `name` of `file` as fp32, refused unless it has the `shape` config.json implies.
std::vector<float> read_with_shape(const ck::SafetensorsFile& file, const std::string& name,
                                   const std::vector<int64_t>& shape) {
  const ck::StEntry& e = file.entries().at(name);
  T3D_USER_CHECK(e.shape == shape, "`", file.path(), "`: tensor `", name, "` has shape ",
                 json(e.shape).dump(), " but config.json implies ", json(shape).dump());
  return file.read_f32(name);
}

// Qwen2-MoE's q/k/v biases and shared-expert gates (export.h): model.qkv_bias when any bias is
// nonzero, model.shared_expert_gate when any gate is, and then imported as they are. All zero
// (what titan3d's export writes for a model without them), the model is imported without them:
// a zero bias adds nothing, and the zero gate's sigmoid(0) = 1/2 is folded into the shared
// experts' down projection, halved exactly (read_qwen2_moe_parts). The forward is the same; a
// fine-tune then trains no gate and no bias, where Hugging Face's would: the notes say so.
void qwen2_moe_options(ModelConfig& m,
                       const std::map<std::string, std::shared_ptr<ck::SafetensorsFile>>& where,
                       std::vector<std::string>& notes) {
  ModelConfig without = m;
  without.qkv_bias = without.shared_expert_gate = false;
  for (const GlobalTensor& t : qwen2_moe_zero_tensors(without)) {
    const auto it = where.find(t.name);
    if (it == where.end()) continue;  // a missing gate is refused by read_qwen2_moe_parts
    const std::vector<float> v = read_with_shape(*it->second, t.name, t.shape);
    if (std::all_of(v.begin(), v.end(), [](float x) { return x == 0.0f; })) continue;
    (t.name.ends_with("shared_expert_gate.weight") ? m.shared_expert_gate : m.qkv_bias) = true;
  }
  notes.push_back(
      m.shared_expert_gate
          ? "the shared experts' gates `mlp.shared_expert_gate.weight`: model.shared_expert_gate "
            "= true"
          : "every `mlp.shared_expert_gate.weight` is zero: imported without the gate "
            "(model.shared_expert_gate = false), its sigmoid(0) = 1/2 folded exactly into "
            "`mlp.shared_expert.down_proj`; a fine-tune trains no gate (Hugging Face's would)");
  notes.push_back(m.qkv_bias ? "q/k/v biases: model.qkv_bias = true"
                             : "every q/k/v bias is zero or absent: model.qkv_bias = false (a "
                               "fine-tune trains no bias)");
}

// The zero biases and gates of a Qwen2-MoE imported without them (qwen2_moe_options): checked
// zero, and the shared experts' down projection halved exactly where the gate is folded.
void read_qwen2_moe_parts(const ModelConfig& m,
                          const std::map<std::string, std::shared_ptr<ck::SafetensorsFile>>& where,
                          std::vector<GlobalTensor>& table, std::set<std::string>& known) {
  for (const GlobalTensor& zero : qwen2_moe_zero_tensors(m)) {
    const auto it = where.find(zero.name);
    const bool gate = zero.name.ends_with("shared_expert_gate.weight");
    T3D_USER_CHECK(it != where.end() || !gate, "no weight file holds tensor `", zero.name,
                   "`, the shared experts' gate, which config.json's Qwen2-MoE needs");
    if (it == where.end()) continue;  // a bias of a model without qkv_bias
    known.insert(zero.name);
    const std::vector<float> v = read_with_shape(*it->second, zero.name, zero.shape);
    const auto nonzero = std::find_if(v.begin(), v.end(), [](float x) { return x != 0.0f; });
    T3D_USER_CHECK(
        nonzero == v.end(), "`", it->second->path(), "`: tensor `", zero.name, "` holds ",
        nonzero == v.end() ? 0.0f : *nonzero, " at element ", nonzero - v.begin(),
        gate ? "; a model imported without the gate (model.shared_expert_gate = false) needs "
               "every gate zero"
             : "; a model imported without q/k/v biases (model.qkv_bias = false) needs every "
               "bias zero",
        ". This is a bug in the import (qwen2_moe_options chose so).");
  }
  for (GlobalTensor& t : table) {
    if (m.shared_expert_gate || !is_shared_down_proj(t.name)) continue;
    for (float& v : t.data) {
      const float halved = v / kQwen2SharedDownScale;
      T3D_USER_CHECK(halved * kQwen2SharedDownScale == v, "tensor `", hf_tensor_name(m, t.name),
                     "` holds ", v,
                     ", which halving (the shared expert gate's 1/2, titan3d's "
                     "shared experts are ungated) does not keep exactly");
      v = halved;
    }
  }
}

// Every tensor of the model, read and checked against the table's shape; unknown names refused.
// A Qwen2-MoE's biases and gates set m's options first (qwen2_moe_options).
std::vector<GlobalTensor> read_tensors(
    ModelConfig& m, const std::map<std::string, std::shared_ptr<ck::SafetensorsFile>>& where,
    ImportSummary& s) {
  if (hf_layout(m) == HfLayout::kQwen2Moe) qwen2_moe_options(m, where, s.notes);
  std::vector<GlobalTensor> table = llama_tensor_table(m);
  std::set<std::string> known;
  std::set<std::string> dtypes;
  for (auto& t : table) {
    const std::string hf = hf_tensor_name(m, t.name);  // the family's names for the experts
    known.insert(hf);
    const auto it = where.find(hf);
    if (it == where.end()) {
      std::set<std::string> files;
      for (const auto& [name, file] : where) files.insert(file->path());
      throw UserError(fmt::format(
          "no weight file ({}) holds tensor `{}`, which config.json's model needs{}: the "
          "weights are incomplete, or config.json is not theirs",
          fmt::join(files, ", "), hf,
          hf == "lm_head.weight" ? " (tie_word_embeddings is false)"
          : m.moe()              ? fmt::format(
                                       " ({} = {})",
                          hf_layout(m) == HfLayout::kMixtral ? "num_local_experts" : "num_experts",
                                       m.n_experts)
                    : ""));
    }
    t.data = read_with_shape(*it->second, hf, t.shape);
    // A weight that is NaN or infinite makes every loss NaN: refused, not trained from.
    const auto bad =
        std::find_if(t.data.begin(), t.data.end(), [](float v) { return !std::isfinite(v); });
    T3D_USER_CHECK(bad == t.data.end(), "`", it->second->path(), "`: tensor `", hf, "` holds ",
                   *bad, " at element ", bad - t.data.begin(),
                   " (flat index); a model with non-finite weights cannot be trained or used. "
                   "Import a sound copy of the weights.");
    dtypes.insert(it->second->entries().at(hf).dtype);
    s.parameters += static_cast<int64_t>(t.data.size());
  }
  if (hf_layout(m) == HfLayout::kQwen2Moe) read_qwen2_moe_parts(m, where, table, known);
  for (const auto& [name, file] : where) {
    if (known.count(name)) continue;
    // Buffers some checkpoints carry: recomputed by titan3d (RoPE) or the tied embedding again.
    const bool harmless =
        name.ends_with("rotary_emb.inv_freq") || (m.tie_embeddings && name == "lm_head.weight");
    if (harmless) {
      s.notes.push_back("ignored tensor `" + name + "` (" +
                        (m.tie_embeddings ? "tied to the embedding" : "RoPE buffer") + ")");
      continue;
    }
    throw UserError(
        fmt::format("`{}`: tensor `{}` has no place in titan3d's model (biases, "
                    "extra norms or heads are not represented); refusing to drop it",
                    file->path(), name));
  }
  s.dtypes.assign(dtypes.begin(), dtypes.end());
  s.tensors = static_cast<int64_t>(table.size());
  return table;
}

// The directory's tokenizer, when titan3d can read text through it: tokenizer.model
// (SentencePiece), else tokenizer.json (byte-level BPE), copied beside the snapshot and named by
// data.tokenizer. A tokenizer.model titan3d cannot use (no byte fallback, or not SentencePiece:
// Llama 3's tiktoken file) gives way to a tokenizer.json beside it, as transformers'
// AutoTokenizer reads that one first; "bytes" when neither is there; a tokenizer.json titan3d
// cannot read is an error naming it.
std::string import_tokenizer(const fs::path& hf, const fs::path& out, ImportSummary& s) {
  std::string passed_over;  // why tokenizer.model was not used
  for (const char* name : {"tokenizer.model", "tokenizer.json"}) {
    const fs::path src = in_model_dir(hf, name);
    if (!fs::is_regular_file(src)) continue;
    int64_t ids = 0;
    std::string model;
    try {
      const TextTokenizer tok =
          TextTokenizer::load(open_in_model_dir(hf, name).read_all(), src.string(), name);
      ids = tok.vocab_size();
      model = tok.model_bytes();
    } catch (const UserError& e) {
      if (std::string(name) == "tokenizer.model") {
        passed_over = e.what();
        continue;
      }
      if (passed_over.empty()) throw;  // what it cannot encode exactly is refused
      throw UserError(std::string(e.what()) + " (tokenizer.model, read first, is not usable " +
                      "either: " + passed_over +
                      "; remove both to import with the byte tokenizer)");
    }
    if (!passed_over.empty())
      s.notes.push_back("tokenizer.model not used (" + passed_over +
                        "): tokenizer.json read instead, as transformers' AutoTokenizer does");
    // A usable tokenizer the model cannot read through is an error, not a silent fallback.
    T3D_USER_CHECK(ids <= s.recipe.model.vocab_size, "`", src.string(), "` has ", ids,
                   " ids but config.json's `vocab_size` is ", s.recipe.model.vocab_size,
                   ": the model has no embedding rows for the others. Give the model's own "
                   "tokenizer, or remove ",
                   name, " to import with the byte tokenizer.");
    const fs::path dst = out / name;
    ck::write_file_atomically(dst.string(), model, "--out");
    return dst.string();
  }
  s.notes.push_back(passed_over.empty()
                        ? "no tokenizer.model or tokenizer.json: data.tokenizer = \"bytes\""
                        : "tokenizer.model not used, data.tokenizer = \"bytes\": " + passed_over);
  return kByteTokenizerName;
}

// data.bos of the import: tokenizer_config.json's `add_bos_token`, else true (transformers'
// LlamaTokenizer adds BOS by default) when the tokenizer has a BOS id; false with the byte one.
bool import_bos(const fs::path& hf, const std::string& tokenizer, ImportSummary& s) {
  if (tokenizer == kByteTokenizerName) return false;
  if (TextTokenizer::open(tokenizer, "the imported tokenizer").bos_id() < 0) {
    s.notes.push_back(fs::path(tokenizer).filename().string() + " has no BOS id: data.bos = false");
    return false;
  }
  const fs::path config = in_model_dir(hf, "tokenizer_config.json");
  if (!fs::is_regular_file(config)) {
    s.notes.push_back(
        "no tokenizer_config.json: data.bos = true (LlamaTokenizer's default add_bos_token)");
    return true;
  }
  const json c = ck::parse_json_text(open_in_model_dir(hf, "tokenizer_config.json").read_all(),
                                     config.string());
  T3D_USER_CHECK(c.is_object(), config.string(),
                 " is not a JSON object; fix or remove it (without it, data.bos = true)");
  if (!c.contains("add_bos_token") || c.at("add_bos_token").is_null()) {
    s.notes.push_back(
        "tokenizer_config.json has no `add_bos_token`: data.bos = true (LlamaTokenizer's "
        "default)");
    return true;
  }
  T3D_USER_CHECK(c.at("add_bos_token").is_boolean(), config.string(), ": `add_bos_token` is ",
                 c.at("add_bos_token").dump(), "; it must be true or false");
  return c.at("add_bos_token").get<bool>();
}

// The snapshot: one shard with the weights and zero moments, and its index at step 0.
void write_snapshot(const std::string& dir, const Recipe& r, std::vector<GlobalTensor>& tensors) {
  std::vector<std::vector<float>> zeros;
  std::vector<ck::Slice> slices;
  for (auto& t : tensors) {
    const std::vector<int64_t> origin(t.shape.size(), 0);
    slices.push_back({"model/" + t.name, t.shape, origin, t.shape, t.data.data()});
    zeros.emplace_back(t.data.size(), 0.0f);
  }
  for (const char* moment : {"optim/exp_avg/", "optim/exp_avg_sq/"})
    for (size_t i = 0; i < tensors.size(); ++i)
      slices.push_back({moment + tensors[i].name, tensors[i].shape,
                        std::vector<int64_t>(tensors[i].shape.size(), 0), tensors[i].shape,
                        zeros[i].data()});
  const std::string shard = ck::shard_path(dir, 0, 0);
  fs::create_directories(fs::path(shard).parent_path());
  const ck::ShardResult res = ck::write_shard(shard, 0, slices);
  ck::publish(shard);
  ck::IndexInfo info;
  info.step = 0;
  info.id = (uint64_t{std::random_device{}()} << 32) ^ std::random_device{}();
  info.recipe = r.to_toml();
  info.layout = "import";
  info.counters = {
      {"step", 0}, {"adamw_step", 0}, {"sampler_seed", r.train.seed}, {"sampler_step", 0}};
  if (const int64_t h = tokenizer_hash(r); h != 0) info.counters[kTokenizerHashCounter] = h;
  info.shards.push_back(
      {fs::path(shard).lexically_relative(dir).string(), res.digest.bytes, res.digest.hash});
  ck::write_index(dir, info);
}

}  // namespace

ImportSummary import_hf(const std::string& hf_dir, const std::string& out) {
  // --out names the snapshot directory, or its index file DIR/step_00000000.h5 (step 0).
  std::string out_dir = out;
  if (fs::path(out).extension() == ".h5") {
    T3D_USER_CHECK(fs::path(out).filename() == ck::snapshot_name(0) + ".h5", "--out `", out,
                   "`: an imported snapshot's index is DIR/", ck::snapshot_name(0),
                   ".h5 (step 0); give that path or the directory DIR");
    out_dir = fs::path(out).parent_path().string();
    if (out_dir.empty()) out_dir = ".";
  }
  const fs::path hf(hf_dir);
  T3D_USER_CHECK(fs::is_directory(hf), "`", hf_dir,
                 "` is not a directory; give a Hugging Face "
                 "model directory (config.json and safetensors weights)");
  const fs::path config = in_model_dir(hf, "config.json");
  ImportSummary s;
  s.recipe.model = llama_model_from_config(open_in_model_dir(hf, "config.json").read_all(),
                                           config.string(), &s.notes);
  const bool existed = fs::exists(out_dir);
  T3D_USER_CHECK(!existed || ck::committed_steps(out_dir).empty(), "`", out_dir,
                 "` (--out) already holds snapshots; give an empty or new directory");
  auto tensors = read_tensors(s.recipe.model, open_weights(hf, &s.files), s);
  s.recipe.run.name =
      hf.filename().empty() ? hf.parent_path().filename().string() : hf.filename().string();
  std::error_code ec;
  fs::create_directories(out_dir, ec);
  T3D_USER_CHECK(fs::is_directory(out_dir), "cannot create `", out_dir,
                 "` (--out): ", ec.message());
  try {
    s.recipe.data.tokenizer = s.tokenizer = import_tokenizer(hf, out_dir, s);
    s.recipe.data.bos = import_bos(hf, s.tokenizer, s);
    // A fine-tune of the import keeps what it trains unless told otherwise (every run with
    // snapshot.every > 0 also snapshots its last step).
    s.recipe.snapshot.every = kImportSnapshotEvery;
    // Through the parser: the same validation (and derived values) as any recipe.
    s.recipe = parse_recipe(s.recipe.to_toml(), config.string() + " (imported recipe)");
    write_snapshot(out_dir, s.recipe, tensors);
  } catch (...) {
    // Nothing partial stays: the step-0 shard directory and the tokenizer copy are this
    // import's (the directory held no snapshot), and so is the directory if it was created.
    // write_index removes its own temporary when it fails.
    fs::remove_all(fs::path(out_dir) / ck::snapshot_name(0), ec);
    if (s.tokenizer != kByteTokenizerName && !s.tokenizer.empty()) fs::remove(s.tokenizer, ec);
    if (!existed) fs::remove(out_dir, ec);  // only if empty
    throw;
  }
  s.snapshot = ck::index_path(out_dir, 0);
  return s;
}

}  // namespace t3d::runtime
