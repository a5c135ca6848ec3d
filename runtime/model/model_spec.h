// The model spec table (llm.c's TensorSpec table, train_gpt2.cu): every tensor the part of the
// model one rank holds takes from its arena, as a pure function of the model, the rank's layout
// (its layer ranges, tp / cp / sp slicing) and the training options (storage precision,
// activation checkpointing, split backward). Parameters come with their Hugging Face name and tp
// sharding; activations (per micro-batch in flight) and scratch (shared by all) with their element
// count and storage type.
//
// runtime::Model allocates exactly these rows in this order, its bf16 codec walks the block rows,
// and the planner's memory model sums them: what exists, its size and precision is written here
// once. Arithmetic only: no MPI, so the planner calls it without a communicator.
#pragma once

#include <array>
#include <cstddef>
#include <cstdint>
#include <optional>
#include <string>
#include <vector>

#include "parallel/pipeline_split.h"
#include "runtime/recipe/recipe.h"

namespace t3d::runtime {

// clang-format off
// The tables of one transformer block, one row per tensor. Every list the code keeps of these
// tensors (the enums, the arena names, the sizes and precisions, the structs of pointers the
// math reads and the binding of each row to its member) is generated from these rows, so adding
// a block tensor is one row here plus its math (docs/architecture.md, "Adding a block tensor").
//
// Block weights: X(enum, member, Hugging Face suffix, global shape, split_dim, decay, init,
// part). Shapes are over the global sizes C (model.dim), D (head_dim), H, Hkv (heads, kv heads),
// F (ffn_dim), E (n_experts), Fe (moe_ffn_dim) and Fs (shared experts' width); split_dim and
// decay as ParamInfo's; `part` says which blocks hold the row (BlockPart); the rows are the
// block's layout order. A routed experts' row (part kExperts) is E tensors, one per expert,
// named "mlp.experts.<e>.<suffix>" as Hugging Face's MoE models name them, laid out one after
// the other (expert-major): the grouped pass reads the E matrices as one stack, while snapshots,
// ZeRO and tp see ordinary matrices.
#define T3D_BLOCK_WEIGHTS(X)                                                                      \
  X(kLn1,  ln1,  "input_layernorm.weight",          (C),          -1, false, kOnes, kAll)         \
  X(kQ,    q,    "self_attn.q_proj.weight",         (H * D, C),    0, true,  kNormal, kAll)       \
  X(kK,    k,    "self_attn.k_proj.weight",         (Hkv * D, C),  0, true,  kNormal, kAll)       \
  X(kV,    v,    "self_attn.v_proj.weight",         (Hkv * D, C),  0, true,  kNormal, kAll)       \
  X(kQBias, q_bias, "self_attn.q_proj.bias",        (H * D),       0, false, kZeros, kQkvBias)   \
  X(kKBias, k_bias, "self_attn.k_proj.bias",        (Hkv * D),     0, false, kZeros, kQkvBias)   \
  X(kVBias, v_bias, "self_attn.v_proj.bias",        (Hkv * D),     0, false, kZeros, kQkvBias)   \
  X(kO,    o,    "self_attn.o_proj.weight",         (C, H * D),    1, true,  kResidualOut, kAll)  \
  X(kQNorm, q_norm, "self_attn.q_norm.weight",      (D),          -1, false, kOnes, kQkNorm)     \
  X(kKNorm, k_norm, "self_attn.k_norm.weight",      (D),          -1, false, kOnes, kQkNorm)     \
  X(kLn2,  ln2,  "post_attention_layernorm.weight", (C),          -1, false, kOnes, kAll)         \
  X(kGate, gate, "mlp.gate_proj.weight",            (F, C),        0, true,  kNormal, kDense)     \
  X(kUp,   up,   "mlp.up_proj.weight",              (F, C),        0, true,  kNormal, kDense)     \
  X(kDown, down, "mlp.down_proj.weight",            (C, F),        1, true,  kResidualOut, kDense) \
  X(kRouter,      router,      "mlp.router.weight",     (E, C),     -1, true,  kNormal, kRouted)   \
  X(kRouterBias,  router_bias, "mlp.router.bias",       (E),        -1, false, kZeros, kRouterBias) \
  X(kExpertGate,  expert_gate, "gate_proj.weight",      (Fe, C),     0, true,  kNormal, kExperts)  \
  X(kExpertUp,    expert_up,   "up_proj.weight",        (Fe, C),     0, true,  kNormal, kExperts)  \
  X(kExpertDown,  expert_down, "down_proj.weight",      (C, Fe),     1, true,  kResidualOut, kExperts) \
  X(kSharedGate,  shared_gate, "mlp.shared_experts.gate_proj.weight", (Fs, C), 0, true, kNormal, kShared) \
  X(kSharedUp,    shared_up,   "mlp.shared_experts.up_proj.weight",   (Fs, C), 0, true, kNormal, kShared) \
  X(kSharedDown,  shared_down, "mlp.shared_experts.down_proj.weight", (C, Fs), 1, true, kResidualOut, kShared) \
  X(kSharedExpertGate, shared_expert_gate, "mlp.shared_expert_gate.weight", (1, C), -1, true, kNormal, kSharedGated)

// The activations a block keeps for its backward, per micro-batch: X(enum, member, name, element
// type, statistic, elements). The type is the member's (`type* member`): float, or int32_t for
// the router's indices. Elements are over `d`, the rank's ModelDims; a statistic (a per-row or
// per-head value) stays as it is whatever the storage, the others (float) take the activation
// storage's type. `b` (BlockDims) holds the sizes of the block's kind: a row that kind lacks has 0
// elements and is not allocated. Router indices (int32) are statistics: copied as they are.
#define T3D_BLOCK_ACTS(X)                                                                                      \
  X(kRstd1,  rstd1,  "rstd1",         float,   true,  d.Nl)          /* input_layernorm's 1/rms per row */   \
  X(kXn1,    xn1,    "xn1",           float,   false, d.N * d.C)     /* input_layernorm output */            \
  X(kQ,      q,      "q",             float,   false, d.N * d.H * d.D) /* q after RoPE */                    \
  X(kK,      kk,     "k",             float,   false, d.N * d.Hkv * d.D) /* k after RoPE */                  \
  X(kV,      v,      "v",             float,   false, d.N * d.Hkv * d.D)                                     \
  /* model.qk_norm: q and k before their per-head norm, and each (row, head)'s 1/rms */                     \
  X(kQRaw,   qraw,   "q_raw",         float,   false, d.qk_norm ? d.N * d.H * d.D : 0)                       \
  X(kKRaw,   kraw,   "k_raw",         float,   false, d.qk_norm ? d.N * d.Hkv * d.D : 0)                     \
  X(kRstdQ,  rstdq,  "rstd_q",        float,   true,  d.qk_norm ? d.N * d.H : 0)                             \
  X(kRstdK,  rstdk,  "rstd_k",        float,   true,  d.qk_norm ? d.N * d.Hkv : 0)                           \
  X(kAttn,   att,    "attn",          float,   false, d.N * d.H * d.D) /* attention output, before o_proj */ \
  X(kLse,    lse,    "lse",           float,   true,  d.B * d.H * d.T) /* attention logsumexp (B, Hl, T) */  \
  X(kXmid,   xmid,   "xmid",          float,   false, d.Nl * d.C)    /* residual after attention */          \
  X(kRstd2,  rstd2,  "rstd2",         float,   true,  d.Nl)                                                  \
  X(kXn2,    xn2,    "xn2",           float,   false, d.N * d.C)     /* post_attention_layernorm output */   \
  X(kGate,   gate,   "gate",          float,   false, d.N * b.F)                                             \
  X(kUp,     up,     "up",            float,   false, d.N * b.F)                                             \
  X(kH,      h,      "h",             float,   false, d.N * b.F)     /* silu(gate)·up */                     \
  X(kScores, scores, "router_scores", float,   true,  d.N * b.E)     /* router scores (N, E) */              \
  X(kChosen, chosen, "router_chosen", int32_t, true,  d.N * b.K)     /* chosen experts (N, K) */             \
  /* the routing's slot maps (kernels/ops_moe.h moe_permute), kept so the backward needs no host */       \
  X(kRowOfSlot, row_of_slot, "router_row_of_slot", int32_t, true, d.N * b.K) /* slot -> row, -1 dropped */ \
  X(kSlotOfRow, slot_of_row, "router_slot_of_row", int32_t, true, d.N * b.K) /* kept row -> slot */       \
  X(kGates,  gates,  "router_gates",  float,   true,  d.N * b.K)     /* their gates (N, K) */                \
  X(kEGate,  egate,  "expert_gate",   float,   false, b.R * b.Fe)    /* per row the experts take (R) */      \
  X(kEUp,    eup,    "expert_up",     float,   false, b.R * b.Fe)                                            \
  X(kEH,     eh,     "expert_h",      float,   false, b.R * b.Fe)                                            \
  /* expert parallelism: the rows the experts took (expert-major) */                                        \
  X(kEX,     ex,     "expert_x",      float,   true,  b.P > 1 ? b.R * d.C : 0)                               \
  X(kSGate,  sgate,  "shared_gate",   float,   false, d.N * b.Fs)    /* shared experts */                    \
  X(kSUp,    sup,    "shared_up",     float,   false, d.N * b.Fs)                                            \
  X(kSH,     sh,     "shared_h",      float,   false, d.N * b.Fs)                                            \
  /* model.shared_expert_gate: sigmoid(u · w) per row, the shared experts' gate */                            \
  X(kSGateG, sgate_g, "shared_expert_gate", float, true, d.shared_gate && b.Fs > 0 ? d.N : 0)

// The output gradients a block's deferred weight-gradient pass (W) needs, per micro-batch, so
// that W runs every weight-gradient GEMM of the block: X(enum, member, name, fp32, elements).
// Elements are over `d` (ModelDims) and `b` (the block's BlockDims: a row its kind lacks has 0
// elements and is absent); an fp32 row stays fp32 whatever the storage, the others take the
// activation storage's type. The SwiGLU's (the dense MLP's, or the shared experts' of a mixture
// of experts): the gradients of the block output (down_proj's input), of gate and up. The routed
// experts' rows (R, expert-major as the grouped pass takes them): their output gradients scaled
// by their gates, the gradients of their gate and up. The router's: the gradient of the logits
// of the rows its weight gradient sums here (Nl: this rank's with sequence parallelism), fp32 as
// the router. The shared experts' gate's (model.shared_expert_gate): the gradient of each row's
// gate logit, fp32. The attention's: the gradients of xmid (o_proj's input), of q (before RoPE), k, v.
#define T3D_WGRADS(X)                                                                             \
  X(kDyDown,        dy_down,        "dy_down",        false, b.F + b.Fs > 0 ? d.N * d.C : 0)    \
  X(kDgate,         dgate,          "dgate",          false, d.N * (b.F + b.Fs))                \
  X(kDup,           dup,            "dup",            false, d.N * (b.F + b.Fs))                \
  X(kExpertDy,      expert_dy,      "expert_dy",      false, b.R * d.C)                         \
  X(kExpertDgate,   expert_dgate,   "expert_dgate",   false, b.R * b.Fe)                        \
  X(kExpertDup,     expert_dup,     "expert_dup",     false, b.R * b.Fe)                        \
  X(kRouterDlogits, router_dlogits, "router_dlogits", true,  d.Nl * b.E)                        \
  X(kGateDz,        gate_dz,        "shared_gate_dz", true,  d.shared_gate && b.Fs > 0 ? d.N : 0) \
  X(kDyO,           dy_o,           "dy_o",           false, d.N * d.C)                         \
  X(kDq,            dq,             "dq",             false, d.N * d.H * d.D)                   \
  X(kDk,            dk,             "dk",             false, d.N * d.Hkv * d.D)                 \
  X(kDv,            dv,             "dv",             false, d.N * d.Hkv * d.D)

// The per-rank buffers every chunk and slot shares (one forward or backward runs at a time), in
// allocation order: X(enum, member, name, pointer type, precision, present, elements).
// precision: kWide takes the activation storage's type, kF32 / kBF16 are fixed. `present` and
// the elements are over `d` (ModelDims) and `x` (ScratchContext).
#define T3D_SCRATCH(X)                                                                            \
  X(kTmp,            tmp,       "tmp",             float, kWide, true,  d.N * d.C)              \
  X(kDx,             dx,        "dx",              float, kWide, true,  d.Nl * d.C)             \
  /* SP: this rank's rows of a gathered or scattered tensor; all rows of a gathered gradient */ \
  X(kSpRows,         rows,      "sp_rows",         float, kWide, d.sp,  d.Nl * d.C)             \
  X(kSpAllRows,      all_rows,  "sp_all_rows",     float, kWide, d.sp,  d.N * d.C)              \
  X(kDtmp,           dtmp,      "dtmp",            float, kWide, true,  d.N * d.C)              \
  X(kDxn,            dxn,       "dxn",             float, kWide, true,  d.N * d.C)              \
  X(kDatt,           datt,      "datt",            float, kWide, true,  d.N * d.H * d.D)        \
  X(kDq,             dq,        "dq",              float, kWide, true,  d.N * d.H * d.D)        \
  X(kDk,             dk,        "dk",              float, kWide, true,  d.N * d.Hkv * d.D)      \
  X(kDv,             dv,        "dv",              float, kWide, true,  d.N * d.Hkv * d.D)      \
  /* a SwiGLU's backward: the dense MLP's, or the shared experts' (Fw, the wider of the two) */ \
  X(kDh,             dh,        "dh",              float, kWide, true,  d.N * d.Fw)             \
  X(kDgate,          dgate,     "dgate",           float, kWide, true,  d.N * d.Fw)             \
  X(kDup,            dup,       "dup",             float, kWide, true,  d.N * d.Fw)             \
  /* mixture of experts: the permuted rows (S = N·K): the experts' inputs, their outputs (in  \
     the backward the gradient of their outputs), the gradient of their inputs; the experts' \
     SwiGLU backward, the router's gradients, and the permutation */                          \
  X(kMoeRows,        moe_rows,  "moe_rows",        float, kWide, d.E > 0, d.S * d.C)          \
  X(kMoeOut,         moe_out,   "moe_out",         float, kWide, d.E > 0, d.S * d.C)          \
  X(kMoeGrad,        moe_grad,  "moe_grad",        float, kWide, d.E > 0, d.S * d.C)          \
  X(kMoeDh,          moe_dh,    "moe_dh",          float, kWide, d.E > 0, d.R * d.Fe)         \
  X(kMoeDgate,       moe_dgate, "moe_dgate",       float, kWide, d.E > 0, d.R * d.Fe)         \
  X(kMoeDup,         moe_dup,   "moe_dup",         float, kWide, d.E > 0, d.R * d.Fe)         \
  /* expert parallelism: rows the experts take (R), in the all-to-all's order or theirs, a    \
     gate and a gate gradient per row, and the rows' own slot index (the identity) */          \
  X(kMoeEpRows,      moe_ep_rows, "moe_ep_rows",   float, kWide, d.P > 1, d.R * d.C)          \
  X(kMoeEpOut,       moe_ep_out, "moe_ep_out",     float, kWide, d.P > 1, d.R * d.C)          \
  X(kMoeEpGates,     moe_ep_gates, "moe_ep_gates", float, kF32,  d.P > 1, d.R)                \
  X(kMoeEpDgates,    moe_ep_dgates, "moe_ep_dgates", float, kF32, d.P > 1, d.R)               \
  X(kMoeEpIndex,     moe_ep_index, "moe_ep_index", int32_t, kI32, d.P > 1, d.R)               \
  X(kMoeDlogits,     moe_dlogits, "moe_dlogits",   float, kF32,  d.E > 0, d.N * d.E)          \
  X(kMoeDscores,     moe_dscores, "moe_dscores",   float, kF32,  d.aux,   d.N * d.E)       \
  X(kMoeDgates,      moe_dgates, "moe_dgates",     float, kF32,  d.E > 0, d.S)                \
  /* model.shared_expert_gate: the gradient of each row's gate, then of its logit */           \
  X(kSharedGateDg,   gate_dg,   "shared_gate_dg",  float, kF32,  d.shared_gate, d.N)          \
  X(kAttentionTiles, attn,      "attention_tiles", float, kF32,  true,  x.attention_tiles)      \
  /* the last chunk's logits (N, Vl) and cross-entropy statistics stay fp32 */                  \
  X(kLogits,         logits,    "logits",          float, kF32,  x.last, d.N * d.V)             \
  X(kLosses,         losses,    "losses",          float, kF32,  x.last, d.N)                   \
  X(kTargets,        targets,   "targets",         int32_t, kI32, x.last, d.N)                  \
  X(kRowMax,         row_max,   "ce_row_max",      float, kF32,  x.last, d.N)                   \
  X(kSumExp,         sum_exp,   "ce_sum_exp",      float, kF32,  x.last, d.N)                   \
  X(kTarget,         target,    "ce_target_logit", float, kF32,  x.last, d.N)                   \
  X(kRope,           rope,      "rope_table",      float, kF32,  true,  d.seq_len * d.D)        \
  /* model.qkv_bias: a column of N ones, the biases' K = 1 GEMMs' other operand */              \
  X(kOnes,           ones,      "ones",            float, kF32,  d.qkv_bias, d.N)             \
  /* CP: the whole sequence's keys and values (B, seq_len, Hkvl·D), their gradients, a staging \
     buffer in collective order (cp, 2, B, T/(2cp), width), and the second part's dk, dv */     \
  X(kCpKeys,         k_all,     "cp_keys",         float, kWide, d.cp,  x.whole_kv)             \
  X(kCpValues,       v_all,     "cp_values",       float, kWide, d.cp,  x.whole_kv)             \
  X(kCpKeyGrads,     dk_all,    "cp_key_grads",    float, kWide, d.cp,  x.whole_kv)             \
  X(kCpValueGrads,   dv_all,    "cp_value_grads",  float, kWide, d.cp,  x.whole_kv)             \
  X(kCpStaging,      cp_stage,  "cp_staging",      float, kWide, d.cp,  x.whole_kv)             \
  X(kCpKeyValuePart, cp_kv_part, "cp_key_value_part_grads", float, kWide, d.cp, 2 * x.whole_kv) \
  /* bf16 copies: TP all-reduces on the wire, and SP's gathers / scatters */                    \
  X(kTpBf16,         tp16,      "tp_bf16",         uint16_t, kBF16, x.copies,        d.N * d.C) \
  X(kTpBf16Rows,     tp16_rows, "tp_bf16_rows",    uint16_t, kBF16, x.copies && d.sp, d.N * d.C) \
  /* expert parallelism's rows on the wire: what this rank sends and receives */               \
  X(kEpBf16Send,     ep16_send, "ep_bf16_send",    uint16_t, kBF16, x.copies && d.P > 1, d.R * d.C) \
  X(kEpBf16Recv,     ep16_recv, "ep_bf16_recv",    uint16_t, kBF16, x.copies && d.P > 1, d.R * d.C)

#define T3D_ROW_ENUM(e, ...) e,
enum class BlockWeight : uint8_t { T3D_BLOCK_WEIGHTS(T3D_ROW_ENUM) };
enum class BlockAct : uint8_t { T3D_BLOCK_ACTS(T3D_ROW_ENUM) };
enum class WGrad : uint8_t { T3D_WGRADS(T3D_ROW_ENUM) };
enum class ScratchBuf : uint8_t { T3D_SCRATCH(T3D_ROW_ENUM) };
#undef T3D_ROW_ENUM
#define T3D_ROW_COUNT(...) +1
inline constexpr int kBlockWeights = 0 T3D_BLOCK_WEIGHTS(T3D_ROW_COUNT);
inline constexpr int kBlockActs = 0 T3D_BLOCK_ACTS(T3D_ROW_COUNT);
inline constexpr int kWGrads = 0 T3D_WGRADS(T3D_ROW_COUNT);
inline constexpr int kScratchBufs = 0 T3D_SCRATCH(T3D_ROW_COUNT);
#undef T3D_ROW_COUNT
// clang-format on

// One pointer (or offset) per block weight, a member per T3D_BLOCK_WEIGHTS row, so the math
// reads `w.q` and generic code walks the rows with operator[].
template <typename P>
struct BlockTensors {
#define T3D_ROW_MEMBER(e, member, ...) P member{};
  T3D_BLOCK_WEIGHTS(T3D_ROW_MEMBER)
#undef T3D_ROW_MEMBER
  P& operator[](BlockWeight w) { return this->*member_of(w); }
  const P& operator[](BlockWeight w) const { return this->*member_of(w); }

