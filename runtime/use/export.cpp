#include "runtime/use/export.h"

#include <fmt/format.h>

#include <filesystem>
#include <fstream>

#include "checkpoint/paths.h"
#include "checkpoint/safetensors.h"
#include "checkpoint/snapshot.h"
#include "kernels/check.h"
#include "runtime/data/text_tokenizer.h"
#include "runtime/model/model_spec.h"
#include "runtime/provenance/provenance.h"

namespace t3d::runtime {

namespace fs = std::filesystem;
namespace ck = checkpoint;

std::vector<GlobalTensor> llama_tensor_table(const ModelConfig& m) {
  std::vector<GlobalTensor> t;
  for (ParamInfo& p : param_table(m))
    t.push_back({std::move(p.name), std::move(p.global_shape), {}});
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
                 t.data.data()});
  }
  // The tokenizer the weights were trained with: still the file the snapshot recorded.
  check_same_tokenizer(reader.info().counters, w.recipe, snapshot, "read");
  return w;
}

std::string llama_config_json(const ModelConfig& m, const std::string& dtype, bool special_ids) {
  // Keys as transformers' LlamaConfig names them. Weights are in Hugging Face's own layout
  // ([out, in], rotate-half RoPE on the q/k projections' outputs): no permutation is needed.
  // The byte tokenizer has no BOS/EOS (ids are bytes); SentencePiece's are <s> = 1, </s> = 2.
  return fmt::format(
      "{{\n"
      "  \"architectures\": [\"LlamaForCausalLM\"],\n"
      "  \"model_type\": \"llama\",\n"
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
      "  \"rope_scaling\": null,\n"
      "  \"hidden_act\": \"silu\",\n"
      "  \"attention_bias\": false,\n"
      "  \"attention_dropout\": 0.0,\n"
      "  \"mlp_bias\": false,\n"
      "  \"pretraining_tp\": 1,\n"
      "  \"tie_word_embeddings\": {},\n"
      "  \"initializer_range\": 0.02,\n"
      "  \"use_cache\": true,\n"
      "  \"bos_token_id\": {},\n"
      "  \"eos_token_id\": {},\n"
      "  \"torch_dtype\": \"{}\"\n"
      "}}\n",
      m.vocab_size, m.dim, m.ffn_dim, m.n_layers, m.n_heads, m.n_kv_heads, m.head_dim(), m.seq_len,
      m.norm_eps, m.rope_theta, m.tie_embeddings ? "true" : "false", special_ids ? "1" : "null",
      special_ids ? "2" : "null", dtype);
}

std::string llama_tokenizer_config_json(const ModelConfig& m, bool add_bos) {
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

ExportSummary export_snapshot(const std::string& snapshot, const std::string& out_dir,
                              const ExportOptions& options) {
  T3D_USER_CHECK(options.dtype == "fp32" || options.dtype == "bf16", "--dtype is `", options.dtype,
                 "`; give fp32 or bf16");
  const bool bf16 = options.dtype == "bf16";
  const SnapshotWeights w = load_snapshot_weights(snapshot);
  T3D_USER_CHECK(!w.recipe.model.moe(), "`", snapshot,
                 "` holds a mixture-of-experts model (model.n_experts = ", w.recipe.model.n_experts,
                 "): `export` writes dense LLaMA models only so far");
  const TextTokenizer tokenizer = TextTokenizer::open(w.recipe.data.tokenizer);
  std::error_code ec;
  const bool existed = fs::exists(out_dir);
  fs::create_directories(out_dir, ec);
  T3D_USER_CHECK(fs::is_directory(out_dir), "cannot create the export directory `", out_dir,
                 "` (--out): ", ec.message());
  ExportSummary s;
  s.step = w.step;
  s.safetensors = (fs::path(out_dir) / "model.safetensors").string();
  s.config = (fs::path(out_dir) / "config.json").string();
  std::vector<ck::TensorRef> refs;
  for (const auto& t : w.tensors) {
    refs.push_back({t.name, t.shape, t.data.data()});
    s.parameters += static_cast<int64_t>(t.data.size());
  }
  s.tensors = static_cast<int64_t>(refs.size());
  std::vector<std::string> written;  // removed again if a later file fails
  try {
    // "format": "pt" is what transformers expects of a PyTorch-style safetensors file.
    s.bytes = ck::write_safetensors(s.safetensors, refs,
                                    {{"format", "pt"},
                                     {"producer", "titan3d export"},
                                     {"snapshot", fs::path(snapshot).filename().string()},
                                     {"step", std::to_string(w.step)}},
                                    bf16 ? ck::StDtype::kBF16 : ck::StDtype::kF32);
    written.push_back(s.safetensors);
    const auto write = [&](const std::string& path, const std::string& text) {
      ck::write_file_atomically(path, text, "--out");
      written.push_back(path);
    };
    write(s.config,
          llama_config_json(w.recipe.model, bf16 ? "bfloat16" : "float32", !tokenizer.is_bytes()));
    if (!tokenizer.is_bytes()) {
      s.tokenizer = (fs::path(out_dir) / "tokenizer.model").string();
      write(s.tokenizer, tokenizer.model_bytes());
      write((fs::path(out_dir) / "tokenizer_config.json").string(),
            llama_tokenizer_config_json(w.recipe.model, w.recipe.data.bos));
    }
  } catch (...) {
    for (const auto& path : written) fs::remove(path, ec);
    if (!existed) fs::remove(out_dir, ec);  // only if empty
    throw;
  }
  return s;
}

}  // namespace t3d::runtime
