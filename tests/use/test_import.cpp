// The pieces of `titan3d import` that need no snapshot: the safetensors reader (F32 / BF16 / F16
// to fp32, damaged files refused) and config.json to a model shape (defaults said, unrepresentable
// keys refused by name). End to end against export: tests/use/import.sh.
#include <gtest/gtest.h>
#include <sys/stat.h>
#include <unistd.h>

#include <algorithm>
#include <cmath>
#include <cstring>
#include <filesystem>
#include <fstream>
#include <limits>

#include "checkpoint/safetensors.h"
#include "kernels/check.h"
#include "runtime/data/text_tokenizer.h"
#include "runtime/use/export.h"
#include "runtime/use/import.h"

namespace t3d::runtime {
namespace {

namespace fs = std::filesystem;
namespace ck = checkpoint;

std::string temp_file(const std::string& name) {
  return (fs::temp_directory_path() / (name + "_" + std::to_string(::getpid()))).string();
}

// A safetensors file of one tensor with raw `bytes`, written by hand (not by the writer).
std::string hand_written(const std::string& name, const std::string& dtype,
                         const std::vector<int64_t>& shape, const std::string& bytes) {
  std::string shape_json;
  for (const int64_t d : shape) shape_json += (shape_json.empty() ? "" : ",") + std::to_string(d);
  std::string header = "{\"t\":{\"dtype\":\"" + dtype + "\",\"shape\":[" + shape_json +
                       "],\"data_offsets\":[0," + std::to_string(bytes.size()) + "]}}";
  const uint64_t n = header.size();
  const std::string path = temp_file(name);
  std::ofstream out(path, std::ios::binary);
  out.write(reinterpret_cast<const char*>(&n), 8);
  out << header << bytes;
  return path;
}

template <typename T>
std::string raw(const std::vector<T>& v) {
  return std::string(reinterpret_cast<const char*>(v.data()), v.size() * sizeof(T));
}

TEST(use_Import, ReadsF16ExactlyIncludingSubnormalsAndInfinities) {
  // 1, -2, 65504 (largest), 2^-24 (smallest subnormal), 3·2^-24, 2^-14 (smallest normal), -inf, -0
  const std::vector<uint16_t> h = {0x3C00, 0xC000, 0x7BFF, 0x0001, 0x0003, 0x0400, 0xFC00, 0x8000};
  const std::string path = hand_written("f16", "F16", {2, 4}, raw(h));
  const ck::SafetensorsFile f(path);
  const std::vector<float> got = f.read_f32("t");
  const float inf = std::numeric_limits<float>::infinity();
  const std::vector<float> want = {
      1.0f, -2.0f, 65504.0f, std::ldexp(1.0f, -24), std::ldexp(3.0f, -24), std::ldexp(1.0f, -14),
      -inf, -0.0f};
  ASSERT_EQ(got.size(), want.size());
  for (size_t i = 0; i < want.size(); ++i) EXPECT_EQ(got[i], want[i]) << i;
  EXPECT_TRUE(std::signbit(got[7]));
  fs::remove(path);
}

TEST(use_Import, WriterBf16RoundsToNearestEvenAndReaderWidens) {
  // 1 + 2^-8 is halfway between two bf16 values: ties to even (1.0); 1 + 3·2^-8 rounds up.
  const std::vector<float> v = {1.0f + std::ldexp(1.0f, -8), 1.0f + std::ldexp(3.0f, -8), -3.5f,
                                1e-30f};
  const std::string path = temp_file("bf16.safetensors");
  ck::write_safetensors(path, {{"w", {4}, v.data()}}, {}, ck::StDtype::kBF16);
  const ck::SafetensorsFile f(path);
  EXPECT_EQ(f.entries().at("w").dtype, "BF16");
  EXPECT_EQ(f.entries().at("w").end - f.entries().at("w").begin, 8u);  // 2 bytes per value
  const std::vector<float> got = f.read_f32("w");
  EXPECT_EQ(got[0], 1.0f);
  EXPECT_EQ(got[1], 1.0f + std::ldexp(1.0f, -6));
  EXPECT_EQ(got[2], -3.5f);
  uint32_t bits;
  std::memcpy(&bits, &got[3], 4);
  EXPECT_EQ(bits & 0xFFFFu, 0u);  // a bf16 value: the low half is zero
  fs::remove(path);
}

TEST(use_Import, RefusesDamagedFilesAndOtherDtypes) {
  const std::string truncated = hand_written("trunc", "F32", {4}, std::string(12, '\0'));
  try {
    ck::SafetensorsFile f(truncated);
    FAIL() << "16 bytes promised, 12 present";
  } catch (const UserError& e) {
    EXPECT_NE(std::string(e.what()).find(truncated), std::string::npos) << e.what();
    EXPECT_NE(std::string(e.what()).find("truncated or damaged"), std::string::npos) << e.what();
  }
  const std::string ints = hand_written("ints", "I32", {2}, std::string(8, '\0'));
  const ck::SafetensorsFile f(ints);
  try {
    f.read_f32("t");
    FAIL() << "I32 is not a weight dtype titan3d reads";
  } catch (const UserError& e) {
    EXPECT_NE(std::string(e.what()).find("I32"), std::string::npos) << e.what();
  }
  EXPECT_THROW(f.read_f32("absent"), UserError);
  const std::string garbage = temp_file("garbage");
  std::ofstream(garbage) << "not a safetensors file at all";
  EXPECT_THROW(ck::SafetensorsFile{garbage}, UserError);
  for (const auto& p : {truncated, ints, garbage}) fs::remove(p);
}

const char* kMinimalConfig = R"({"model_type": "llama", "vocab_size": 300, "hidden_size": 64,
  "num_hidden_layers": 2, "num_attention_heads": 4, "intermediate_size": 128})";

