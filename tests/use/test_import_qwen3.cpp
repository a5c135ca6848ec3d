// Qwen3 and Qwen3-MoE config.json both ways (no files): what each key maps to, the family export
// chooses for q/k norms and writes back unchanged, and what has no place in titan3d's block
// refused naming the key. End to end against PyTorch: tests/use/families.sh.
#include <gtest/gtest.h>

#include <algorithm>
#include <string>
#include <vector>

#include "kernels/check.h"
#include "runtime/use/export.h"
#include "runtime/use/import.h"

namespace t3d::runtime {
namespace {

const std::string kQwen3 = R"("architectures": ["Qwen3ForCausalLM"], "model_type": "qwen3",
    "vocab_size": 300, "hidden_size": 64, "num_hidden_layers": 2, "num_attention_heads": 4,
    "num_key_value_heads": 2, "intermediate_size": 128, "max_position_embeddings": 32,
    "rope_theta": 1000000.0, "rms_norm_eps": 1e-6, "tie_word_embeddings": true,
    "attention_bias": false, "sliding_window": null, "max_window_layers": 28,
    "use_sliding_window": false, "layer_types": ["full_attention", "full_attention"])";

const std::string kQwen3Moe = R"("architectures": ["Qwen3MoeForCausalLM"],
    "model_type": "qwen3_moe", "vocab_size": 256, "hidden_size": 64, "num_hidden_layers": 4,
    "num_attention_heads": 4, "num_key_value_heads": 2, "head_dim": 24,
    "intermediate_size": 128, "num_experts": 8, "num_experts_per_tok": 2,
    "moe_intermediate_size": 32, "router_aux_loss_coef": 0.001,
    "output_router_logits": false)";

bool noted(const std::vector<std::string>& notes, const std::string& what) {
  return std::any_of(notes.begin(), notes.end(),
                     [&](const std::string& n) { return n.find(what) != std::string::npos; });
}

// UserError from config `text`, its message naming c.json and `key`.
void expect_refused(const std::string& text, const std::string& key) {
  std::vector<std::string> notes;
  try {
    llama_model_from_config(text, "c.json", &notes);
    ADD_FAILURE() << key << ": accepted";
  } catch (const UserError& e) {
    EXPECT_NE(std::string(e.what()).find("c.json: `" + key + "`"), std::string::npos) << e.what();
  }
}

}  // namespace

// Qwen3: q/k norms always; head_dim when absent is Qwen3Config's 128 (said), not dim / n_heads;
// export writes Qwen3ForCausalLM back, attention_bias false and no sliding window.
TEST(use_ImportQwen3, Qwen3ConfigHasQkNormsAndItsOwnHeadDimDefault) {
  std::vector<std::string> notes;
  const ModelConfig m = llama_model_from_config("{" + kQwen3 + "}", "c.json", &notes);
  EXPECT_TRUE(m.qk_norm);
  EXPECT_FALSE(m.qkv_bias);
  EXPECT_EQ(m.head_dim(), 128);
  EXPECT_TRUE(noted(notes, "`head_dim`: 128"));
  EXPECT_EQ(hf_layout(m), HfLayout::kQwen3);
  const std::string exported = llama_config_json(m);
  EXPECT_NE(exported.find(R"("architectures": ["Qwen3ForCausalLM"])"), std::string::npos);
  EXPECT_NE(exported.find(R"("attention_bias": false)"), std::string::npos) << exported;
  EXPECT_NE(exported.find(R"("use_sliding_window": false)"), std::string::npos) << exported;
  EXPECT_NE(exported.find(R"("head_dim": 128)"), std::string::npos) << exported;
  EXPECT_EQ(llama_config_json(llama_model_from_config(exported, "e.json", &notes)), exported);
  const ModelConfig narrow =
      llama_model_from_config("{" + kQwen3 + R"(, "head_dim": 16})", "c.json", &notes);
  EXPECT_EQ(narrow.explicit_head_dim, 0) << "16 is dim / n_heads";
  EXPECT_TRUE(narrow.qk_norm);
}

