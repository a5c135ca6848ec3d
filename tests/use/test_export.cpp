// `titan3d export`: a snapshot written as tp-sharded pieces comes back out of model.safetensors
// whole and bit for bit, read by a JSON parser of this test's own (not the writer's code), and
// config.json describes the model in transformers' LlamaForCausalLM terms.
#include <gtest/gtest.h>

#include <cstring>
#include <filesystem>
#include <fstream>
#include <map>
#include <memory>
#include <random>
#include <sstream>
#include <variant>

#include "checkpoint/snapshot.h"
#include "kernels/check.h"
#include "runtime/use/export.h"

namespace t3d::runtime {
namespace {

namespace fs = std::filesystem;
namespace ck = checkpoint;

// ---- a small JSON reader, just enough for safetensors headers and config.json -----------------

struct Json {
  std::variant<std::nullptr_t, bool, double, std::string, std::vector<Json>,
               std::map<std::string, Json>>
      v;
  const Json& operator[](const std::string& key) const {
    return std::get<std::map<std::string, Json>>(v).at(key);
  }
  const std::map<std::string, Json>& object() const {
    return std::get<std::map<std::string, Json>>(v);
  }
  const std::vector<Json>& array() const { return std::get<std::vector<Json>>(v); }
  double number() const { return std::get<double>(v); }
  const std::string& str() const { return std::get<std::string>(v); }
};

class JsonParser {
 public:
  explicit JsonParser(std::string text) : s_(std::move(text)) {}
  Json parse() {
    Json j = value();
    ws();
    if (i_ != s_.size()) throw std::runtime_error("trailing bytes after JSON");
    return j;
  }