TEST(use_Import, ConfigDefaultsAreTransformersAndSaid) {
  std::vector<std::string> notes;
  const ModelConfig m = llama_model_from_config(kMinimalConfig, "c.json", &notes);
  EXPECT_EQ(m.vocab_size, 300);
  EXPECT_EQ(m.dim, 64);
  EXPECT_EQ(m.n_layers, 2);
  EXPECT_EQ(m.n_heads, 4);
  EXPECT_EQ(m.n_kv_heads, 4);
  EXPECT_EQ(m.ffn_dim, 128);
  EXPECT_EQ(m.seq_len, 2048);
  EXPECT_EQ(m.norm_eps, 1e-6);
  EXPECT_EQ(m.rope_theta, 10000.0);
  EXPECT_FALSE(m.tie_embeddings);
  ASSERT_EQ(notes.size(), 5u);  // kv heads, positions, eps, theta, tying
  EXPECT_NE(notes[0].find("num_key_value_heads"), std::string::npos);
}

TEST(use_Import, ConfigKeysTitanCannotRepresentAreRefusedByName) {
  const std::string base = kMinimalConfig;
  const std::pair<std::string, std::string> bad[] = {
      {"rope_scaling", R"({"type": "dynamic", "factor": 2.0})"},
      {"attention_bias", "true"},
      {"mlp_bias", "true"},
      {"hidden_act", R"("gelu")"},
      {"head_dim", "7"},  // RoPE rotates pairs
      {"head_dim", R"("16")"},
      {"partial_rotary_factor", "0.5"},
      {"attention_dropout", "0.1"},
      {"architectures", R"(["MistralForCausalLM"])"},
  };
  for (const auto& [key, value] : bad) {
    const std::string text = "{\"" + key + "\": " + value + ", " + base.substr(1);
    std::vector<std::string> notes;
    try {
      llama_model_from_config(text, "c.json", &notes);
      FAIL() << key;
    } catch (const UserError& e) {
      EXPECT_NE(std::string(e.what()).find("`" + key + "`"), std::string::npos) << e.what();
      EXPECT_NE(std::string(e.what()).find("c.json"), std::string::npos) << e.what();
    }
  }
  std::vector<std::string> notes;
  // Explicit values titan3d has: accepted.
  EXPECT_NO_THROW(llama_model_from_config(
      R"({"rope_scaling": null, "attention_bias": false, "head_dim": 16, "attention_dropout": 0.0, )" +
          base.substr(1),
      "c.json", &notes));
  try {
    llama_model_from_config(R"({"model_type": "llama"})", "c.json", &notes);
    FAIL();
  } catch (const UserError& e) {
    EXPECT_NE(std::string(e.what()).find("`vocab_size`"), std::string::npos) << e.what();
  }
  EXPECT_THROW(llama_model_from_config(R"({"model_type": "gpt2"})", "c.json", &notes), UserError);
}

