// The model spec table against sizes worked out by hand for a small model, and the rules that
// relate its variants: bf16 copies halve exactly the stored block tensors, checkpointing drops
// exactly the recomputed blocks (and adds one work block to the scratch), the split backward
// adds the W pass's gradients, and the parameter arithmetic is the layout the Model builds.
#include <gtest/gtest.h>

#include <algorithm>
#include <map>
#include <set>

#include "kernels/arena.h"
#include "kernels/check.h"
#include "runtime/model/model_spec.h"

namespace t3d::runtime {
namespace {

// N = B·T = 2·32 = 64 rows, C = 64, D = 16, H = 4, Hkv = 2, F = 176, V = 96.
ModelConfig small_model() {
  ModelConfig m;
  m.vocab_size = 96;
  m.dim = 64;
  m.n_layers = 4;
  m.n_heads = 4;
  m.n_kv_heads = 2;
  m.ffn_dim = 176;
  m.seq_len = 32;
  return m;
}

// Bytes of one block's fp32 activations: rstd1, rstd2 (64 floats each); xn1, q, attn, xmid, xn2
// (64·64 floats); k, v (64·32); lse (2·4·32); gate, up, h (64·176).
constexpr size_t kRstd = 256, kRowsC = 16384, kKv = 8192, kLse = 1024, kFfn = 45056;
constexpr size_t kBlock = 2 * kRstd + 5 * kRowsC + 2 * kKv + kLse + 3 * kFfn;  // 235008
constexpr size_t kBlockStatistics = 2 * kRstd + kLse;
// The whole model in one chunk, per micro-batch: 5 residual streams, 4 blocks, the token ids,
// the final norm output, its rstd and the loss gradient.
constexpr size_t kWholeSlot = 5 * kRowsC + 4 * kBlock + kRstd + kRowsC + kRstd + kRowsC;
// Scratch: tmp, dx, dtmp, dxn, datt, dq; dk, dv; dh, dgate, dup; attention tiles
// (2·64² + 2·64 floats); logits (64·96); losses, the targets (int32) and three CE statistics;
// the RoPE table (32·16).
constexpr size_t kScratch =
    6 * kRowsC + 2 * kKv + 3 * kFfn + 33280 + 24576 + 5 * kRstd + 2048;  // 311040

ActivationSpec whole_model(SpecOptions o, int64_t slots = 1) {
  o.micro_rows = 2;
  o.chunk_slots = {slots};
  return activation_spec(small_model(), {{{0, 4, true, true}}, 1}, o);
}

TEST(ModelSpec, Fp32SizesAreTheHandCountedOnes) {
  EXPECT_EQ(kBlock, 235008u);
  const ActivationSpec spec = whole_model({}, 3);
  ASSERT_EQ(spec.chunks.size(), 1u);
  EXPECT_EQ(spec.chunks[0].slot_bytes(), kWholeSlot);
  EXPECT_EQ(spec.activation_bytes(), 3 * kWholeSlot);
  EXPECT_EQ(spec.scratch_bytes(), kScratch);
  for (const auto& t : spec.chunks[0].per_slot) EXPECT_NE(t.dtype, Dtype::kBF16) << t.name();
}

TEST(ModelSpec, MiddleChunkKeepsItsInputGradientAndNoHead) {
  SpecOptions o;
  o.micro_rows = 2;
  o.chunk_slots = {1};
  const ActivationSpec spec = activation_spec(small_model(), {{{1, 3, false, false}}, 1}, o);
  // 3 residual streams, 2 blocks, the input gradient.
  EXPECT_EQ(spec.chunks[0].slot_bytes(), 3 * kRowsC + 2 * kBlock + kRowsC);
  EXPECT_EQ(spec.scratch_bytes(), kScratch - 24576 - 5 * kRstd);  // no logits, loss, targets
}

TEST(ModelSpec, Bf16CopiesHalveExactlyTheStoredBlockTensors) {
  SpecOptions o;
  o.storage = ActivationStorage::kBf16Copies;
  const ActivationSpec spec = whole_model(o);
  const size_t halved = (kBlock - kBlockStatistics) / 2;
  EXPECT_EQ(spec.chunks[0].slot_bytes(), kWholeSlot - 4 * halved);
  // One fp32 work block every stored block computes in, and the bf16 TP buffer.
  EXPECT_EQ(spec.scratch_bytes(), kScratch + kBlock + kRowsC / 2);
  // The codec's rows: the ten large tensors in bf16, then the three statistics in fp32, each
  // group in block order (a dense block's 13: the mixture-of-experts rows are absent).
  ASSERT_EQ(spec.stored_block.size(), 13u);
  for (size_t i = 0; i < spec.stored_block.size(); ++i)
    EXPECT_EQ(spec.stored_block[i].dtype, i < 10 ? Dtype::kBF16 : Dtype::kF32) << i;
  EXPECT_EQ(spec.stored_block[10].index, static_cast<int>(BlockAct::kRstd1));
  EXPECT_EQ(spec.stored_block[11].index, static_cast<int>(BlockAct::kLse));
  EXPECT_EQ(spec.stored_block[12].index, static_cast<int>(BlockAct::kRstd2));
}

TEST(ModelSpec, Bf16EverywhereHalvesEveryActivationSizedTensor) {
  SpecOptions o;
  o.storage = ActivationStorage::kBf16;
  const ActivationSpec spec = whole_model(o);
  const size_t statistics = 4 * kBlockStatistics + kRstd /* ids */ + kRstd /* final rstd */;
  EXPECT_EQ(spec.chunks[0].slot_bytes(), statistics + (kWholeSlot - statistics) / 2);
  // tiles, logits, losses, targets, CE statistics, RoPE: not halved
  const size_t fp32 = 33280 + 24576 + 5 * kRstd + 2048;
  EXPECT_EQ(spec.scratch_bytes(), fp32 + (kScratch - fp32) / 2);
}

TEST(ModelSpec, CheckpointingDropsExactlyTheRecomputedBlocks) {
  for (int64_t every : {1, 2, 3}) {
    SCOPED_TRACE(every);
    SpecOptions o;
    o.checkpoint_every = every;
    const ActivationSpec spec = whole_model(o);
    const int64_t recomputed = recomputed_blocks(4, every);  // blocks 0, K, 2K, ...
    EXPECT_EQ(recomputed, every == 1 ? 4 : 2);
    EXPECT_EQ(spec.chunks[0].slot_bytes(), kWholeSlot - recomputed * kBlock);
    EXPECT_EQ(spec.scratch_bytes(), kScratch + kBlock);  // the block being recomputed
    for (const auto& t : spec.chunks[0].per_slot) {
      if (t.role == SpecTensor::Role::kBlock) {
        EXPECT_FALSE(recomputed_block(t.layer, every));
      }
    }
  }
}

TEST(ModelSpec, SplitBackwardKeepsTheWGradientsOfStoredBlocks) {
  // dy_down, dy_o (64·64), dgate, dup (64·176), dq (64·64), dk, dv (64·32).
  const size_t wgrads = 2 * kRowsC + 2 * kFfn + kRowsC + 2 * kKv;
  SpecOptions o;
  o.split_backward = true;
  EXPECT_EQ(whole_model(o).chunks[0].slot_bytes(), kWholeSlot + 4 * wgrads);
  o.checkpoint_every = 2;  // recomputed blocks do all of their backward in B
  EXPECT_EQ(whole_model(o).chunks[0].slot_bytes(), kWholeSlot - 2 * kBlock + 2 * wgrads);
}

TEST(ModelSpec, SequenceAndContextParallelismSliceTheRows) {
  SpecOptions o;
  o.micro_rows = 2;
  o.chunk_slots = {1};
  const ModelConfig m = small_model();
  const ActivationSpec sp = activation_spec(m, {{{0, 4, true, true}}, 2, true, 1}, o);
  EXPECT_TRUE(sp.dims.sp);
  EXPECT_EQ(sp.dims.Nl, 32);
  EXPECT_EQ(sp.dims.H, 2);
  EXPECT_EQ(sp.dims.V, 48);
  const ActivationSpec cp = activation_spec(m, {{{0, 4, true, true}}, 1, false, 2}, o);
  EXPECT_EQ(cp.dims.T, 16);
  EXPECT_EQ(cp.dims.parts, 2);
  EXPECT_EQ(cp.dims.part_len, 8);
  EXPECT_EQ(cp.dims.N, 32);
  int cp_rows = 0;
  for (const auto& t : cp.scratch)
    if (t.name().rfind("scratch.cp_", 0) == 0) {
      ++cp_rows;
      // The whole sequence's keys or values: B·seq_len·Hkv·D, twice for the part gradients.
      EXPECT_EQ(t.elems,
                (t.index == static_cast<int>(ScratchBuf::kCpKeyValuePart) ? 2 : 1) * 2 * 32 * 32);
    }
  EXPECT_EQ(cp_rows, 6);
  ModelConfig odd = m;
  odd.seq_len = 30;  // not 4 equal parts
  EXPECT_THROW(activation_spec(odd, {{{0, 4, true, true}}, 1, false, 2}, o), UserError);
}

TEST(ModelSpec, NamesAreTheArenaNames) {
  SpecOptions o;
  o.storage = ActivationStorage::kBf16Copies;
  o.checkpoint_every = 2;
  o.split_backward = true;
  const ActivationSpec spec = whole_model(o);
  std::vector<std::string> names;
  for (const auto& t : spec.chunks[0].per_slot) names.push_back(t.name());
  for (const auto& t : spec.scratch) names.push_back(t.name());
  for (const char* want : {"residual4", "layer1.xn1.bf16", "layer1.rstd1", "layer3.wgrad.dy_o",
                           "tokens", "final_norm", "final_rstd", "loss_grad",
                           "scratch.layer_work.lse", "scratch.tp_bf16", "scratch.rope_table"})
    EXPECT_NE(std::find(names.begin(), names.end(), want), names.end()) << want;
  for (const char* absent : {"layer0.xn1.bf16", "layer2.wgrad.dq", "input_grad", "residual5"})
    EXPECT_EQ(std::find(names.begin(), names.end(), absent), names.end()) << absent;
}

TEST(ModelSpec, ParameterUnitsAreTheLayoutTheModelBuilds) {
  const ModelConfig m = small_model();
  // One block on one tp rank: two norms (64), q and o (64·64), k and v (32·64), gate, up and
  // down (176·64), each on a 16-float boundary (all already are).
  EXPECT_EQ(block_param_floats(m, 1), 2 * 64 + 2 * 4096 + 2 * 2048 + 3 * 11264);
  for (int64_t tp : {1, 2}) {
    // ZB-V's stage 0: the first chunk and the last.
    const std::vector<parallel::LayerRange> chunks = {{0, 1, true, false}, {3, 4, false, true}};
    const auto params = param_table(m, chunks);
    std::vector<kernels::TensorSpec> table;
    for (const auto& p : params) {
      auto shape = p.global_shape;
      if (p.split_dim >= 0) shape[p.split_dim] /= tp;
      table.push_back({p.name, shape});
    }
    const kernels::ParamLayout layout(table);
    const ParamUnits units = param_units(m, chunks, tp);
    EXPECT_EQ(units.total_floats, layout.total_floats());
    ASSERT_EQ(units.units.size(), 4u);  // embedding, block 0, block 3, norm + LM head
    const auto& e = layout.entries();
    EXPECT_EQ(units.units[0].unit, -1);
    EXPECT_EQ(units.units[0].end, e[0].offset + e[0].numel);
    EXPECT_EQ(units.units[1].unit, 0);
    EXPECT_EQ(units.units[1].begin, e[1].offset);
    EXPECT_EQ(units.units[1].end, e[9].offset + e[9].numel);
    EXPECT_EQ(units.units[2].unit, 3);
    EXPECT_EQ(units.units[3].unit, m.n_layers);
    EXPECT_EQ(units.units[3].end, e.back().offset + e.back().numel);
    EXPECT_EQ(params.back().name, "lm_head.weight");
  }
}

TEST(ModelSpec, ParameterTableIsLlamasWithItsHuggingFaceNames) {
  for (const bool tied : {false, true}) {
    SCOPED_TRACE(tied);
    ModelConfig m = small_model();
    m.n_layers = 2;
    m.tie_embeddings = tied;
    const auto params = param_table(m);
    struct Want {
      std::string name;
      std::vector<int64_t> shape;
      int split_dim;
      ParamInit init;
      int64_t unit;
    };
    using enum ParamInit;
    std::vector<Want> want = {{"model.embed_tokens.weight", {96, 64}, 0, kNormal, -1}};
    for (int64_t l = 0; l < 2; ++l) {
      const std::string p = "model.layers." + std::to_string(l) + ".";
      for (const Want& w :
           std::vector<Want>{{"input_layernorm.weight", {64}, -1, kOnes, l},
                             {"self_attn.q_proj.weight", {64, 64}, 0, kNormal, l},
                             {"self_attn.k_proj.weight", {32, 64}, 0, kNormal, l},
                             {"self_attn.v_proj.weight", {32, 64}, 0, kNormal, l},
                             {"self_attn.o_proj.weight", {64, 64}, 1, kResidualOut, l},
                             {"post_attention_layernorm.weight", {64}, -1, kOnes, l},
                             {"mlp.gate_proj.weight", {176, 64}, 0, kNormal, l},
                             {"mlp.up_proj.weight", {176, 64}, 0, kNormal, l},
                             {"mlp.down_proj.weight", {64, 176}, 1, kResidualOut, l}})
        want.push_back({p + w.name, w.shape, w.split_dim, w.init, w.unit});
    }
    want.push_back({"model.norm.weight", {64}, -1, kOnes, 2});
    if (!tied) want.push_back({"lm_head.weight", {96, 64}, 0, kNormal, 2});
    ASSERT_EQ(params.size(), want.size());
    for (size_t i = 0; i < want.size(); ++i) {
      EXPECT_EQ(params[i].name, want[i].name) << i;
      EXPECT_EQ(params[i].global_shape, want[i].shape) << want[i].name;
      EXPECT_EQ(params[i].split_dim, want[i].split_dim) << want[i].name;
      EXPECT_EQ(params[i].decay, want[i].init != kOnes) << want[i].name;
      EXPECT_EQ(params[i].init, want[i].init) << want[i].name;
      EXPECT_EQ(params[i].unit, want[i].unit) << want[i].name;
    }
    EXPECT_EQ(block_param_name(1, BlockWeight::kDown), "model.layers.1.mlp.down_proj.weight");
  }
}

// model.head_dim = 24 over dim 64 and 4 heads: q and o are 96 wide, k and v 48, the RoPE table
// and attention are over 24-wide heads; nothing else changes.
TEST(ModelSpec, HeadDimSetsTheAttentionShapesOnly) {
  ModelConfig m = small_model();
  m.explicit_head_dim = 24;
  std::map<std::string, std::vector<int64_t>> shape;
  for (const ParamInfo& p : param_table(m)) shape[p.name] = p.global_shape;
  const std::string p = "model.layers.0.";
  EXPECT_EQ(shape[p + "self_attn.q_proj.weight"], (std::vector<int64_t>{96, 64}));
  EXPECT_EQ(shape[p + "self_attn.k_proj.weight"], (std::vector<int64_t>{48, 64}));
  EXPECT_EQ(shape[p + "self_attn.v_proj.weight"], (std::vector<int64_t>{48, 64}));
  EXPECT_EQ(shape[p + "self_attn.o_proj.weight"], (std::vector<int64_t>{64, 96}));
  EXPECT_EQ(shape[p + "mlp.down_proj.weight"], (std::vector<int64_t>{64, 176}));
  const ModelDims d = model_dims(m, {{{0, 4, true, true}}, 2}, 2);
  EXPECT_EQ(d.D, 24);
  EXPECT_EQ(d.H, 2);  // tp = 2 splits whole heads
  EXPECT_EQ(d.C, 64);
}

// model.qkv_bias: per block q/k/v biases after v_proj (split with the heads, no weight decay,
// zero at init) and a column of N ones in the scratch; nothing without it.
TEST(ModelSpec, QkvBiasAddsTheBiasesAndTheOnesColumn) {
  ModelConfig m = small_model();
  m.n_layers = 1;
  m.qkv_bias = true;
  const auto params = param_table(m);
  ASSERT_GE(params.size(), 7u);
  const std::string p = "model.layers.0.self_attn.";
  const std::vector<std::pair<std::string, int64_t>> want = {
      {p + "q_proj.bias", 64}, {p + "k_proj.bias", 32}, {p + "v_proj.bias", 32}};
  for (size_t i = 0; i < want.size(); ++i) {
    const ParamInfo& b = params[5 + i];  // embedding, ln1, q, k, v, then the biases
    EXPECT_EQ(b.name, want[i].first);
    EXPECT_EQ(b.global_shape, std::vector<int64_t>{want[i].second});
    EXPECT_EQ(b.split_dim, 0);
    EXPECT_FALSE(b.decay);
    EXPECT_EQ(b.init, ParamInit::kZeros);
  }
  const auto ones = [](const ActivationSpec& spec) {
    return std::count_if(spec.scratch.begin(), spec.scratch.end(),
                         [](const SpecTensor& t) { return t.name() == "scratch.ones"; });
  };
  SpecOptions o;
  o.micro_rows = 2;
  o.chunk_slots = {1};
  EXPECT_EQ(ones(activation_spec(m, {{{0, 1, true, true}}, 1}, o)), 1);
  m.qkv_bias = false;
  EXPECT_EQ(ones(activation_spec(m, {{{0, 1, true, true}}, 1}, o)), 0);
  EXPECT_EQ(param_table(m).size(), params.size() - 3);
}

TEST(ModelSpec, TpShardBoxIsTheRankSliceOfTheSplitDimension) {
  ParamInfo q{"q", {64, 32}, 0};
  ParamInfo o{"o", {32, 64}, 1};
  ParamInfo norm{"norm", {32}, -1};
  EXPECT_EQ(tp_shard_box(q, 4, 3).offset, (std::vector<int64_t>{48, 0}));
  EXPECT_EQ(tp_shard_box(q, 4, 3).shape, (std::vector<int64_t>{16, 32}));
  EXPECT_EQ(tp_shard_box(o, 2, 1).offset, (std::vector<int64_t>{0, 32}));
  EXPECT_EQ(tp_shard_box(o, 2, 1).shape, (std::vector<int64_t>{32, 32}));
  EXPECT_EQ(tp_shard_box(norm, 2, 1).offset, (std::vector<int64_t>{0}));
  EXPECT_EQ(tp_shard_box(norm, 2, 1).numel(), 32);
}

TEST(ModelSpec, FlopsAreTheHandCountedOnes) {
  const ModelConfig m = small_model();  // C 64, D 16, H 4, Hkv 2, F 176, V 96, T 32
  for (int64_t tp : {1, 2}) {
    const double H = 4.0 / tp, Hkv = 2.0 / tp, F = 176.0 / tp, C = 64, D = 16, T = 32;
    const BlockFlops f = block_flops_per_token(m, tp);
    EXPECT_EQ(f.matmul, 2 * (2 * H * D * C + 2 * Hkv * D * C + 3 * F * C));
    EXPECT_EQ(f.attention, 4 * H * D * T);
    EXPECT_EQ(f.train(), 3 * f.matmul + 3 * f.attention);
    EXPECT_EQ(head_train_flops_per_token(m, tp), 6 * (96.0 / tp) * C);
  }
  // PaLM's count: 6 per matmul weight (blocks and the LM head) + 12·L·H·D·T.
  const double per_layer = 64.0 * 4 * 16 * 2 + 2 * 64.0 * 2 * 16 + 3 * 64.0 * 176;
  EXPECT_EQ(model_train_flops_per_token(m),
            6.0 * (4 * per_layer + 64.0 * 96) + 12.0 * 4 * 4 * 16 * 32);
}

// Each row of T3D_BLOCK_ACTS, T3D_WGRADS and T3D_SCRATCH has its own name, and the scratch rows
// are allocated in their table's order (the work block before the TP staging buffers).
// A mixture of experts after a dense block: 4 experts, 2 per token, a shared expert, the
// auxiliary loss (every scratch row).
ModelConfig small_moe_model() {
  ModelConfig m = small_model();
  m.n_experts = 4;
  m.experts_per_token = 2;
  m.n_shared_experts = 1;
  m.moe_ffn_dim = 32;
  m.dense_layers = 1;
  m.router_aux_coef = 0.01;
  return m;
}

// A dense block's and a mixture-of-experts block's own rows (per micro-batch of N tokens): the
// dense MLP's gate, up, h (N·F each); the router's scores (N·E), chosen, the routing's two slot
// maps and gates (N·K each), the experts' gate, up, h per token slot (N·K·Fe each), the shared
// experts' (N·Fs each).
TEST(ModelSpec, MoeBlocksKeepTheirOwnRows) {
  SpecOptions o;
  o.micro_rows = 1;
  o.chunk_slots = {1};
  const ModelConfig m = small_moe_model();
  const ActivationSpec spec = activation_spec(m, {{{0, 4, true, true}}, 1}, o);
  const int64_t N = 32, E = 4, K = 2;
  std::map<int64_t, int64_t> own;  // layer -> floats of its MLP rows
  for (const auto& t : spec.chunks[0].per_slot) {
    if (t.role != SpecTensor::Role::kBlock) continue;
    const auto row = static_cast<BlockAct>(t.index);
    if (row >= BlockAct::kGate) own[t.layer] += t.elems;
  }
  EXPECT_EQ(own[0], 3 * N * 176);
  for (int64_t l = 1; l < 4; ++l)
    EXPECT_EQ(own[l], N * E + 4 * N * K + 3 * N * K * 32 + 3 * N * 32) << "layer " << l;
  // Split backward keeps what W needs for every weight-gradient GEMM of a block: a dense block's
  // MLP and attention; a MoE block's shared experts (dy_down, dgate, dup: N·C, N·Fs, N·Fs), routed
  // experts (expert_dy, expert_dgate, expert_dup over the R = N·K rows: R·(C + 2·Fe)), router
  // (router_dlogits, N·E, fp32) and attention.
  o.split_backward = true;
  const ActivationSpec split = activation_spec(m, {{{0, 4, true, true}}, 1}, o);
  std::map<int64_t, std::set<int>> deferred;  // layer -> its WGrad rows
  std::map<int64_t, int64_t> mlp_floats;      // layer -> floats of its MLP's W rows
  for (const auto& t : split.chunks[0].per_slot) {
    if (t.role != SpecTensor::Role::kWGrad) continue;
    deferred[t.layer].insert(t.index);
    const auto w = static_cast<WGrad>(t.index);
    if (w != WGrad::kDyO && w != WGrad::kDq && w != WGrad::kDk && w != WGrad::kDv)
      mlp_floats[t.layer] += t.elems;
    EXPECT_EQ(t.dtype, Dtype::kF32) << t.name();
  }
  const auto row = [](WGrad w) { return static_cast<int>(w); };
  const std::set<int> attention = {row(WGrad::kDyO), row(WGrad::kDq), row(WGrad::kDk),
                                   row(WGrad::kDv)};
  std::set<int> dense = attention, moe = attention;
  for (const WGrad w : {WGrad::kDyDown, WGrad::kDgate, WGrad::kDup}) {
    dense.insert(row(w));
    moe.insert(row(w));
  }
  for (const WGrad w :
       {WGrad::kExpertDy, WGrad::kExpertDgate, WGrad::kExpertDup, WGrad::kRouterDlogits})
    moe.insert(row(w));
  EXPECT_EQ(deferred[0], dense);
  EXPECT_EQ(mlp_floats[0], N * 64 + 2 * N * 176);
  const int64_t C = 64, Fe = 32, Fs = 32, R = N * K;
  for (int64_t l = 1; l < 4; ++l) {
    EXPECT_EQ(deferred[l], moe) << "layer " << l;
    EXPECT_EQ(mlp_floats[l], N * C + 2 * N * Fs + R * (C + 2 * Fe) + N * E) << "layer " << l;
  }
  // Without shared experts a MoE block keeps no SwiGLU rows of its own.
  ModelConfig routed_only = m;
  routed_only.n_shared_experts = 0;
  for (const auto& t :
       activation_spec(routed_only, {{{0, 4, true, true}}, 1}, o).chunks[0].per_slot)
    if (t.role == SpecTensor::Role::kWGrad && t.layer > 0) {
      EXPECT_TRUE(t.index != row(WGrad::kDyDown) && t.index != row(WGrad::kDgate) &&
                  t.index != row(WGrad::kDup))
          << t.name();
    }
}

TEST(ModelSpec, MoeParameterTableHasATensorPerExpert) {
  const ModelConfig m = [] {
    ModelConfig c = small_moe_model();
    c.router_bias_rate = 1e-3;
    return c;
  }();
  std::map<std::string, std::vector<int64_t>> shapes;
  // Block 1's tensors and its experts' unit, in layout order.
  std::vector<std::string> block1, experts1;
  const auto table = param_table(m);
  bool experts_seen = false;
  for (const auto& p : table) {
    shapes[p.name] = p.global_shape;
    if (p.unit == 1) block1.push_back(p.name);
    if (p.unit == experts_unit(m, 1)) experts1.push_back(p.name);
    EXPECT_EQ(p.trained(), p.name.find("router.bias") == std::string::npos) << p.name;
    // The experts' units follow every other unit: the state groups are contiguous.
    const bool expert = state_group(m, p.unit) == StateGroup::kExperts;
    EXPECT_EQ(expert, p.expert >= 0) << p.name;
    EXPECT_TRUE(expert || !experts_seen) << p.name << " follows an expert";
    experts_seen |= expert;
  }
  const std::vector<std::string> mlp(block1.begin() + 6, block1.end());
  EXPECT_EQ(mlp, (std::vector<std::string>{"model.layers.1.mlp.router.weight",
                                           "model.layers.1.mlp.router.bias",
                                           "model.layers.1.mlp.shared_experts.gate_proj.weight",
                                           "model.layers.1.mlp.shared_experts.up_proj.weight",
                                           "model.layers.1.mlp.shared_experts.down_proj.weight"}));
  // Each projection's E experts back to back (the stack the grouped pass reads).
  const std::string e = "model.layers.1.mlp.experts.";
  EXPECT_EQ(experts1,
            (std::vector<std::string>{
                e + "0.gate_proj.weight", e + "1.gate_proj.weight", e + "2.gate_proj.weight",
                e + "3.gate_proj.weight", e + "0.up_proj.weight", e + "1.up_proj.weight",
                e + "2.up_proj.weight", e + "3.up_proj.weight", e + "0.down_proj.weight",
                e + "1.down_proj.weight", e + "2.down_proj.weight", e + "3.down_proj.weight"}));
  EXPECT_EQ(unit_block(m, experts_unit(m, 1)), 1);
  // Expert parallelism: EP rank 1 of 2 holds experts 2 and 3 under their global names, and
  // nothing else differs.
  std::vector<std::string> share1, dense;
  for (const auto& p :
       param_table(m, {parallel::LayerRange{0, m.n_layers, true, true}}, expert_share(m, 2, 1))) {
    if (p.unit == experts_unit(m, 1)) share1.push_back(p.name);
    if (p.expert < 0) dense.push_back(p.name);
  }
  EXPECT_EQ(share1, (std::vector<std::string>{e + "2.gate_proj.weight", e + "3.gate_proj.weight",
                                              e + "2.up_proj.weight", e + "3.up_proj.weight",
                                              e + "2.down_proj.weight", e + "3.down_proj.weight"}));
  std::vector<std::string> all_dense;
  for (const auto& p : table)
    if (p.expert < 0) all_dense.push_back(p.name);
  EXPECT_EQ(dense, all_dense);
  EXPECT_EQ(shapes.count("model.layers.0.mlp.gate_proj.weight"), 1u);
  EXPECT_EQ(shapes.count("model.layers.0.mlp.router.weight"), 0u);
  EXPECT_EQ(shapes.count("model.layers.1.mlp.gate_proj.weight"), 0u);
  EXPECT_EQ(shapes["model.layers.1.mlp.router.weight"], (std::vector<int64_t>{4, 64}));
  EXPECT_EQ(shapes["model.layers.1.mlp.router.bias"], (std::vector<int64_t>{4}));
  EXPECT_EQ(shapes["model.layers.3.mlp.experts.3.gate_proj.weight"],
            (std::vector<int64_t>{32, 64}));
  EXPECT_EQ(shapes["model.layers.3.mlp.experts.2.down_proj.weight"],
            (std::vector<int64_t>{64, 32}));
  EXPECT_EQ(shapes["model.layers.2.mlp.shared_experts.down_proj.weight"],
            (std::vector<int64_t>{64, 32}));
  // Flops: the routed experts count K/E of their matrices (2 of 4 here).
  const int64_t attention = 2 * (64 * 64 + 2 * 32 * 64 + 64 * 64);
  const int64_t moe = 2 * (4 * 64 + 3 * 32 * 64 * 4 / 2 + 3 * 32 * 64);
  EXPECT_EQ(block_flops_per_token(m, 1, 1).matmul, static_cast<double>(attention + moe));
  EXPECT_EQ(block_flops_per_token(m, 1, 0).matmul,
            static_cast<double>(attention + 2 * 3 * 176 * 64));
}

// model.qk_norm: per block q_norm and k_norm of head_dim after o_proj (replicated over tp, ones,
// no weight decay), and per block the raw q, k (this rank's heads) and their per-head rstd;
// nothing without it.
TEST(ModelSpec, QkNormAddsTheNormsAndTheirActivations) {
  ModelConfig m = small_model();
  m.n_layers = 1;
  m.qk_norm = true;
  m.explicit_head_dim = 24;
  const auto params = param_table(m);
  const std::string p = "model.layers.0.self_attn.";
  ASSERT_GE(params.size(), 8u);
  for (size_t i = 0; i < 2; ++i) {
    const ParamInfo& n = params[6 + i];  // embedding, ln1, q, k, v, o, then the norms
    EXPECT_EQ(n.name, p + (i == 0 ? "q_norm.weight" : "k_norm.weight"));
    EXPECT_EQ(n.global_shape, std::vector<int64_t>{24});
    EXPECT_EQ(n.split_dim, -1);
    EXPECT_FALSE(n.decay);
    EXPECT_EQ(n.init, ParamInit::kOnes);
  }
  SpecOptions o;
  o.micro_rows = 2;
  o.chunk_slots = {1};
  const auto rows = [&](const ModelConfig& c) {
    std::map<std::string, int64_t> out;  // tp = 2: 2 of the 4 heads, 1 of the 2 kv heads
    for (const auto& t : activation_spec(c, {{{0, 1, true, true}}, 2}, o).chunks[0].per_slot)
      out[t.name()] = t.elems;
    return out;
  };
  const auto with = rows(m);
  const int64_t N = 2 * m.seq_len;
  EXPECT_EQ(with.at("layer0.q_raw"), N * 2 * 24);
  EXPECT_EQ(with.at("layer0.k_raw"), N * 1 * 24);
  EXPECT_EQ(with.at("layer0.rstd_q"), N * 2);
  EXPECT_EQ(with.at("layer0.rstd_k"), N * 1);
  m.qk_norm = false;
  EXPECT_EQ(rows(m).count("layer0.q_raw"), 0u);
  EXPECT_EQ(rows(m).size(), with.size() - 4);
  EXPECT_EQ(param_table(m).size(), params.size() - 2);
}

// model.shared_expert_gate: a (1, dim) weight per MoE block (replicated, decayed, drawn as a
// matrix), its per-token gate kept per micro-batch, its logit gradient kept for W and a scratch
// row; none in the dense block, none without the key.
TEST(ModelSpec, SharedExpertGateRows) {
  ModelConfig m = small_moe_model();  // block 0 dense
  m.shared_expert_gate = true;
  const auto params = param_table(m);
  int gates = 0;
  for (const auto& p : params) {
    if (!p.name.ends_with("mlp.shared_expert_gate.weight")) continue;
    ++gates;
    EXPECT_NE(p.name.find("model.layers.0."), 0u) << p.name;  // not in the dense block
    EXPECT_EQ(p.global_shape, (std::vector<int64_t>{1, m.dim}));
    EXPECT_EQ(p.split_dim, -1);
    EXPECT_TRUE(p.decay);
    EXPECT_EQ(p.init, ParamInit::kNormal);
  }
  EXPECT_EQ(gates, m.n_layers - m.dense_layers);
  SpecOptions o;
  o.micro_rows = 2;
  o.chunk_slots = {1};
  o.split_backward = true;
  const auto rows = [&](const ModelConfig& c) {
    std::map<std::string, int64_t> out;
    const ActivationSpec spec = activation_spec(c, {{{0, c.n_layers, true, true}}, 2}, o);
    for (const auto& t : spec.chunks[0].per_slot) out[t.name()] = t.elems;
    for (const auto& t : spec.scratch) out[t.name()] = t.elems;
    return out;
  };
  const auto with = rows(m);
  const int64_t N = 2 * m.seq_len;
  EXPECT_EQ(with.count("layer0.shared_expert_gate"), 0u);
  EXPECT_EQ(with.at("layer1.shared_expert_gate"), N);
  EXPECT_EQ(with.at("scratch.shared_gate_dg"), N);
  EXPECT_EQ(with.at("layer1.wgrad.shared_gate_dz"), N);
  m.shared_expert_gate = false;
  const auto without = rows(m);
  EXPECT_EQ(without.count("layer1.shared_expert_gate"), 0u);
  EXPECT_EQ(without.count("scratch.shared_gate_dg"), 0u);
  // Per MoE block: the gate and its dz (W's); and the one scratch row.
  const int64_t moe_blocks = m.n_layers - m.dense_layers;
  EXPECT_EQ(with.size(), without.size() + 2 * static_cast<size_t>(moe_blocks) + 1);
  EXPECT_EQ(param_table(m).size(), params.size() - static_cast<size_t>(moe_blocks));
}

TEST(ModelSpec, RowsHaveDistinctNamesAndScratchFollowsItsTable) {
  for (const bool moe : {false, true}) {
    SCOPED_TRACE(moe ? "mixture of experts" : "dense");
    SpecOptions o;
    o.storage = ActivationStorage::kBf16Copies;
    o.split_backward = true;
    o.micro_rows = 2;
    o.chunk_slots = {1};
    // The MoE model with expert parallelism too (ep = 2 divides its 4 experts); q/k/v biases
    // and q/k norms (their activation rows too).
    ModelConfig m = moe ? small_moe_model() : small_model();
    m.qkv_bias = true;
    m.qk_norm = true;
    m.shared_expert_gate = moe;  // the shared experts' gate: its dz row
    const ActivationSpec spec =
        activation_spec(m, {{{0, 4, true, true}}, 2, true, 2, moe ? 2 : 1}, o);
    std::vector<std::string> names;
    for (const auto& t : spec.chunks[0].per_slot) names.push_back(t.name());
    for (const auto& t : spec.scratch) names.push_back(t.name());
    std::vector<std::string> sorted = names;
    std::sort(sorted.begin(), sorted.end());
    EXPECT_EQ(std::adjacent_find(sorted.begin(), sorted.end()), sorted.end());
    int last = -1, scratch_rows = 0;
    bool work_seen = false;
    for (const auto& t : spec.scratch) {
      if (t.role == SpecTensor::Role::kWorkBlock) {
        EXPECT_LT(last, static_cast<int>(ScratchBuf::kTpBf16)) << t.name();
        work_seen = true;
        continue;
      }
      EXPECT_GT(t.index, last) << t.name();
      last = t.index;
      ++scratch_rows;
    }
    EXPECT_TRUE(work_seen);
    // sp, cp, ep, the last chunk, bf16 copies, q/k/v biases and the shared experts' gate: every
    // row but a dense model's 17 MoE rows.
    EXPECT_EQ(scratch_rows, kScratchBufs - (moe ? 0 : 17));
  }
}

}  // namespace
}  // namespace t3d::runtime