 private:
  void ws() {
    while (i_ < s_.size() && std::isspace(static_cast<unsigned char>(s_[i_]))) ++i_;
  }
  void expect(char c) {
    ws();
    if (i_ >= s_.size() || s_[i_] != c) throw std::runtime_error(std::string("expected ") + c);
    ++i_;
  }
  std::string string() {
    expect('"');
    std::string out;
    while (s_.at(i_) != '"') {
      if (s_[i_] == '\\') {
        ++i_;
        if (s_.at(i_) == 'u') {  // \u00XX only: what a writer of ASCII names needs
          out += static_cast<char>(std::stoi(s_.substr(i_ + 1, 4), nullptr, 16));
          i_ += 5;
          continue;
        }
      }
      out += s_[i_++];
    }
    ++i_;
    return out;
  }
  Json value() {
    ws();
    const char c = s_.at(i_);
    if (c == '{') {
      ++i_;
      std::map<std::string, Json> m;
      ws();
      if (s_.at(i_) == '}') return ++i_, Json{m};
      for (;;) {
        std::string key = string();
        expect(':');
        if (!m.emplace(key, value()).second) throw std::runtime_error("duplicate key " + key);
        ws();
        if (s_.at(i_++) == '}') return Json{m};
      }
    }
    if (c == '[') {
      ++i_;
      std::vector<Json> a;
      ws();
      if (s_.at(i_) == ']') return ++i_, Json{a};
      for (;;) {
        a.push_back(value());
        ws();
        if (s_.at(i_++) == ']') return Json{a};
      }
    }
    if (c == '"') return Json{string()};
    for (const auto& [word, j] : {std::pair<const char*, Json>{"null", Json{nullptr}},
                                  {"true", Json{true}},
                                  {"false", Json{false}}})
      if (s_.compare(i_, std::strlen(word), word) == 0) return i_ += std::strlen(word), j;
    size_t used = 0;
    const double d = std::stod(s_.substr(i_), &used);
    i_ += used;
    return Json{d};
  }
  std::string s_;
  size_t i_ = 0;
};

std::string slurp(const std::string& path) {
  std::ifstream in(path, std::ios::binary);
  std::ostringstream s;
  s << in.rdbuf();
  return s.str();
}

// ---- the test -----------------------------------------------------------------------------------

class use_export : public ::testing::Test {
 protected:
  void SetUp() override {
    dir_ = (fs::temp_directory_path() / ("t3d_export_" + std::to_string(::getpid()))).string();
    fs::remove_all(dir_);
    fs::create_directories(dir_);
  }
  void TearDown() override { fs::remove_all(dir_); }
  std::string dir_;
};

TEST_F(use_export, safetensors_round_trip_is_bit_exact) {
  Recipe r = parse_recipe(
      "[model]\nvocab_size = 48\ndim = 16\nn_layers = 2\nn_heads = 4\nn_kv_heads = 2\n"
      "ffn_dim = 40\nseq_len = 8\nnorm_eps = 1e-6\nrope_theta = 500000.0\n",
      "test");
  // The whole model, random bits (NaN and -0 included: a copy must not be a conversion).
  std::vector<GlobalTensor> tensors = llama_tensor_table(r.model);
  std::mt19937 rng(5);
  for (auto& t : tensors) {
    size_t n = 1;
    for (const int64_t d : t.shape) n *= static_cast<size_t>(d);
    t.data.resize(n);
    for (auto& x : t.data) {
      const uint32_t bits = rng();
      std::memcpy(&x, &bits, 4);
    }
  }
  // Written as a tp2 run would: matrices in two row halves, one per shard; vectors by rank 0.
  ck::IndexInfo info;
  info.step = 12, info.recipe = r.to_toml(), info.layout = "pp=1 dp=1 cp=1 tp=2";
  info.counters = {{"step", 12}};
  for (int rank = 0; rank < 2; ++rank) {
    std::vector<ck::Slice> mine;
    for (auto& t : tensors) {
      if (t.shape.size() == 1) {
        if (rank == 0) mine.push_back({"model/" + t.name, t.shape, {0}, t.shape, t.data.data()});
        continue;
      }
      const int64_t half = t.shape[0] / 2;
      mine.push_back({"model/" + t.name,
                      t.shape,
                      {half * rank, 0},
                      {half, t.shape[1]},
                      t.data.data() + half * rank * t.shape[1]});
    }
    const std::string path = ck::shard_path(dir_, 12, rank);
    const ck::FileDigest d = ck::write_shard(path, rank, mine).digest;
    ck::publish(path);
    info.shards.push_back({fs::path(path).lexically_relative(dir_).string(), d.bytes, d.hash});
  }
  ck::write_index(dir_, info);

  const std::string out = dir_ + "/hf";
  const ExportSummary s = export_snapshot(ck::index_path(dir_, 12), out);
  EXPECT_EQ(s.step, 12);
  EXPECT_EQ(s.tensors, static_cast<int64_t>(tensors.size()));

  // safetensors: u64 header length, JSON header, data; every tensor where the header says.
  const std::string file = slurp(out + "/model.safetensors");
  ASSERT_GE(file.size(), 8u);
  uint64_t n = 0;
  std::memcpy(&n, file.data(), 8);
  ASSERT_LE(8 + n, file.size());
  EXPECT_EQ((8 + n) % 8, 0u) << "data section 8-byte aligned";
  const Json header = JsonParser(file.substr(8, n)).parse();
  EXPECT_EQ(header["__metadata__"]["format"].str(), "pt");
  EXPECT_EQ(header.object().size(), tensors.size() + 1);
  uint64_t covered = 0;
  for (const auto& t : tensors) {
    const Json& h = header[t.name];
    EXPECT_EQ(h["dtype"].str(), "F32") << t.name;
    std::vector<int64_t> shape;
    for (const auto& d : h["shape"].array()) shape.push_back(static_cast<int64_t>(d.number()));
    EXPECT_EQ(shape, t.shape) << t.name;
    const auto begin = static_cast<uint64_t>(h["data_offsets"].array().at(0).number());
    const auto end = static_cast<uint64_t>(h["data_offsets"].array().at(1).number());
    ASSERT_EQ(end - begin, 4 * t.data.size()) << t.name;
    ASSERT_LE(8 + n + end, file.size()) << t.name;
    EXPECT_EQ(std::memcmp(file.data() + 8 + n + begin, t.data.data(), end - begin), 0)
        << t.name << ": not bit-identical to the snapshot";
    covered += end - begin;
  }
  EXPECT_EQ(8 + n + covered, file.size()) << "no bytes beyond the tensors";

  const Json config = JsonParser(slurp(out + "/config.json")).parse();
  EXPECT_EQ(config["architectures"].array().at(0).str(), "LlamaForCausalLM");
  EXPECT_EQ(config["model_type"].str(), "llama");
  EXPECT_EQ(config["vocab_size"].number(), 48);
  EXPECT_EQ(config["hidden_size"].number(), 16);
  EXPECT_EQ(config["intermediate_size"].number(), 40);
  EXPECT_EQ(config["num_hidden_layers"].number(), 2);
  EXPECT_EQ(config["num_attention_heads"].number(), 4);
  EXPECT_EQ(config["num_key_value_heads"].number(), 2);
  EXPECT_EQ(config["max_position_embeddings"].number(), 8);
  EXPECT_EQ(config["rms_norm_eps"].number(), 1e-6);
  EXPECT_EQ(config["rope_theta"].number(), 500000.0);
  EXPECT_EQ(std::get<bool>(config["tie_word_embeddings"].v), false);
}

TEST_F(use_export, tied_embeddings_have_no_lm_head) {
  ModelConfig m;
  m.tie_embeddings = true;
  m.ffn_dim = 64;
  for (const auto& t : llama_tensor_table(m)) EXPECT_NE(t.name, "lm_head.weight");
}

TEST_F(use_export, missing_snapshot_is_a_user_error) {
  EXPECT_THROW(export_snapshot(dir_ + "/step_00000001.h5", dir_ + "/out"), UserError);
}

// The family a mixture of experts is written as, its names, its extra zero tensors, and what no
// family holds (named by key).
// A dense model's q/k/v biases go out as Qwen2 (LLaMA's attention_bias would bias o_proj too); a
// mixture of experts' as Qwen2-MoE's (MixturesOfExpertsChooseTheirFamily), and refused naming the
// key where the mixture is Mixtral's (no shared expert, no dense block).
TEST(use_export_layout, QkvBiasesExportAsQwen2) {
  ModelConfig m;
  m.qkv_bias = true;
  EXPECT_EQ(hf_layout(m), HfLayout::kQwen2);
  EXPECT_NO_THROW(check_hf_layout(m, "s.h5"));
  EXPECT_EQ(hf_tensor_name(m, "model.layers.0.self_attn.q_proj.bias"),
            "model.layers.0.self_attn.q_proj.bias");
  m.n_experts = 4, m.experts_per_token = 2, m.moe_ffn_dim = 32;
  try {
    check_hf_layout(m, "s.h5");
    FAIL();
  } catch (const UserError& e) {
    EXPECT_NE(std::string(e.what()).find("model.qkv_bias"), std::string::npos) << e.what();
  }
}

TEST(use_export_layout, MixturesOfExpertsChooseTheirFamily) {
  ModelConfig m;
  m.dim = 64, m.n_heads = 4, m.n_kv_heads = 2, m.n_layers = 3, m.ffn_dim = 128;
  EXPECT_EQ(hf_layout(m), HfLayout::kLlama);
  m.n_experts = 4, m.experts_per_token = 2, m.moe_ffn_dim = 32;
  EXPECT_EQ(hf_layout(m), HfLayout::kMixtral);
  EXPECT_EQ(hf_tensor_name(m, "model.layers.1.mlp.router.weight"),
            "model.layers.1.block_sparse_moe.gate.weight");
  EXPECT_EQ(hf_tensor_name(m, "model.layers.1.mlp.experts.3.down_proj.weight"),
            "model.layers.1.block_sparse_moe.experts.3.w2.weight");
  m.n_shared_experts = 2, m.dense_layers = 1;
  EXPECT_EQ(hf_layout(m), HfLayout::kQwen2Moe);
  EXPECT_EQ(hf_tensor_name(m, "model.layers.1.mlp.router.weight"),
            "model.layers.1.mlp.gate.weight");
  EXPECT_EQ(hf_tensor_name(m, "model.layers.1.mlp.experts.3.down_proj.weight"),
            "model.layers.1.mlp.experts.3.down_proj.weight");
  EXPECT_EQ(hf_tensor_name(m, "model.layers.2.mlp.shared_experts.up_proj.weight"),
            "model.layers.2.mlp.shared_expert.up_proj.weight");
  EXPECT_EQ(hf_tensor_name(m, "model.layers.0.mlp.gate_proj.weight"),
            "model.layers.0.mlp.gate_proj.weight");
  // q/k/v biases of every block, a (1, dim) shared-expert gate of each MoE block (1 and 2): zeros.
  std::map<std::string, std::vector<int64_t>> zeros;
  for (const auto& t : qwen2_moe_zero_tensors(m)) {
    zeros[t.name] = t.shape;
    for (const float v : t.data) EXPECT_EQ(v, 0.0f) << t.name;
  }
  EXPECT_EQ(zeros.size(), 3u * 3 + 2);
  EXPECT_EQ(zeros.at("model.layers.0.self_attn.k_proj.bias"), (std::vector<int64_t>{32}));
  EXPECT_EQ(zeros.at("model.layers.2.mlp.shared_expert_gate.weight"),
            (std::vector<int64_t>{1, 64}));
  EXPECT_FALSE(zeros.count("model.layers.0.mlp.shared_expert_gate.weight"));  // a dense block
  EXPECT_NO_THROW(check_hf_layout(m, "s.h5"));
  // Biases and gates of its own (model.qkv_bias, model.shared_expert_gate): written as they are,
  // named as the family names them, and no zeros in their place.
  ModelConfig own = m;
  own.qkv_bias = own.shared_expert_gate = true;
  EXPECT_EQ(hf_layout(own), HfLayout::kQwen2Moe);
  EXPECT_NO_THROW(check_hf_layout(own, "s.h5"));
  EXPECT_TRUE(qwen2_moe_zero_tensors(own).empty());
  EXPECT_EQ(hf_tensor_name(own, "model.layers.2.mlp.shared_expert_gate.weight"),
            "model.layers.2.mlp.shared_expert_gate.weight");
  m.router_norm_topk = false;  // Qwen2-MoE's norm_topk_prob = false
  EXPECT_NO_THROW(check_hf_layout(m, "s.h5"));
  const auto refusal = [](const ModelConfig& c) {
    try {
      check_hf_layout(c, "s.h5");
      return std::string();
    } catch (const UserError& e) {
      return std::string(e.what());
    }
  };
  ModelConfig sigmoid = m, scaled = m, biased = m, dense_only = m, mixtral = m;
  sigmoid.router_score = kernels::RouterScore::kSigmoid;
  scaled.router_scale = 2.5;
  biased.router_bias_rate = 1e-3;
  dense_only.n_shared_experts = 0;  // dense blocks without a shared expert: no family
  mixtral.n_shared_experts = 0, mixtral.dense_layers = 0;  // Mixtral always normalises the gates
  for (const auto& [c, key] : {std::pair<ModelConfig, std::string>{sigmoid, "model.router_score"},
                               {scaled, "model.router_scale"},
                               {biased, "model.router_bias_rate"},
                               {dense_only, "model.dense_layers"},
                               {mixtral, "model.router_norm_topk"}}) {
    const std::string e = refusal(c);
    EXPECT_NE(e.find("s.h5: " + key), std::string::npos) << key << ": " << e;
  }
}

}  // namespace
}  // namespace t3d::runtime
