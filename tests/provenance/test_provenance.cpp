// What a snapshot was made from (runtime/provenance): a run may continue or score a snapshot only
// with its model shape and its tokenizer; a changed data file is detected by its content hash.
#include <gtest/gtest.h>
#include <unistd.h>

#include <filesystem>
#include <fstream>
#include <functional>
#include <map>
#include <string>
#include <utility>
#include <vector>

#include "kernels/check.h"
#include "runtime/provenance/provenance.h"
#include "runtime/recipe/recipe.h"

using namespace t3d::runtime;
namespace fs = std::filesystem;

namespace {

std::string error_of(const std::function<void()>& fn) {
  try {
    fn();
  } catch (const t3d::UserError& e) {
    return e.what();
  }
  return "";
}

void write(const fs::path& path, const std::string& text) {
  std::ofstream(path, std::ios::binary) << text;
}

class Provenance : public ::testing::Test {
 protected:
  fs::path dir = fs::temp_directory_path() / ("t3d_provenance_" + std::to_string(::getpid()));
  void SetUp() override { fs::create_directories(dir); }
  void TearDown() override { fs::remove_all(dir); }
};

}  // namespace

TEST_F(Provenance, OnlyTheSameModelShapeMayContinue) {
  const Recipe saved = parse_recipe("[model]\ndim = 96\nn_heads = 6\n", "saved.toml");
  const std::string stored = saved.to_toml();
  // Training keys may change; the model's shape may not.
  const Recipe longer = parse_recipe(stored, "now.toml", {{"train.steps", "999"}});
  EXPECT_EQ(error_of([&] { check_same_model(stored, longer, "s.h5", "resume from"); }), "");
  const Recipe wider = parse_recipe(stored, "now.toml", {{"model.dim", "192"}});
  const std::string e = error_of([&] { check_same_model(stored, wider, "s.h5", "resume from"); });
  EXPECT_NE(e.find("cannot resume from `s.h5`"), std::string::npos) << e;
  EXPECT_NE(e.find("model.dim is 96 in the snapshot but 192"), std::string::npos) << e;
}

// model.head_dim is the shape of q, k, v and o: another one is refused, while an explicit one
// equal to dim / n_heads is the same model. model.qkv_bias and model.qk_norm add tensors: shape
// keys too.
TEST_F(Provenance, TheHeadWidthIsTheModelsShape) {
  const std::string stored =
      parse_recipe("[model]\ndim = 64\nn_heads = 4\n", "saved.toml").to_toml();
  const Recipe same = parse_recipe(stored, "now.toml", {{"model.head_dim", "16"}});
  EXPECT_EQ(error_of([&] { check_same_model(stored, same, "s.h5", "evaluate"); }), "");
  const Recipe biased = parse_recipe(stored, "now.toml", {{"model.qkv_bias", "true"}});
  EXPECT_NE(error_of([&] {
              check_same_model(stored, biased, "s.h5", "evaluate");
            }).find("model.qkv_bias is 0 in the snapshot but 1"),
            std::string::npos);
  const Recipe normed = parse_recipe(stored, "now.toml", {{"model.qk_norm", "true"}});
  EXPECT_NE(error_of([&] {
              check_same_model(stored, normed, "s.h5", "resume");
            }).find("model.qk_norm is 0 in the snapshot but 1"),
            std::string::npos);
  const Recipe wide = parse_recipe(stored, "now.toml", {{"model.head_dim", "32"}});
  const std::string e = error_of([&] { check_same_model(stored, wide, "s.h5", "evaluate"); });
  EXPECT_NE(e.find("model.head_dim is 16 in the snapshot but 32 in this run"), std::string::npos)
      << e;
}

// A mixture of experts' shape keys are the model's shape too; its balancing keys are training's.
TEST_F(Provenance, TheExpertsShapeMayNotChange) {
  const Recipe saved = parse_recipe(
      "[model]\ndim = 64\nn_heads = 4\nn_layers = 3\nn_experts = 4\nmoe_ffn_dim = 32\n",
      "saved.toml");
  const std::string stored = saved.to_toml();
  const Recipe rebalanced = parse_recipe(stored, "now.toml",
                                         {{"model.router_bias_rate", "1e-3"},
                                          {"model.router_aux_coef", "1e-2"},
                                          {"model.capacity_factor", "1.25"}});
  EXPECT_EQ(error_of([&] { check_same_model(stored, rebalanced, "s.h5", "resume from"); }), "");
  for (const auto& [key, value] :
       std::vector<std::pair<std::string, std::string>>{{"n_experts", "8"},
                                                        {"n_shared_experts", "1"},
                                                        {"moe_ffn_dim", "64"},
                                                        {"dense_layers", "1"}}) {
    const Recipe changed = parse_recipe(stored, "now.toml", {{"model." + key, value}});
    const std::string e = error_of([&] { check_same_model(stored, changed, "s.h5", "evaluate"); });
    EXPECT_NE(e.find("cannot evaluate `s.h5`: model." + key + " is "), std::string::npos) << e;
    EXPECT_NE(e.find("but " + value + " in this run"), std::string::npos) << e;
  }
  // A dense model's unused expert keys are not its shape.
  const std::string dense = parse_recipe("[model]\ndim = 64\nn_heads = 4\n", "d.toml").to_toml();
  const Recipe dense_now = parse_recipe(dense, "now.toml", {{"model.moe_ffn_dim", "128"}});
  EXPECT_EQ(error_of([&] { check_same_model(dense, dense_now, "s.h5", "resume from"); }), "");
}

