#include "runtime/provenance/provenance.h"

#include <fmt/format.h>
#include <spdlog/spdlog.h>

#include <filesystem>

#include "checkpoint/hash.h"
#include "checkpoint/snapshot.h"
#include "kernels/check.h"
#include "runtime/data/data.h"
#include "runtime/data/text_tokenizer.h"

namespace t3d::runtime {

namespace fs = std::filesystem;
namespace ck = checkpoint;

void check_same_model(const std::string& saved_toml, const Recipe& now, const std::string& path,
                      const std::string& verb) {
  const Recipe saved = parse_recipe(saved_toml, path + " (recipe)");
  const auto& a = saved.model;
  const auto& b = now.model;
  const std::pair<const char*, std::pair<int64_t, int64_t>> keys[] = {
      {"vocab_size", {a.vocab_size, b.vocab_size}},
      {"dim", {a.dim, b.dim}},
      {"n_layers", {a.n_layers, b.n_layers}},
      {"n_heads", {a.n_heads, b.n_heads}},
      {"n_kv_heads", {a.n_kv_heads, b.n_kv_heads}},
      {"head_dim", {a.head_dim(), b.head_dim()}},  // an explicit one equal to dim / n_heads is it
      {"ffn_dim", {a.ffn_dim, b.ffn_dim}},
      {"tie_embeddings", {a.tie_embeddings, b.tie_embeddings}},
      {"qkv_bias", {a.qkv_bias, b.qkv_bias}},
      {"qk_norm", {a.qk_norm, b.qk_norm}},
      {"n_experts", {a.n_experts, b.n_experts}},
      // The experts' shapes mean something only in a mixture of experts (n_experts equal above).
      {"n_shared_experts", {a.moe() ? a.n_shared_experts : 0, b.moe() ? b.n_shared_experts : 0}},
      {"shared_expert_gate", {a.moe() && a.shared_expert_gate, b.moe() && b.shared_expert_gate}},
      {"moe_ffn_dim", {a.moe() ? a.moe_ffn_dim : 0, b.moe() ? b.moe_ffn_dim : 0}},
      {"dense_layers", {a.moe() ? a.dense_layers : 0, b.moe() ? b.dense_layers : 0}}};
  for (const auto& [key, v] : keys)
    T3D_USER_CHECK(
        v.first == v.second, "cannot ", verb, " `", path, "`: model.", key, " is ", v.first,
        " in the snapshot but ", v.second, " in this run (",
        now.origin(std::string("model.") + key),
        "). A snapshot holds one model: only training, parallel, data and snapshot keys may "
        "change, not its [model] shape.");
}

std::vector<std::string> changed_model_function(const std::string& saved_toml, const Recipe& now,
                                                const std::string& path) {
  const Recipe saved = parse_recipe(saved_toml, path + " (recipe)");
  const auto& a = saved.model;
  const auto& b = now.model;
  const auto score = [](kernels::RouterScore s) {
    return s == kernels::RouterScore::kSoftmax ? "\"softmax\"" : "\"sigmoid\"";
  };
  std::vector<std::pair<std::string, std::pair<std::string, std::string>>> keys = {
      {"rope_theta", {fmt::format("{}", a.rope_theta), fmt::format("{}", b.rope_theta)}},
      {"rope_scaling",
       {fmt::format("\"{}\"", choice_name(a.rope_scaling)),
        fmt::format("\"{}\"", choice_name(b.rope_scaling))}},
      {"rope_factor", {fmt::format("{}", a.rope_factor), fmt::format("{}", b.rope_factor)}},
      {"rope_low_freq_factor",
       {fmt::format("{}", a.rope_low_freq_factor), fmt::format("{}", b.rope_low_freq_factor)}},
      {"rope_high_freq_factor",
       {fmt::format("{}", a.rope_high_freq_factor), fmt::format("{}", b.rope_high_freq_factor)}},
      {"rope_original_seq_len",
       {std::to_string(a.rope_original_seq_len), std::to_string(b.rope_original_seq_len)}},
      {"norm_eps", {fmt::format("{}", a.norm_eps), fmt::format("{}", b.norm_eps)}}};
  if (a.moe() && b.moe())
    keys.insert(
        keys.end(),
        {{"experts_per_token",
          {std::to_string(a.experts_per_token), std::to_string(b.experts_per_token)}},
         {"router_score", {score(a.router_score), score(b.router_score)}},
         {"router_norm_topk",
          {a.router_norm_topk ? "true" : "false", b.router_norm_topk ? "true" : "false"}},
         {"router_scale", {fmt::format("{}", a.router_scale), fmt::format("{}", b.router_scale)}},
         {"capacity_factor",
          {fmt::format("{}", a.capacity_factor), fmt::format("{}", b.capacity_factor)}}});
  // The learned selection bias: set aside at 0 (not restored), moved at another rate from the next
  // step. From 0 there is no bias to continue and the restore refuses the missing tensor.
  if (a.moe() && b.moe() && a.router_bias_rate > 0)
    keys.push_back(
        {"router_bias_rate",
         {fmt::format("{}", a.router_bias_rate), fmt::format("{}", b.router_bias_rate)}});
  std::vector<std::string> changed;
  for (const auto& [key, v] : keys)
    if (v.first != v.second)
      changed.push_back(fmt::format("model.{}: {} in the snapshot, {} in this run ({})", key,
                                    v.first, v.second, now.origin("model." + key)));
  return changed;
}

int64_t tokenizer_hash(const Recipe& recipe) {
  if (recipe.data.tokenizer == kByteTokenizerName) return 0;
  T3D_USER_CHECK(fs::is_regular_file(recipe.data.tokenizer), "`data.tokenizer`: model file `",
                 recipe.data.tokenizer, "` does not exist (relative paths start at ",
                 fs::current_path().string(), ")");
  return static_cast<int64_t>(ck::digest_file(recipe.data.tokenizer).hash);
}

void check_same_tokenizer(const std::map<std::string, int64_t>& counters, const Recipe& now,
                          const std::string& path, const std::string& verb) {
  const auto it = counters.find(kTokenizerHashCounter);
  const int64_t saved = it == counters.end() ? 0 : it->second;
  const bool bytes_now = now.data.tokenizer == kByteTokenizerName;
  T3D_USER_CHECK((saved == 0) == bytes_now, "cannot ", verb, " `", path, "`: it was made with ",
                 saved == 0 ? "the byte tokenizer" : "a SentencePiece tokenizer",
                 " but data.tokenizer is `", now.data.tokenizer, "` (",
                 now.origin("data.tokenizer"),
                 "); give the snapshot's own tokenizer (--set data.tokenizer=...)");
  if (bytes_now) return;
  const int64_t hash = tokenizer_hash(now);
  T3D_USER_CHECK(hash == saved, "cannot ", verb, " `", path, "`: tokenizer model `",
                 now.data.tokenizer, "` has content hash ", ck::to_hex(static_cast<uint64_t>(hash)),
                 " but the snapshot was made with one of hash ",
                 ck::to_hex(static_cast<uint64_t>(saved)),
                 ": the file changed or is another tokenizer. Restore the model file the run "
                 "trained with, or point data.tokenizer at it (--set data.tokenizer=PATH).");
}

int64_t data_hash(const Recipe& recipe) {
  std::error_code ec;
  if (fs::is_regular_file(recipe.data.path, ec))
    return static_cast<int64_t>(ck::digest_file(recipe.data.path).hash);
  // A pattern of shards: the hash of their hashes, in data_files' order.
  std::vector<uint64_t> hashes;
  try {
    for (const std::string& file : data_files(recipe.data.path, "data.path")) {
      if (!fs::is_regular_file(file, ec)) return 0;
      hashes.push_back(ck::digest_file(file).hash);
    }
  } catch (const UserError&) {
    return 0;  // nothing matches: nothing to record
  }
  return static_cast<int64_t>(ck::hash64(hashes.data(), hashes.size() * sizeof(uint64_t)));
}

void warn_if_data_changed(const std::map<std::string, int64_t>& counters,
                          const std::string& saved_toml, const Recipe& now,
                          const std::string& path) {
  const auto it = counters.find(kDataHashCounter);
  if (it == counters.end()) return;
  const std::string saved_path = parse_recipe(saved_toml, path + " (recipe)").data.path;
  if (saved_path != now.data.path) return;  // other data on purpose (--set data.path)
  const int64_t hash = data_hash(now);
  if (hash == it->second) return;
  spdlog::warn(
      "data.path `{}` changed since {} was written (content hash {} then, {} now): the "
      "continuation trains on other tokens than the run that wrote it would have",
      now.data.path, path, ck::to_hex(static_cast<uint64_t>(it->second)),
      ck::to_hex(static_cast<uint64_t>(hash)));
}

Recipe load_resume_recipe(const std::string& snapshot, const std::vector<Override>& overrides) {
  // Before any I/O thread exists (the launcher, or a rank before its trainer): HDF5 is still
  // touched by one thread at a time.
  // Written again first: a recipe stored with its derived values resolved (run.dir,
  // snapshot.dir, virtual_stages) derives them anew from the overrides.
  const std::string text =
      parse_recipe(ck::read_recipe(snapshot), snapshot + " (recipe)").to_toml();
  auto all = overrides;
  all.push_back({"snapshot.resume", toml_string(snapshot)});  // any path, quoted and escaped
  return parse_recipe(text, snapshot + " (recipe)", all);
}

}  // namespace t3d::runtime