// Llama 3.x: `rope_scaling` (rope_type llama3 or linear, or the older `type`) as the model's
// rope_* keys and `head_dim` as model.head_dim, and export's config.json read back to the same
// model and the same text; every other kind, unknown key of the object or bad value refused
// naming the file and the key.
TEST(use_Import, Llama3RopeScalingAndHeadDimMapBothWays) {
  const std::string base = kMinimalConfig;  // hidden 64, 4 heads
  const std::string llama3 =
      R"({"rope_scaling": {"factor": 32.0, "high_freq_factor": 4.0, "low_freq_factor": 1.0,
      "original_max_position_embeddings": 8192, "rope_type": "llama3"}, "rope_theta": 500000.0,
      "head_dim": 24, "tie_word_embeddings": true, )" +
      base.substr(1);
  std::vector<std::string> notes;
  const ModelConfig m = llama_model_from_config(llama3, "c.json", &notes);
  EXPECT_EQ(m.rope_scaling, kernels::RopeScaling::Kind::kLlama3);
  EXPECT_EQ(m.rope_factor, 32.0);
  EXPECT_EQ(m.rope_low_freq_factor, 1.0);
  EXPECT_EQ(m.rope_high_freq_factor, 4.0);
  EXPECT_EQ(m.rope_original_seq_len, 8192);
  EXPECT_EQ(m.head_dim(), 24);
  EXPECT_TRUE(m.tie_embeddings);
  const std::string exported = llama_config_json(m);
  EXPECT_NE(exported.find(R"("rope_type": "llama3", "factor": 32.0)"), std::string::npos)
      << exported;
  const ModelConfig again = llama_model_from_config(exported, "exported.json", &notes);
  EXPECT_EQ(llama_config_json(again), exported);
  EXPECT_EQ(again.rope_original_seq_len, 8192);
  EXPECT_EQ(again.explicit_head_dim, 24);
  // head_dim equal to hidden_size / num_attention_heads is the derived width; linear scaling in
  // the older spelling; rope_type "default" is none.
  const ModelConfig linear = llama_model_from_config(
      R"({"head_dim": 16, "rope_scaling": {"type": "linear", "factor": 2.5}, )" + base.substr(1),
      "c.json", &notes);
  EXPECT_EQ(linear.explicit_head_dim, 0);
  EXPECT_EQ(linear.rope_scaling, kernels::RopeScaling::Kind::kLinear);
  EXPECT_EQ(linear.rope_factor, 2.5);
  EXPECT_EQ(llama_model_from_config(llama_config_json(linear), "e.json", &notes).rope_factor, 2.5);
  EXPECT_EQ(llama_model_from_config(
                R"({"rope_scaling": {"rope_type": "default"}, )" + base.substr(1), "c.json", &notes)
                .rope_scaling,
            kernels::RopeScaling::Kind::kNone);
  const std::pair<std::string, std::string> bad[] = {
      {R"({"rope_type": "yarn", "factor": 4.0})", "`rope_scaling`"},
      {R"({"type": "dynamic", "factor": 2.0})", "`rope_scaling`"},
      {R"({"factor": 2.0})", "`rope_scaling`"},
      {R"({"rope_type": "linear", "type": "llama3", "factor": 2.0})", "`rope_scaling.type`"},
      {R"({"rope_type": "linear"})", "`rope_scaling.factor`"},
      {R"({"rope_type": "linear", "factor": "2"})", "`rope_scaling.factor`"},
      {R"({"rope_type": "linear", "factor": -2.0})", "`rope_scaling.factor`"},
      {R"({"rope_type": "linear", "factor": 2.0, "original_max_position_embeddings": 8})",
       "`rope_scaling.original_max_position_embeddings`"},
      {R"({"rope_type": "llama3", "factor": 8.0, "low_freq_factor": 1.0,
          "high_freq_factor": 4.0})",
       "`rope_scaling.original_max_position_embeddings`"},
      {R"({"rope_type": "llama3", "factor": 8.0, "low_freq_factor": 4.0, "high_freq_factor": 1.0,
          "original_max_position_embeddings": 8192})",
       "`rope_scaling.high_freq_factor`"},
      {R"({"rope_type": "llama3", "factor": 8.0, "low_freq_factor": 1.0, "high_freq_factor": 4.0,
          "original_max_position_embeddings": 8192.5})",
       "`rope_scaling.original_max_position_embeddings`"},
      {R"({"rope_type": "llama3", "factor": 8.0, "low_freq_factor": 1.0, "high_freq_factor": 4.0,
          "original_max_position_embeddings": 8192, "attention_factor": 1.0})",
       "`rope_scaling.attention_factor`"},
      {R"("llama3")", "`rope_scaling`"},
  };
  for (const auto& [value, key] : bad) {
    try {
      llama_model_from_config(R"({"rope_scaling": )" + value + ", " + base.substr(1), "c.json",
                              &notes);
      ADD_FAILURE() << value;
    } catch (const UserError& e) {
      EXPECT_NE(std::string(e.what()).find(key), std::string::npos) << e.what();
      EXPECT_NE(std::string(e.what()).find("c.json"), std::string::npos) << e.what();
    }
  }
}