// RoPE scaling changes the angles, not a tensor: each of its keys named when changed.
TEST_F(Provenance, AChangedRopeScalingIsNamed) {
  const std::string stored =
      parse_recipe("[model]\ndim = 64\nn_heads = 4\nrope_scaling = \"linear\"\nrope_factor = 2.0\n",
                   "s.toml")
          .to_toml();
  const Recipe changed = parse_recipe(stored, "now.toml",
                                      {{"model.rope_scaling", "llama3"},
                                       {"model.rope_factor", "8.0"},
                                       {"model.rope_original_seq_len", "16"}});
  const auto c = changed_model_function(stored, changed, "s.h5");
  ASSERT_EQ(c.size(), 3u);
  EXPECT_EQ(c[0].rfind("model.rope_scaling: \"linear\" in the snapshot, \"llama3\" in this run", 0),
            0u)
      << c[0];
  EXPECT_EQ(c[1].rfind("model.rope_factor: 2 in the snapshot, 8 in this run", 0), 0u) << c[1];
  EXPECT_EQ(c[2].rfind("model.rope_original_seq_len: 8192 in the snapshot, 16 in this run", 0), 0u)
      << c[2];
}

// Keys that change what the weights compute but no tensor: allowed, and each named when changed.
TEST_F(Provenance, AChangedModelFunctionIsNamed) {
  const std::string stored =
      parse_recipe("[model]\ndim = 64\nn_heads = 4\nn_experts = 4\nmoe_ffn_dim = 32\n", "s.toml")
          .to_toml();
  const Recipe same = parse_recipe(stored, "now.toml", {{"train.lr", "1e-4"}});
  EXPECT_TRUE(changed_model_function(stored, same, "s.h5").empty());
  const Recipe changed = parse_recipe(stored, "now.toml",
                                      {{"model.experts_per_token", "1"},
                                       {"model.router_score", "sigmoid"},
                                       {"model.rope_theta", "500000"},
                                       {"model.capacity_factor", "1.25"},
                                       // No bias in the snapshot to route by: not named (the
                                       // restore refuses the missing bias tensor).
                                       {"model.router_bias_rate", "1e-3"}});
  const auto c = changed_model_function(stored, changed, "s.h5");
  ASSERT_EQ(c.size(), 4u);
  EXPECT_EQ(c[0].rfind("model.rope_theta: 10000 in the snapshot, 500000 in this run", 0), 0u)
      << c[0];
  EXPECT_EQ(c[1].rfind("model.experts_per_token: 2 in the snapshot, 1 in this run", 0), 0u) << c[1];
  EXPECT_NE(c[1].find("--set model.experts_per_token=1"), std::string::npos) << c[1];
  EXPECT_EQ(c[2].rfind("model.router_score: \"softmax\" in the snapshot, \"sigmoid\"", 0), 0u)
      << c[2];
  // Capacity drops slots in training and eval: another function of the same weights.
  EXPECT_EQ(c[3].rfind("model.capacity_factor: 0 in the snapshot, 1.25 in this run", 0), 0u)
      << c[3];
  // A snapshot's learned selection bias, set aside (rate 0) or moved at another rate.
  const std::string biased =
      parse_recipe(stored, "b.toml", {{"model.router_bias_rate", "1e-3"}}).to_toml();
  for (const std::string rate : {"0", "0.01"}) {
    const auto b = changed_model_function(
        biased, parse_recipe(biased, "now.toml", {{"model.router_bias_rate", rate}}), "s.h5");
    ASSERT_EQ(b.size(), 1u) << rate;
    EXPECT_EQ(
        b[0].rfind("model.router_bias_rate: 0.001 in the snapshot, " + rate + " in this run", 0),
        0u)
        << b[0];
  }
  EXPECT_TRUE(changed_model_function(biased, parse_recipe(biased, "now.toml"), "s.h5").empty());
}

TEST_F(Provenance, TheTokenizerMustBeTheRecordedOne) {
  const Recipe bytes = parse_recipe("", "r.toml");
  std::map<std::string, int64_t> none;  // made with the byte tokenizer: no hash recorded
  EXPECT_EQ(error_of([&] { check_same_tokenizer(none, bytes, "s.h5", "evaluate"); }), "");
  std::map<std::string, int64_t> recorded{{kTokenizerHashCounter, 12345}};
  const std::string e =
      error_of([&] { check_same_tokenizer(recorded, bytes, "s.h5", "evaluate"); });
  EXPECT_NE(e.find("made with a SentencePiece tokenizer"), std::string::npos) << e;
}

TEST_F(Provenance, TheDataHashFollowsTheFilesContent) {
  const fs::path data = dir / "corpus.txt";
  write(data, "first text");
  Recipe r = parse_recipe("", "r.toml");
  r.data.path = data.string();
  const int64_t first = data_hash(r);
  EXPECT_NE(first, 0);
  EXPECT_EQ(data_hash(r), first);  // a content hash, the same when read again
  write(data, "other text");
  EXPECT_NE(data_hash(r), first);
  r.data.path = (dir / "missing.txt").string();
  EXPECT_EQ(data_hash(r), 0);  // no readable file: nothing recorded
}