 private:
  using Member = P BlockTensors::*;
  static constexpr Member member_of(BlockWeight w) {
#define T3D_ROW_MEMBER_PTR(e, member, ...) &BlockTensors::member,
    constexpr Member kMembers[] = {T3D_BLOCK_WEIGHTS(T3D_ROW_MEMBER_PTR)};
#undef T3D_ROW_MEMBER_PTR
    return kMembers[static_cast<size_t>(w)];
  }
};
inline constexpr BlockWeight kAllBlockWeights[] = {
#define T3D_ROW_VALUE(e, ...) BlockWeight::e,
    T3D_BLOCK_WEIGHTS(T3D_ROW_VALUE)
#undef T3D_ROW_VALUE
};
const char* block_weight_suffix(BlockWeight w);  // "self_attn.q_proj.weight"
// The parameter name of weight `w` of block `layer`: "model.layers.<layer>.<suffix>"; of a
// routed experts' row, "model.layers.<layer>.mlp.experts.<expert>.<suffix>" (expert 0: where
// the stack starts).
std::string block_param_name(int64_t layer, BlockWeight w, int64_t expert = 0);
bool is_expert_weight(BlockWeight w);

// How a parameter is initialised (Model::init): all ones (norm weights), or normal with std 0.02,
// scaled by 1/sqrt(2·n_layers) for the projections into the residual stream (GPT-2, Megatron).
enum class ParamInit : uint8_t { kOnes, kNormal, kResidualOut, kZeros };

// Which blocks hold a block weight row (T3D_BLOCK_WEIGHTS' last column): every block, dense
// blocks (the SwiGLU MLP), mixture-of-experts blocks (router and routed experts), those with
// aux-loss-free balancing (the router's selection bias), those with shared experts (and their
// sigmoid gate with model.shared_expert_gate, kSharedGated); every block
// of a model with q/k/v biases (model.qkv_bias), with q/k norms (model.qk_norm).
// kExperts: the routed experts, a tensor per expert.
enum class BlockPart : uint8_t {
  kAll,
  kDense,
  kRouted,
  kExperts,
  kRouterBias,
  kShared,
  kQkvBias,
  kQkNorm,
  kSharedGated  // the shared experts' sigmoid gate (model.shared_expert_gate)
};
bool block_has(const ModelConfig& config, int64_t layer, BlockPart part);
bool block_has(const ModelConfig& config, int64_t layer, BlockWeight w);

// One row of the parameter table: the global (Hugging Face) tensor and how it is sharded.
struct ParamInfo {
  std::string name;  // the Hugging Face LLaMA name: what snapshots and `export` call it
  std::vector<int64_t> global_shape;
  int split_dim = -1;  // -1 replicated over tp; 0 rows (column-parallel, vocab); 1 columns
  bool decay = true;   // AdamW weight decay (norm weights: no)
  ParamInit init = ParamInit::kNormal;
  // Gradient unit: -1 the embedding, l block l, n_layers final norm and head, experts_unit(l)
  // the routed experts of block l.
  int64_t unit = 0;
  // A block tensor's row of T3D_BLOCK_WEIGHTS; none for the embedding, final norm and head.
  std::optional<BlockWeight> row = std::nullopt;
  int64_t expert = -1;  // a routed expert's tensor: its expert; -1 otherwise
  // The router's selection bias: no gradient ever reaches it, its own rule moves it after each
  // optimizer step instead of AdamW (runtime/train/router_balance.h).
  bool router_bias() const { return row == BlockWeight::kRouterBias; }
  bool trained() const { return !router_bias(); }  // AdamW updates it
};

// Gradient units past the final norm and head: the routed experts of mixture-of-experts block l
// are unit n_layers + 1 + l, laid out after every other unit of the rank. They are a state group
// of their own (StateGroup::kExperts), reduced and sharded over the expert-data-parallel ranks
// (runtime/train/sharded_state.h), while everything else is StateGroup::kDense.
inline int64_t experts_unit(const ModelConfig& config, int64_t layer) {
  return config.n_layers + 1 + layer;
}
// Unit ids run from -1 to 2·n_layers: tables indexed by unit + 1 have this many entries.
inline int64_t unit_slots(const ModelConfig& config) { return 2 * config.n_layers + 2; }
enum class StateGroup : uint8_t { kDense, kExperts };
inline constexpr StateGroup kStateGroups[] = {StateGroup::kDense, StateGroup::kExperts};
inline StateGroup state_group(const ModelConfig& config, int64_t unit) {
  return unit > config.n_layers ? StateGroup::kExperts : StateGroup::kDense;
}
// The block a unit belongs to (its experts' unit: the block), -1 the embedding, n_layers the head.
inline int64_t unit_block(const ModelConfig& config, int64_t unit) {
  return unit > config.n_layers ? unit - config.n_layers - 1 : unit;
}

// The routed experts a rank holds, [begin, end) of model.n_experts: all of them, or with expert
// parallelism its EP rank's share (expert_share).
struct ExpertRange {
  int64_t begin = 0, end = -1;  // end -1: to model.n_experts
  int64_t size(const ModelConfig& config) const;
  bool all(const ModelConfig& config) const {
    return begin == 0 && size(config) == config.n_experts;
  }
};
// EP rank `rank` of `ep` holds n_experts / ep consecutive experts.
ExpertRange expert_share(const ModelConfig& config, int64_t ep, int64_t rank);

// The parameters of `chunks`, in layout order: per chunk the embedding (first), its blocks, then
// the final norm and (untied) LM head (last); after every chunk, the routed experts `experts` of
// each mixture-of-experts block (their own gradient units). The one LLaMA parameter table: the
// Model's layout, the snapshot's tensors, `export`, `import` and `generate` all read it.
std::vector<ParamInfo> param_table(const ModelConfig& config,
                                   const std::vector<parallel::LayerRange>& chunks,
                                   ExpertRange experts = {});
// The whole model's parameters (one chunk holding every layer).
std::vector<ParamInfo> param_table(const ModelConfig& config);

// The box of parameter `p` that tp rank `rank` of `tp` holds: its offset in the global tensor
// and its shape (the local tensor's). A replicated tensor: the whole of it, at offset 0. The
// one place the tp sharding of a tensor is worked out (layout, init, snapshot and eval boxes).
struct TensorBox {
  std::vector<int64_t> offset, shape;
  int64_t numel() const;
};
TensorBox tp_shard_box(const ParamInfo& p, int64_t tp, int64_t rank);

// Gradient units: float ranges of the parameter region (laid out as kernels::ParamLayout does,
// every tensor on a kernels::kAlignmentFloats boundary) that become final together. Unit -1 is the
// embedding, l a transformer block, n_layers the final norm and LM head. In region order.
struct ParamUnit {
  int64_t unit, begin, end;  // [begin, end): from the unit's first tensor to its last one's end
};
struct ParamUnits {
  std::vector<ParamUnit> units;
  int64_t total_floats = 0;  // the region, alignment padding included
};
ParamUnits param_units(const ModelConfig& config, const std::vector<parallel::LayerRange>& chunks,
                       int64_t tp, ExpertRange experts = {});
// The units of one state group, in region order, and the part of the region they take: from the
// group's first unit to the next group's first (padding included), so the groups' parts tile
// the region. A group without units has none and an empty part.
struct GroupUnits {
  std::vector<ParamUnit> units;
  int64_t begin = 0, end = 0;
};
GroupUnits group_units(const ModelConfig& config, const ParamUnits& all, StateGroup group);
// Floats the largest transformer block's parameters take in the region on one tp rank, padding
// included.
int64_t block_param_floats(const ModelConfig& config, int64_t tp);

// FLOPs per token (PaLM's count) of one transformer block on one tp rank, from the parameter
// table: `matmul` is one pass over its matrices (2 per weight element), and the forward, the
// input gradient and the weight gradient each cost one; `attention` is the forward's scores and
// their use (QK^T, AV) over the full T×T, and the backward costs twice that.
struct BlockFlops {
  double matmul = 0, attention = 0;
  double train() const { return 3 * matmul + 3 * attention; }  // f + b + w
};
// A mixture-of-experts block counts its routed experts' matrices K/E times (each token goes
// through K of the E). `layer` -1: the last block.
BlockFlops block_flops_per_token(const ModelConfig& config, int64_t tp, int64_t layer = -1);
// FLOPs per token of the LM head's forward and both its gradients on one tp rank (6 per weight).
double head_train_flops_per_token(const ModelConfig& config, int64_t tp);
// FLOPs of one training step (forward + backward) per token of the whole model: every block's
// train() and the LM head (the embedding is a lookup). What MFU divides by.
double model_train_flops_per_token(const ModelConfig& config);

// Activation checkpointing every K: blocks 0, K, 2K, ... of each chunk are recomputed in the
// backward instead of keeping their activations (K = 1: every block; 0: none).
inline bool recomputed_block(int64_t local_layer, int64_t every) {
  return every > 0 && local_layer % every == 0;
}
inline int64_t recomputed_blocks(int64_t layers, int64_t every) {
  return every <= 0 ? 0 : (layers + every - 1) / every;
}

enum class Dtype : uint8_t { kF32, kBF16, kI32 };
int64_t dtype_bytes(Dtype dtype);

// How activations are stored.
enum class ActivationStorage : uint8_t {
  kFp32,
  // titan3d's train.precision = "bf16" on CPUs: a block computes in one fp32 set of buffers
  // shared by all blocks and keeps bf16 copies of its large tensors (per-row statistics stay
  // fp32); TP traffic travels through bf16 staging buffers. Everything else fp32.
  kBf16Copies,
  // An accelerator training in bf16 (the planner's price for precision bf16): every
  // activation-sized tensor is bf16 where it lives; statistics, token ids, logits, the losses
  // and the RoPE table stay fp32 (int32 ids); no staging copies.
  kBf16,
};

// One rank's share of the model.
struct SpecLayout {
  std::vector<parallel::LayerRange> chunks;
  int64_t tp = 1;
  bool sequence_parallel = false;  // Megatron SP (has an effect with tp > 1 only)
  int64_t cp = 1;                  // context parallelism: the zig-zag split over 2·cp parts
  int64_t ep = 1;                  // expert parallelism: the EP group's size
};

struct SpecOptions {
  int64_t micro_rows = 1;            // sequences per micro-batch
  std::vector<int64_t> chunk_slots;  // micro-batches alive at once, per chunk of the layout
  int64_t checkpoint_every = 0;      // recomputed_block
  bool split_backward = false;       // zero-bubble B/W: keep the W pass's output gradients
  ActivationStorage storage = ActivationStorage::kFp32;
};

// The sizes one rank sees. Throws UserError when cp or sp cannot split the micro-batch.
struct ModelDims {
  int64_t B = 0;         // sequences per micro-batch
  int64_t T = 0;         // positions of each sequence on this rank: seq_len / cp
  int64_t N = 0;         // tokens per micro-batch: B·T
  int64_t Nl = 0;        // this rank's rows outside the TP blocks: N / tp with SP, else N
  int64_t C = 0, D = 0;  // model width, head width
  int64_t H = 0, Hkv = 0, F = 0, V = 0;  // heads, kv heads, ffn width, vocab: local to a tp rank
  int64_t seq_len = 0;                   // the whole sequence
  int64_t parts = 1;            // contiguous parts of a sequence on this rank: 1, or 2 with cp
  int64_t part_len = 0;         // positions per part
  bool sp = false, cp = false;  // sequence / context parallelism in effect
  // Mixture of experts (0 in a dense model): experts, experts per token, token slots N·K, one
  // expert's and the shared experts' width (local to a tp rank). Dense blocks exist (F > 0
  // for them) when the model is dense or keeps leading dense blocks.
  int64_t E = 0, K = 0, S = 0, Fe = 0, Fs = 0;
  // Expert parallelism: the EP group's size, the experts this rank holds (E / P), and the rows
  // they may take in one micro-batch: every slot of the group (P·S, dropless; S when P = 1), or
  // with a capacity factor at most E times the capacity, if that is fewer.
  int64_t P = 1, El = 0, R = 0;
  bool dense_blocks = true;
  bool aux = false;          // the auxiliary balance loss is on
  bool qkv_bias = false;     // model.qkv_bias
  bool qk_norm = false;      // model.qk_norm
  bool shared_gate = false;  // model.shared_expert_gate in a mixture of experts
  int64_t Fw = 0;  // the widest dense-shaped SwiGLU: F (dense blocks) or Fs (shared experts)
};
ModelDims model_dims(const ModelConfig& config, const SpecLayout& layout, int64_t micro_rows);

// The sizes of one block's own rows (T3D_BLOCK_ACTS' `b`): a dense block has F, a mixture of
// experts E, K, S, Fe and Fs; the other kind's are 0.
struct BlockDims {
  int64_t F = 0, E = 0, K = 0, S = 0, Fe = 0, Fs = 0, P = 1, El = 0, R = 0;
};
BlockDims block_dims(const ModelDims& d, bool moe);

// What the scratch rows (T3D_SCRATCH) depend on besides ModelDims.
struct ScratchContext {
  bool last = false;            // the rank holds the last chunk (LM head and loss)
  bool copies = false;          // ActivationStorage::kBf16Copies
  int64_t attention_tiles = 0;  // kernels::attention_scratch_floats of one part's attention
  int64_t whole_kv = 0;         // B·seq_len·Hkvl·D: the whole sequence's keys (or values)
};

// One row of the activation / scratch table.
struct SpecTensor {
  enum class Role : uint8_t {
    kResidual,     // index: residual stream 0..L of the chunk (0 its input, L its output)
    kBlock,        // index: BlockAct, where block `layer` computes and (fp32 or kBf16) keeps it
    kBlockStored,  // index: BlockAct, kBf16Copies: the copy block `layer` keeps
    kWGrad,        // index: WGrad, of block `layer`
    kTokens,       // first chunk: the ids, for the embedding backward
    kFinalNorm,    // last chunk: model.norm output and its rstd
    kFinalRstd,
    kLossGrad,   // last chunk: gradient of its output from the loss
    kInputGrad,  // not the first chunk: gradient of its input, per slot (its send may be in flight)
    kWorkBlock,  // scratch, index: BlockAct: the buffers recomputed / bf16-stored blocks use
    kScratch,    // index: ScratchBuf
  };
  Role role;
  int index = 0;
  int64_t layer = -1;  // global block of kBlock, kBlockStored, kWGrad rows
  Dtype dtype = Dtype::kF32;
  int64_t elems = 0;

  size_t bytes() const { return static_cast<size_t>(elems * dtype_bytes(dtype)); }
  size_t arena_bytes() const;  // rounded up as the arena allocates
  // The arena's name: activations without their "activations.chunkI.slotS." prefix
  // ("layer3.xn1.bf16", "residual0"), scratch in full ("scratch.tmp").
  std::string name() const;
};

struct ChunkSpec {
  parallel::LayerRange range;
  int64_t slots = 0;
  std::vector<SpecTensor> per_slot;  // one micro-batch's activations, in allocation order
  size_t slot_bytes() const;         // arena bytes of per_slot
};

struct ActivationSpec {
  ModelDims dims;
  std::vector<ChunkSpec> chunks;    // in layout order
  std::vector<SpecTensor> scratch;  // in allocation order
  // What a block stores per micro-batch where it is not recomputed: its rows (kBlock or
  // kBlockStored, layer -1) in the order the codec copies them.
  std::vector<SpecTensor> stored_block;
  size_t activation_bytes() const;  // Σ over chunks of slots · slot_bytes
  size_t scratch_bytes() const;
};

ActivationSpec activation_spec(const ModelConfig& config, const SpecLayout& layout,
                               const SpecOptions& options);

}  // namespace t3d::runtime