// A key the family's import neither maps, checks nor knows to change nothing is refused by name
// (it may change the model: a quantization, a sliding window on a LLaMA); metadata is not.
TEST(use_Import, UnknownConfigKeysAreRefusedByName) {
  const std::string base = kMinimalConfig;
  std::vector<std::string> notes;
  EXPECT_NO_THROW(llama_model_from_config(
      R"({"_name_or_path": "x", "transformers_version": "4.45.0", "torch_dtype": "bfloat16",
          "use_cache": true, "initializer_range": 0.02, "bos_token_id": 128000,
          "eos_token_id": [128001, 128009], "pad_token_id": null, )" +
          base.substr(1),
      "c.json", &notes));
  for (const std::string key :
       {"quantization_config", "sliding_window", "num_local_experts", "qk_layernorm"}) {
    try {
      llama_model_from_config("{\"" + key + "\": {\"bits\": 4}, " + base.substr(1), "c.json",
                              &notes);
      ADD_FAILURE() << key;
    } catch (const UserError& e) {
      EXPECT_NE(std::string(e.what()).find("c.json: `" + key + "`"), std::string::npos) << e.what();
      EXPECT_NE(std::string(e.what()).find("remove it from config.json"), std::string::npos);
    }
  }
}

// Qwen2 / Qwen2.5 (Qwen2ForCausalLM): q/k/v biases always (model.qkv_bias), the sliding window's
// settings taken only while use_sliding_window is false; export writes the family back.
TEST(use_Import, Qwen2ConfigHasQkvBiasesAndNoSlidingWindow) {
  const std::string qwen2 = R"({"architectures": ["Qwen2ForCausalLM"], "model_type": "qwen2",
      "vocab_size": 300, "hidden_size": 64, "num_hidden_layers": 2, "num_attention_heads": 4,
      "num_key_value_heads": 2, "intermediate_size": 128, "max_position_embeddings": 32,
      "rope_theta": 1000000.0, "rms_norm_eps": 1e-6, "tie_word_embeddings": true,
      "sliding_window": 4096, "max_window_layers": 21, "use_sliding_window": false})";
  std::vector<std::string> notes;
  const ModelConfig m = llama_model_from_config(qwen2, "c.json", &notes);
  EXPECT_TRUE(m.qkv_bias);
  EXPECT_EQ(hf_layout(m), HfLayout::kQwen2);
  const std::string exported = llama_config_json(m);
  EXPECT_NE(exported.find(R"("architectures": ["Qwen2ForCausalLM"])"), std::string::npos);
  EXPECT_EQ(exported.find("attention_bias"), std::string::npos) << exported;
  EXPECT_EQ(llama_config_json(llama_model_from_config(exported, "e.json", &notes)), exported);
  std::string sliding = qwen2;
  sliding.replace(sliding.find(R"("use_sliding_window": false)"), 27,
                  R"("use_sliding_window": true)");
  try {
    llama_model_from_config(sliding, "c.json", &notes);
    FAIL();
  } catch (const UserError& e) {
    EXPECT_NE(std::string(e.what()).find("c.json: `use_sliding_window`"), std::string::npos)
        << e.what();
  }
}

// Qwen2-MoE's config as titan3d's block: shared experts a whole number of experts wide, dense
// blocks the leading mlp_only_layers, norm_topk_prob (default false) the gates' normalisation;
// what has no place in titan3d's block refused by its key.
TEST(use_Import, Qwen2MoeConfigMapsOntoTheBlock) {
  const std::string qwen = R"("model_type": "qwen2_moe", "architectures": ["Qwen2MoeForCausalLM"],
      "vocab_size": 256, "hidden_size": 64, "num_hidden_layers": 3, "num_attention_heads": 4,
      "intermediate_size": 128, "num_experts": 4, "num_experts_per_tok": 2,
      "moe_intermediate_size": 32)";
  std::vector<std::string> notes;
  const ModelConfig m = llama_model_from_config(
      "{" + qwen + R"(, "shared_expert_intermediate_size": 96, "mlp_only_layers": [0]})", "c.json",
      &notes);
  EXPECT_EQ(m.n_experts, 4);
  EXPECT_EQ(m.experts_per_token, 2);
  EXPECT_EQ(m.moe_ffn_dim, 32);
  EXPECT_EQ(m.n_shared_experts, 3);
  EXPECT_EQ(m.dense_layers, 1);
  EXPECT_EQ(m.ffn_dim, 128);
  EXPECT_FALSE(m.router_norm_topk);  // transformers' default, said in the notes
  EXPECT_NE(std::find_if(notes.begin(), notes.end(),
                         [](const std::string& n) { return n.find("norm_topk_prob") != n.npos; }),
            notes.end());
  const ModelConfig normalised = llama_model_from_config(
      "{" + qwen + R"(, "shared_expert_intermediate_size": 32, "norm_topk_prob": true})", "c.json",
      &notes);
  EXPECT_TRUE(normalised.router_norm_topk);
  EXPECT_EQ(normalised.dense_layers, 0);
  const std::pair<std::string, std::string> bad[] = {
      {"shared_expert_intermediate_size", "48"},  // 1.5 experts wide
      {"shared_expert_intermediate_size", "0"},   // titan3d's Qwen2-MoE block has a shared expert
      {"mlp_only_layers", "[1]"},                 // a dense block after a mixture of experts
      {"decoder_sparse_step", "2"},
      {"use_sliding_window", "true"},
  };
  for (const auto& [key, value] : bad) {
    std::string text = "{" + qwen + ", \"" + key + "\": " + value;
    if (key != "shared_expert_intermediate_size")
      text += R"(, "shared_expert_intermediate_size": 32)";
    try {
      llama_model_from_config(text + "}", "c.json", &notes);
      FAIL() << key << " = " << value;
    } catch (const UserError& e) {
      EXPECT_NE(std::string(e.what()).find("`" + key + "`"), std::string::npos) << e.what();
      EXPECT_NE(std::string(e.what()).find("c.json"), std::string::npos) << e.what();
    }
  }
}