TEST(use_ImportQwen3, Qwen3KeysWithoutAPlaceAreRefusedByName) {
  std::string bias = "{" + kQwen3 + "}";
  bias.replace(bias.find(R"("attention_bias": false)"), 23, R"("attention_bias": true)");
  expect_refused(bias, "attention_bias");
  std::string sliding = "{" + kQwen3 + "}";
  sliding.replace(sliding.find(R"("use_sliding_window": false)"), 27,
                  R"("use_sliding_window": true)");
  expect_refused(sliding, "use_sliding_window");
  std::string kinds = "{" + kQwen3 + "}";
  kinds.replace(kinds.find(R"(["full_attention", "full_attention"])"), 36,
                R"(["full_attention", "sliding_attention"])");
  expect_refused(kinds, "layer_types");
  // Qwen2's config in newer transformers carries layer_types too: all full attention is taken.
  std::string qwen2 = "{" + kQwen3 + "}";
  qwen2.replace(qwen2.find(R"(["Qwen3ForCausalLM"], "model_type": "qwen3")"), 43,
                R"(["Qwen2ForCausalLM"], "model_type": "qwen2")");
  qwen2.replace(qwen2.find(R"("attention_bias": false, )"), 24, "");
  std::vector<std::string> notes;
  EXPECT_TRUE(llama_model_from_config(qwen2, "c.json", &notes).qkv_bias);
  qwen2.replace(qwen2.find(R"(["full_attention", "full_attention"])"), 36,
                R"(["sliding_attention", "full_attention"])");
  expect_refused(qwen2, "layer_types");
  expect_refused("{" + kQwen3 + R"(, "num_experts": 4})", "num_experts");  // not Qwen3's key
}

// Qwen3-MoE: experts without a shared one, norm_topk_prob (default false, said), the dense blocks
// from mlp_only_layers and decoder_sparse_step when they are the leading ones, else refused.
TEST(use_ImportQwen3, Qwen3MoeConfigMapsOntoTheBlock) {
  std::vector<std::string> notes;
  const ModelConfig m = llama_model_from_config("{" + kQwen3Moe + "}", "c.json", &notes);
  EXPECT_TRUE(m.qk_norm);
  EXPECT_EQ(m.n_experts, 8);
  EXPECT_EQ(m.experts_per_token, 2);
  EXPECT_EQ(m.moe_ffn_dim, 32);
  EXPECT_EQ(m.n_shared_experts, 0);
  EXPECT_EQ(m.dense_layers, 0);
  EXPECT_EQ(m.ffn_dim, 128);
  EXPECT_EQ(m.head_dim(), 24);
  EXPECT_FALSE(m.router_norm_topk);
  EXPECT_TRUE(noted(notes, "norm_topk_prob"));
  EXPECT_TRUE(noted(notes, "router_aux_loss_coef"));
  EXPECT_EQ(hf_layout(m), HfLayout::kQwen3Moe);
  EXPECT_EQ(hf_tensor_name(m, "model.layers.1.mlp.router.weight"),
            "model.layers.1.mlp.gate.weight");
  EXPECT_EQ(hf_tensor_name(m, "model.layers.1.mlp.experts.3.up_proj.weight"),
            "model.layers.1.mlp.experts.3.up_proj.weight");
  const auto with = [&](const std::string& keys) {
    return llama_model_from_config("{" + kQwen3Moe + ", " + keys + "}", "c.json", &notes);
  };
  const ModelConfig normalised = with(R"("norm_topk_prob": true, "mlp_only_layers": [0, 1])");
  EXPECT_TRUE(normalised.router_norm_topk);
  EXPECT_EQ(normalised.dense_layers, 2);
  // Every second block sparse over 2 blocks: block 0 dense, block 1 a mixture: leading.
  std::string two = "{" + kQwen3Moe + R"(, "decoder_sparse_step": 2})";
  two.replace(two.find(R"("num_hidden_layers": 4)"), 22, R"("num_hidden_layers": 2)");
  EXPECT_EQ(llama_model_from_config(two, "c.json", &notes).dense_layers, 1);
  // Export writes the family back, the same config again.
  const std::string exported = llama_config_json(normalised);
  EXPECT_NE(exported.find(R"("architectures": ["Qwen3MoeForCausalLM"])"), std::string::npos);
  EXPECT_NE(exported.find(R"("mlp_only_layers": [0, 1])"), std::string::npos) << exported;
  EXPECT_EQ(exported.find("shared_expert"), std::string::npos) << exported;
  EXPECT_EQ(llama_config_json(llama_model_from_config(exported, "e.json", &notes)), exported);

  expect_refused("{" + kQwen3Moe + R"(, "mlp_only_layers": [1]})", "mlp_only_layers");
  expect_refused("{" + kQwen3Moe + R"(, "decoder_sparse_step": 2})", "decoder_sparse_step");
  expect_refused("{" + kQwen3Moe + R"(, "mlp_only_layers": [0, 1, 2, 3]})", "mlp_only_layers");
  expect_refused("{" + kQwen3Moe + R"(, "mlp_only_layers": [7]})", "mlp_only_layers");
  expect_refused("{" + kQwen3Moe + R"(, "shared_expert_intermediate_size": 32})",
                 "shared_expert_intermediate_size");
}