// A mixture of experts of no experts: titan3d's n_experts = 0 is a dense model, which would look
// for dense tensors the MoE checkpoint has not. Refused naming the family's count key and the file.
TEST(use_Import, AMixtureOfNoExpertsIsRefusedByItsKey) {
  const std::string shape = R"("vocab_size": 256, "hidden_size": 64, "num_hidden_layers": 2,
      "num_attention_heads": 4, "intermediate_size": 128, "num_experts_per_tok": 2)";
  const std::pair<std::string, std::string> families[] = {
      {R"("model_type": "mixtral", )", "num_local_experts"},
      {R"("model_type": "qwen2_moe", "moe_intermediate_size": 32,
          "shared_expert_intermediate_size": 32, )",
       "num_experts"}};
  for (const auto& [family, key] : families) {
    std::vector<std::string> notes;
    for (const char* count : {"0", "-1"}) {
      try {
        llama_model_from_config("{" + family + shape + ", \"" + key + "\": " + count + "}",
                                "c.json", &notes);
        ADD_FAILURE() << key << " = " << count;
      } catch (const UserError& e) {
        const std::string what = e.what();
        EXPECT_NE(what.find("`" + key + "`"), std::string::npos) << what;
        EXPECT_NE(what.find("c.json"), std::string::npos) << what;
      }
    }
    // Two experts, both chosen by every token: a mixture titan3d represents.
    EXPECT_EQ(
        llama_model_from_config("{" + family + shape + ", \"" + key + "\": 2}", "c.json", &notes)
            .n_experts,
        2);
  }
}

// A tiny Hugging Face directory titan3d can import: config.json (`extra` spliced into it) and every
// tensor of its model in `weights` (a file name inside the directory), zeros.
const char* kTinyConfig = R"({"model_type": "llama", "vocab_size": 256, "hidden_size": 16,
  "num_hidden_layers": 1, "num_attention_heads": 2, "intermediate_size": 32,
  "max_position_embeddings": 16, "tie_word_embeddings": false})";

struct HfDir {
  fs::path dir;
  std::vector<GlobalTensor> tensors;
  explicit HfDir(const std::string& name, const std::string& extra = "") {
    dir = temp_file(name);
    fs::remove_all(dir);
    fs::create_directories(dir);
    std::string config = kTinyConfig;
    if (!extra.empty()) config = "{" + extra + ", " + config.substr(1);
    std::ofstream(dir / "config.json") << config;
    std::vector<std::string> notes;
    tensors = llama_tensor_table(llama_model_from_config(config, "config.json", &notes));
    for (auto& t : tensors) {
      int64_t n = 1;
      for (const int64_t d : t.shape) n *= d;
      t.data.assign(static_cast<size_t>(n), 0.0f);
    }
  }
  ~HfDir() { fs::remove_all(dir); }
  void weights(const fs::path& path) const {
    std::vector<ck::TensorRef> refs;
    for (const auto& t : tensors) refs.push_back({t.name, t.shape, t.data.data()});
    ck::write_safetensors(path.string(), refs, {});
  }
  // model.safetensors.index.json mapping every tensor to `file`, the first one to `first`.
  void index(const std::string& first, const std::string& file) const {
    std::string map;
    for (const auto& t : tensors)
      map += (map.empty() ? "" : ", ") + ck::json_quote(t.name) + ": " +
             ck::json_quote(map.empty() ? first : file);
    std::ofstream(dir / "model.safetensors.index.json") << "{\"weight_map\": {" << map << "}}";
  }
  // import_hf's UserError message; "" when it succeeded.
  std::string import_error() const {
    try {
      import_hf(dir.string(), (dir / "out").string());
      return "";
    } catch (const UserError& e) {
      return e.what();
    }
  }
};

TEST(use_Import, WeightMapReadsOnlyRegularFilesInsideTheDirectory) {
  // A FIFO outside the directory: opening it for reading would block, so a name that reached it
  // hangs the test instead of passing (the alarm turns a hang into a failure).
  alarm(60);
  const HfDir hf("weight_map");
  hf.weights(hf.dir / "good.safetensors");
  const fs::path outside = temp_file("outside");
  fs::remove_all(outside);
  fs::create_directories(outside);
  ASSERT_EQ(mkfifo((outside / "evil.safetensors").c_str(), 0600), 0);
  hf.weights(outside / "real.safetensors");
  fs::create_directories(hf.dir / "sub");
  ASSERT_EQ(mkfifo((hf.dir / "fifo.safetensors").c_str(), 0600), 0);
  fs::create_symlink(outside / "real.safetensors", hf.dir / "link.safetensors");
  const std::string up = "../" + outside.filename().string() + "/evil.safetensors";
  const std::pair<std::string, std::string> bad[] = {
      {(outside / "evil.safetensors").string(), "not a plain relative path"},
      {up, "not a plain relative path"},
      {"", "not a plain relative path"},
      {".", "not a plain relative path"},
      {"sub/../good.safetensors", "not a plain relative path"},
      {"sub", "a directory"},
      {"fifo.safetensors", "a FIFO"},
      {"link.safetensors", "leads outside"},
  };
  for (const auto& [name, why] : bad) {
    hf.index(name, "good.safetensors");
    const std::string e = hf.import_error();
    EXPECT_NE(e.find(name.empty() ? "``" : name), std::string::npos) << name << ": " << e;
    EXPECT_NE(e.find(why), std::string::npos) << name << ": " << e;
  }
  hf.index("good.safetensors", "good.safetensors");
  EXPECT_EQ(hf.import_error(), "");
  fs::remove_all(outside);
  alarm(0);
}

// A safetensors file with a raw `header` (JSON text) and `data_bytes` zero bytes of data.
std::string raw_safetensors(const std::string& name, const std::string& header, size_t data_bytes) {
  const uint64_t n = header.size();
  const std::string path = temp_file(name);
  std::ofstream out(path, std::ios::binary);
  out.write(reinterpret_cast<const char*>(&n), 8);
  out << header << std::string(data_bytes, '\0');
  return path;
}

// What the safetensors format forbids is refused naming the file and the tensor: a name twice,
// overlapping bytes, a hole or bytes no tensor indexes, offsets that are not integers or not
// inside the file, sizes that do not match dtype × shape, shapes past 2^64 bytes, nesting.
TEST(use_Import, SafetensorsHeaderIsCheckedAsTheFormatRequires) {
  const auto f32 = [](const std::string& name, const std::string& shape,
                      const std::string& offsets) {
    return "\"" + name + "\":{\"dtype\":\"F32\",\"shape\":[" + shape + "],\"data_offsets\":[" +
           offsets + "]}";
  };
  struct Case {
    std::string header;
    size_t data;
    std::string why;
  };
  const std::string deep = std::string(300000, '[') + std::string(300000, ']');
  const Case cases[] = {
      {"{" + f32("a", "1", "0,4") + "," + f32("a", "1", "4,8") + "}", 8, "appears twice"},
      {"{" + f32("a", "2", "0,8") + "," + f32("b", "2", "4,12") + "}", 12, "overlap"},
      {"{" + f32("a", "1", "0.0,4.0") + "}", 4, "malformed"},
      {"{" + f32("a", "1", "0,4,8") + "}", 4, "malformed"},
      {"{" + f32("a", "-1", "0,4") + "}", 4, "malformed"},
      {"{" + f32("a", "100", "0,400") + "}", 16, "file's size"},
      {"{" + f32("a", "1", "8,4") + "}", 8, "do not match"},
      {"{" + f32("a", "3", "0,8") + "}", 8, "do not match"},
      {"{" + f32("a", "1", "0,4") + "," + f32("b", "1", "8,12") + "}", 12, "a hole"},
      {"{" + f32("a", "1", "0,4") + "}", 8, "cover 4 bytes"},
      {"{" + f32("a", "4294967296,4294967296,4294967296", "0,4") + "}", 4, "2^64"},
      {"{\"a\":{\"dtype\":\"F33\",\"shape\":[1],\"data_offsets\":[0,4]}}", 4, "F33"},
      {"{\"__metadata__\":" + deep + "}", 0, "nested deeper"},
  };
  for (const auto& c : cases) {
    const std::string path = raw_safetensors("hostile", c.header, c.data);
    try {
      ck::SafetensorsFile f(path);
      ADD_FAILURE() << "accepted: " << c.header.substr(0, 200);
    } catch (const UserError& e) {
      EXPECT_NE(std::string(e.what()).find(path), std::string::npos) << e.what();
      EXPECT_NE(std::string(e.what()).find(c.why), std::string::npos)
          << c.why << ": " << std::string(e.what()).substr(0, 300);
    }
    fs::remove(path);
  }
  // Zero-size tensors and tensors given out of order still tile the data section.
  const std::string ok = raw_safetensors(
      "ordered",
      "{" + f32("b", "1", "4,8") + "," + f32("a", "1", "0,4") + "," + f32("e", "0", "8,8") + "}",
      8);
  EXPECT_EQ(ck::SafetensorsFile(ok).entries().size(), 3u);
  fs::remove(ok);
}