// What Qwen3's families cannot hold is refused at export naming the recipe key: q/k/v biases
// with q/k norms (its attention_bias would bias o_proj too), a Qwen3-MoE with shared experts.
TEST(use_ImportQwen3, ExportRefusesWhatQwen3sFamiliesCannotHold) {
  ModelConfig m;
  m.qk_norm = true;
  EXPECT_NO_THROW(check_hf_layout(m, "s.h5"));
  const auto refused = [](const ModelConfig& c, const std::string& key) {
    try {
      check_hf_layout(c, "s.h5");
      ADD_FAILURE() << key;
    } catch (const UserError& e) {
      EXPECT_NE(std::string(e.what()).find(key), std::string::npos) << e.what();
    }
  };
  m.qkv_bias = true;
  refused(m, "model.qkv_bias");
  m.qkv_bias = false;
  m.n_experts = 4, m.experts_per_token = 2, m.moe_ffn_dim = 32, m.n_shared_experts = 1;
  EXPECT_EQ(hf_layout(m), HfLayout::kQwen3Moe);
  refused(m, "model.n_shared_experts");
  m.n_shared_experts = 0, m.dense_layers = 1;
  EXPECT_NO_THROW(check_hf_layout(m, "s.h5")) << "Qwen3-MoE's dense blocks need no shared expert";
  m.router_score = kernels::RouterScore::kSigmoid;
  refused(m, "model.router_score");
}

// Mistral (MistralForCausalLM) is LLaMA's block when its sliding window is null: imported as the
// LLaMA layout (exported back as LlamaForCausalLM); a window is refused naming it.
TEST(use_ImportQwen3, MistralWithoutAWindowIsLlama) {
  const std::string mistral = R"({"architectures": ["MistralForCausalLM"], "model_type": "mistral",
      "vocab_size": 256, "hidden_size": 64, "num_hidden_layers": 2, "num_attention_heads": 4,
      "num_key_value_heads": 2, "intermediate_size": 128, "max_position_embeddings": 32,
      "rope_theta": 1000000.0, "rms_norm_eps": 1e-5, "head_dim": null, "attention_dropout": 0.0,
      "hidden_act": "silu", "tie_word_embeddings": false, "sliding_window": null})";
  std::vector<std::string> notes;
  const ModelConfig m = llama_model_from_config(mistral, "c.json", &notes);
  EXPECT_FALSE(m.qk_norm || m.qkv_bias || m.moe());
  EXPECT_EQ(m.head_dim(), 16);
  EXPECT_EQ(hf_layout(m), HfLayout::kLlama);
  EXPECT_NE(llama_config_json(m).find(R"("architectures": ["LlamaForCausalLM"])"),
            std::string::npos);
  std::string windowed = mistral;
  windowed.replace(windowed.find(R"("sliding_window": null)"), 22, R"("sliding_window": 4096)");
  expect_refused(windowed, "sliding_window");
}

}  // namespace t3d::runtime