// config.json values of the wrong type or an unrepresentable size, duplicated keys and deep
// nesting are refused naming the file and the key, before anything is sized from them.
TEST(use_Import, ConfigValuesOfTheWrongTypeOrSizeAreRefusedByName) {
  const std::string base = kMinimalConfig;
  const std::string deep = std::string(300000, '[') + std::string(300000, ']');
  const std::pair<std::string, std::string> bad[] = {
      {"max_position_embeddings", R"("2048")"},
      {"rms_norm_eps", R"("1e-6")"},
      {"rope_theta", R"("10000")"},
      {"rope_theta", R"({"base": 10000})"},
      {"tie_word_embeddings", R"("false")"},
      {"num_key_value_heads", "2.5"},
      {"num_hidden_layers", "2147483648"},
      {"num_hidden_layers", "1099511627776"},
      {"vocab_size", "1099511627776"},
      {"max_position_embeddings", "-3"},
      {"rope_scaling", deep},
      {"architectures", deep},
      {"vocab_size", "300"},  // a second vocab_size
  };
  for (const auto& [key, value] : bad) {
    const std::string text = "{\"" + key + "\": " + value + ", " + base.substr(1);
    std::vector<std::string> notes;
    try {
      llama_model_from_config(text, "c.json", &notes);
      ADD_FAILURE() << key << " = " << value.substr(0, 40);
    } catch (const UserError& e) {
      const std::string what = e.what();
      EXPECT_NE(what.find("c.json"), std::string::npos) << what.substr(0, 300);
      if (value != deep)
        EXPECT_NE(what.find("`" + key + "`"), std::string::npos) << what.substr(0, 300);
      else
        EXPECT_NE(what.find("nested deeper"), std::string::npos) << what.substr(0, 300);
    }
  }
}

TEST(use_Import, RefusesATokenizerWithMoreIdsThanTheModel) {
  const HfDir hf("big_tokenizer");  // vocab_size 256
  hf.weights(hf.dir / "model.safetensors");
  const fs::path corpus = hf.dir / "corpus.txt";
  {
    std::ofstream out(corpus);
    for (int i = 0; i < 400; ++i)
      out << "the quick brown fox " << i << " jumps over the lazy dog number " << i * 7 << "\n";
  }
  train_tokenizer({corpus.string(), (hf.dir / "tokenizer.model").string(), 300, "bpe", 1});
  const std::string e = hf.import_error();
  EXPECT_NE(e.find("tokenizer.model"), std::string::npos) << e;
  EXPECT_NE(e.find("has 300 ids"), std::string::npos) << e;
  EXPECT_NE(e.find("`vocab_size` is 256"), std::string::npos) << e;
}

// A byte-level BPE tokenizer.json of the 256 byte tokens alone (GPT-2's byte alphabet, no merges).
std::string byte_tokens_only_json() {
  std::string vocab;
  int next = 256;  // bytes that are not printable stand for U+0100 on
  for (int b = 0; b < 256; ++b) {
    const bool printable = (b >= '!' && b <= '~') || (b >= 0xA1 && b <= 0xAC) || b >= 0xAE;
    const int cp = printable ? b : next++;
    const std::string utf8 = cp < 0x80 ? std::string(1, static_cast<char>(cp))
                                       : std::string{static_cast<char>(0xC0 | (cp >> 6)),
                                                     static_cast<char>(0x80 | (cp & 0x3F))};
    if (!vocab.empty()) vocab += ",";
    vocab += ck::json_quote(utf8) + ":" + std::to_string(b);
  }
  return R"({"model": {"type": "BPE", "merges": [], "vocab": {)" + vocab +
         R"(}}, "pre_tokenizer": {"type": "ByteLevel", "add_prefix_space": false}})";
}

// A tokenizer.model titan3d cannot use (here Llama 3's tiktoken file, not SentencePiece) gives
// way to the directory's tokenizer.json, which transformers' AutoTokenizer reads first; without a
// tokenizer.json the byte tokenizer stays; a tokenizer.json it cannot read names both files.
TEST(use_Import, AnUnusableTokenizerModelGivesWayToTokenizerJson) {
  const HfDir hf("tiktoken_model");  // vocab_size 256
  hf.weights(hf.dir / "model.safetensors");
  std::ofstream(hf.dir / "tokenizer.model") << "IQ== 0\nIg== 1\nIw== 2\n";
  std::ofstream(hf.dir / "tokenizer.json") << byte_tokens_only_json();
  const auto said = [](const ImportSummary& s, const std::string& what) {
    return std::any_of(s.notes.begin(), s.notes.end(),
                       [&](const std::string& n) { return n.find(what) != std::string::npos; });
  };
  const ImportSummary s = import_hf(hf.dir.string(), (hf.dir / "out").string());
  EXPECT_EQ(fs::path(s.tokenizer).filename(), "tokenizer.json") << s.tokenizer;
  EXPECT_EQ(s.recipe.data.tokenizer, s.tokenizer);
  EXPECT_EQ(TextTokenizer::open(s.tokenizer).vocab_size(), 256);
  EXPECT_TRUE(said(s, "tokenizer.json read instead"));
  EXPECT_TRUE(said(s, "not a SentencePiece model"));

  std::ofstream(hf.dir / "tokenizer.json") << R"({"model": {"type": "WordPiece"}})";
  fs::remove_all(hf.dir / "out");
  const std::string e = hf.import_error();
  EXPECT_NE(e.find("tokenizer.json"), std::string::npos) << e;
  EXPECT_NE(e.find("model.type"), std::string::npos) << e;
  EXPECT_NE(e.find("tokenizer.model, read first, is not usable"), std::string::npos) << e;

  fs::remove(hf.dir / "tokenizer.json");
  fs::remove_all(hf.dir / "out");
  const ImportSummary b = import_hf(hf.dir.string(), (hf.dir / "out").string());
  EXPECT_EQ(b.tokenizer, kByteTokenizerName);
  EXPECT_TRUE(said(b, "tokenizer.model not used, data.tokenizer = \"bytes\""));
}

// model.safetensors beside an index of shards: one of them is stale, and transformers would read
// model.safetensors where titan3d read the shards; refused naming both, until one is removed.
TEST(use_Import, RefusesOneFileBesideShards) {
  const HfDir hf("one_file_and_shards");
  hf.weights(hf.dir / "model.safetensors");
  hf.weights(hf.dir / "shard.safetensors");
  hf.index("shard.safetensors", "shard.safetensors");
  const std::string e = hf.import_error();
  EXPECT_NE(e.find("both model.safetensors and model.safetensors.index.json"), std::string::npos)
      << e;
  EXPECT_NE(e.find("remove"), std::string::npos) << e;
  fs::remove(hf.dir / "model.safetensors");
  EXPECT_EQ(hf.import_error(), "");
}

TEST(use_Import, RefusesNonFiniteWeightsNamingTheTensor) {
  for (const float bad :
       {std::numeric_limits<float>::quiet_NaN(), -std::numeric_limits<float>::infinity()}) {
    HfDir hf("nonfinite");
    hf.tensors[3].data[5] = bad;
    hf.weights(hf.dir / "model.safetensors");
    const std::string e = hf.import_error();
    EXPECT_NE(e.find("`" + hf.tensors[3].name + "`"), std::string::npos) << e;
    EXPECT_NE(e.find("element 5"), std::string::npos) << e;
  }
}

// A tensor the config implies but no file holds: refused naming the tensor and the files read.
TEST(use_Import, RefusesAMissingTensorNamingItAndTheFiles) {
  HfDir hf("missing");
  const std::string lost = hf.tensors[2].name;
  hf.tensors.erase(hf.tensors.begin() + 2);
  hf.weights(hf.dir / "model.safetensors");
  const std::string e = hf.import_error();
  EXPECT_NE(e.find("holds tensor `" + lost + "`"), std::string::npos) << e;
  EXPECT_NE(e.find((hf.dir / "model.safetensors").string()), std::string::npos) << e;
  EXPECT_NE(e.find("config.json"), std::string::npos) << e;
}

}  // namespace
}  // namespace t3d::runtime
