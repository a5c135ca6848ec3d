#include "runtime/model/model_spec.h"

#include <iterator>

#include "kernels/arena.h"
#include "kernels/check.h"
#include "kernels/ops.h"

namespace t3d::runtime {

namespace {

using Role = SpecTensor::Role;

int64_t padded(int64_t floats) {
  const auto a = static_cast<int64_t>(kernels::kAlignmentFloats);
  return (floats + a - 1) / a * a;
}

// Every parameter of `chunks` in layout order: fn(unit, layer, name or block suffix, global
// shape, split_dim, decay). `layer` >= 0: a block tensor, named model.layers.<layer>.<suffix>.
template <typename Fn>
void for_each_param(const ModelConfig& m, const std::vector<parallel::LayerRange>& chunks, Fn fn) {
  const int64_t C = m.dim, D = m.head_dim(), V = m.vocab_size;
  const int64_t H = m.n_heads, Hkv = m.n_kv_heads, F = m.ffn_dim;
  for (const auto& range : chunks) {
    if (range.first) fn(-1, -1, "model.embed_tokens.weight", std::vector<int64_t>{V, C}, 0, true);
    for (int64_t l = range.begin; l < range.end; ++l) {
      fn(l, l, "input_layernorm.weight", std::vector<int64_t>{C}, -1, false);
      fn(l, l, "self_attn.q_proj.weight", std::vector<int64_t>{H * D, C}, 0, true);
      fn(l, l, "self_attn.k_proj.weight", std::vector<int64_t>{Hkv * D, C}, 0, true);
      fn(l, l, "self_attn.v_proj.weight", std::vector<int64_t>{Hkv * D, C}, 0, true);
      fn(l, l, "self_attn.o_proj.weight", std::vector<int64_t>{C, H * D}, 1, true);
      fn(l, l, "post_attention_layernorm.weight", std::vector<int64_t>{C}, -1, false);
      fn(l, l, "mlp.gate_proj.weight", std::vector<int64_t>{F, C}, 0, true);
      fn(l, l, "mlp.up_proj.weight", std::vector<int64_t>{F, C}, 0, true);
      fn(l, l, "mlp.down_proj.weight", std::vector<int64_t>{C, F}, 1, true);
    }
    if (range.last) {
      fn(m.n_layers, -1, "model.norm.weight", std::vector<int64_t>{C}, -1, false);
      if (!m.tie_embeddings)
        fn(m.n_layers, -1, "lm_head.weight", std::vector<int64_t>{V, C}, 0, true);
    }
  }
}

constexpr const char* kBlockNames[] = {"rstd1", "xn1",   "q",   "k",    "v",  "attn", "lse",
                                       "xmid",  "rstd2", "xn2", "gate", "up", "h"};
constexpr const char* kWGradNames[] = {"dy_down", "dgate", "dup", "dy_o", "dq", "dk", "dv"};
static_assert(std::size(kBlockNames) == kBlockActs && std::size(kWGradNames) == kWGrads);

// A block's activations in BlockAct order: elements, and whether it is a per-row statistic
// (those stay fp32 whatever the storage).
struct BlockRow {
  int64_t elems;
  bool statistic;
};
std::array<BlockRow, kBlockActs> block_rows(const ModelDims& d) {
  const int64_t N = d.N, Nl = d.Nl, qd = d.H * d.D, kvd = d.Hkv * d.D;
  return {{{Nl, true},               // rstd1
           {N * d.C, false},         // xn1: input_layernorm output
           {N * qd, false},          // q after RoPE
           {N * kvd, false},         // k after RoPE
           {N * kvd, false},         // v
           {N * qd, false},          // attn: attention output, before o_proj
           {d.B * d.H * d.T, true},  // lse: attention logsumexp (B, Hl, T)
           {Nl * d.C, false},        // xmid: residual after attention
           {Nl, true},               // rstd2
           {N * d.C, false},         // xn2: post_attention_layernorm output
           {N * d.F, false},         // gate
           {N * d.F, false},         // up
           {N * d.F, false}}};       // h = silu(gate)·up
}

// WGrad order: the gradients of the block output and of xmid (the inputs of down_proj's and
// o_proj's weight gradients), of gate and up, and of q (before RoPE), k and v.
std::array<int64_t, kWGrads> wgrad_elems(const ModelDims& d) {
  const int64_t N = d.N, qd = d.H * d.D, kvd = d.Hkv * d.D;
  return {N * d.C, N * d.F, N * d.F, N * d.C, N * qd, N * kvd, N * kvd};
}

// Scratch names in ScratchBuf order.
constexpr const char* kScratchNames[] = {"tmp",
                                         "dx",
                                         "sp_rows",
                                         "sp_all_rows",
                                         "dtmp",
                                         "dxn",
                                         "datt",
                                         "dq",
                                         "dk",
                                         "dv",
                                         "dh",
                                         "dgate",
                                         "dup",
                                         "attention_tiles",
                                         "logits",
                                         "losses",
                                         "ce_row_max",
                                         "ce_sum_exp",
                                         "ce_target_logit",
                                         "rope_table",
                                         "cp_keys",
                                         "cp_values",
                                         "cp_key_grads",
                                         "cp_value_grads",
                                         "cp_staging",
                                         "cp_key_value_part_grads",
                                         "tp_bf16",
                                         "tp_bf16_rows"};
static_assert(std::size(kScratchNames) == static_cast<size_t>(ScratchBuf::kTpBf16Rows) + 1);

// Builds the rows: `wide` (activation-sized) tensors take the storage's element type.
class Builder {
 public:
  Builder(const ModelDims& d, ActivationStorage storage) : d_(d), storage_(storage) {}
  Dtype wide() const { return storage_ == ActivationStorage::kBf16 ? Dtype::kBF16 : Dtype::kF32; }

  // One block's rows: computed in place (kBlock) or its stored copy (kBlockStored: bf16 tensors
  // first, then the fp32 statistics, the codec's order).
  void block(std::vector<SpecTensor>& out, Role role, int64_t layer) const {
    const auto rows = block_rows(d_);
    if (role != Role::kBlockStored) {
      for (int i = 0; i < kBlockActs; ++i)
        out.push_back({role, i, layer, rows[i].statistic ? Dtype::kF32 : wide(), rows[i].elems});
      return;
    }
    for (bool statistic : {false, true})
      for (int i = 0; i < kBlockActs; ++i)
        if (rows[i].statistic == statistic)
          out.push_back({role, i, layer, statistic ? Dtype::kF32 : Dtype::kBF16, rows[i].elems});
  }

  void scratch(std::vector<SpecTensor>& out, ScratchBuf b, int64_t elems, Dtype dtype) const {
    out.push_back({Role::kScratch, static_cast<int>(b), -1, dtype, elems});
  }

 private:
  ModelDims d_;
  ActivationStorage storage_;
};

ChunkSpec chunk_spec(const ModelDims& d, const parallel::LayerRange& range, int64_t slots,
                     const SpecOptions& o) {
  const Builder b(d, o.storage);
  const bool copies = o.storage == ActivationStorage::kBf16Copies;
  ChunkSpec c{range, slots, {}};
  auto& rows = c.per_slot;
  for (int64_t l = 0; l <= range.size(); ++l)
    rows.push_back({Role::kResidual, static_cast<int>(l), -1, b.wide(), d.Nl * d.C});
  for (int64_t l = range.begin; l < range.end; ++l) {
    if (recomputed_block(l - range.begin, o.checkpoint_every)) continue;
    b.block(rows, copies ? Role::kBlockStored : Role::kBlock, l);
  }
  for (int64_t l = range.begin; o.split_backward && l < range.end; ++l) {
    if (recomputed_block(l - range.begin, o.checkpoint_every)) continue;  // done in B
    const auto w = wgrad_elems(d);
    for (int i = 0; i < kWGrads; ++i) rows.push_back({Role::kWGrad, i, l, b.wide(), w[i]});
  }
  if (range.first) rows.push_back({Role::kTokens, 0, -1, Dtype::kI32, d.N});
  if (range.last) {
    rows.push_back({Role::kFinalNorm, 0, -1, b.wide(), d.N * d.C});
    rows.push_back({Role::kFinalRstd, 0, -1, Dtype::kF32, d.Nl});
    rows.push_back({Role::kLossGrad, 0, -1, b.wide(), d.Nl * d.C});
  }
  if (!range.first) rows.push_back({Role::kInputGrad, 0, -1, b.wide(), d.Nl * d.C});
  return c;
}

std::vector<SpecTensor> scratch_spec(const ModelDims& d, const SpecLayout& layout,
                                     const SpecOptions& o) {
  using enum ScratchBuf;
  const Builder b(d, o.storage);
  const Dtype w = b.wide(), f32 = Dtype::kF32;
  const int64_t N = d.N, C = d.C, qd = d.H * d.D, kvd = d.Hkv * d.D;
  bool last = false;
  for (const auto& c : layout.chunks) last |= c.last;
  std::vector<SpecTensor> s;
  b.scratch(s, kTmp, N * C, w);
  b.scratch(s, kDx, d.Nl * C, w);  // running residual gradient of the first chunk
  if (d.sp) {
    b.scratch(s, kSpRows, d.Nl * C, w);  // this rank's rows of a gathered or scattered tensor
    b.scratch(s, kSpAllRows, N * C, w);  // all rows of a gradient gathered for the backward
  }
  b.scratch(s, kDtmp, N * C, w);
  b.scratch(s, kDxn, N * C, w);
  b.scratch(s, kDatt, N * qd, w);
  b.scratch(s, kDq, N * qd, w);
  b.scratch(s, kDk, N * kvd, w);
  b.scratch(s, kDv, N * kvd, w);
  b.scratch(s, kDh, N * d.F, w);
  b.scratch(s, kDgate, N * d.F, w);
  b.scratch(s, kDup, N * d.F, w);
  const kernels::AttentionShape shape{d.B, d.part_len, d.H, d.Hkv, d.D};
  b.scratch(s, kAttentionTiles, kernels::attention_scratch_floats(shape), f32);
  if (last) {  // the logits and the loss stay fp32
    b.scratch(s, kLogits, N * d.V, f32);
    for (ScratchBuf row : {kLosses, kRowMax, kSumExp, kTarget}) b.scratch(s, row, N, f32);
  }
  b.scratch(s, kRope, d.seq_len * d.D, f32);
  if (d.cp) {
    // The whole sequence's keys and values, their gradients, a staging buffer in collective
    // order (cp, 2, B, T/(2cp), width), and the second part's dk, dv before they are added.
    const int64_t whole = d.B * d.seq_len * kvd;
    for (ScratchBuf row : {kCpKeys, kCpValues, kCpKeyGrads, kCpValueGrads, kCpStaging})
      b.scratch(s, row, whole, w);
    b.scratch(s, kCpKeyValuePart, 2 * whole, w);
  }
  const bool copies = o.storage == ActivationStorage::kBf16Copies;
  // One block's activations, shared by every recomputed or bf16-stored block: written by its
  // forward (then stored in bf16, or dropped), rebuilt right before its backward.
  if (o.checkpoint_every > 0 || copies) b.block(s, Role::kWorkBlock, -1);
  if (copies) {
    b.scratch(s, kTpBf16, N * C, Dtype::kBF16);                // TP all-reduce on the wire
    if (d.sp) b.scratch(s, kTpBf16Rows, N * C, Dtype::kBF16);  // SP gathers / scatters
  }
  return s;
}

}  // namespace

std::vector<ParamInfo> param_table(const ModelConfig& config,
                                   const std::vector<parallel::LayerRange>& chunks) {
  std::vector<ParamInfo> params;
  for_each_param(
      config, chunks,
      [&](int64_t, int64_t layer, const char* name, std::vector<int64_t> shape, int split_dim,
          bool decay) {
        params.push_back(
            {layer < 0 ? std::string(name) : "model.layers." + std::to_string(layer) + "." + name,
             std::move(shape), split_dim, decay});
      });
  return params;
}

ParamUnits param_units(const ModelConfig& config, const std::vector<parallel::LayerRange>& chunks,
                       int64_t tp) {
  ParamUnits out;
  for_each_param(config, chunks,
                 [&](int64_t unit, int64_t, const char*, const std::vector<int64_t>& shape,
                     int split_dim, bool) {
                   int64_t n = 1;
                   for (size_t i = 0; i < shape.size(); ++i)
                     n *= static_cast<int>(i) == split_dim ? shape[i] / tp : shape[i];
                   if (out.units.empty() || out.units.back().unit != unit)
                     out.units.push_back({unit, out.total_floats, 0});
                   out.units.back().end = out.total_floats + n;
                   out.total_floats += padded(n);
                 });
  return out;
}

int64_t block_param_floats(const ModelConfig& config, int64_t tp) {
  return param_units(config, {parallel::LayerRange{0, 1, false, false}}, tp).total_floats;
}

int64_t dtype_bytes(Dtype dtype) { return dtype == Dtype::kBF16 ? 2 : 4; }

size_t SpecTensor::arena_bytes() const {
  return (bytes() + kernels::kAlignment - 1) / kernels::kAlignment * kernels::kAlignment;
}

std::string SpecTensor::name() const {
  const std::string block = "layer" + std::to_string(layer) + ".";
  switch (role) {
    case Role::kResidual:
      return "residual" + std::to_string(index);
    case Role::kBlock:
      return block + kBlockNames[index];
    case Role::kBlockStored:
      return block + kBlockNames[index] + (dtype == Dtype::kBF16 ? ".bf16" : "");
    case Role::kWGrad:
      return block + "wgrad." + kWGradNames[index];
    case Role::kTokens:
      return "tokens";
    case Role::kFinalNorm:
      return "final_norm";
    case Role::kFinalRstd:
      return "final_rstd";
    case Role::kLossGrad:
      return "loss_grad";
    case Role::kInputGrad:
      return "input_grad";
    case Role::kWorkBlock:
      return std::string("scratch.layer_work.") + kBlockNames[index];
    case Role::kScratch:
      return std::string("scratch.") + kScratchNames[index];
  }
  return "";
}

size_t ChunkSpec::slot_bytes() const {
  size_t bytes = 0;
  for (const auto& t : per_slot) bytes += t.arena_bytes();
  return bytes;
}

size_t ActivationSpec::activation_bytes() const {
  size_t bytes = 0;
  for (const auto& c : chunks) bytes += static_cast<size_t>(c.slots) * c.slot_bytes();
  return bytes;
}

size_t ActivationSpec::scratch_bytes() const {
  size_t bytes = 0;
  for (const auto& t : scratch) bytes += t.arena_bytes();
  return bytes;
}

ModelDims model_dims(const ModelConfig& config, const SpecLayout& layout, int64_t micro_rows) {
  const int64_t tps = layout.tp, cps = layout.cp;
  T3D_ASSERT(config.n_heads % tps == 0 && config.n_kv_heads % tps == 0 &&
                 config.vocab_size % tps == 0 && config.ffn_dim % tps == 0,
             "recipe validation lets through a model tp cannot shard");
  ModelDims d;
  d.H = config.n_heads / tps;
  d.Hkv = config.n_kv_heads / tps;
  d.F = config.ffn_dim / tps;
  d.V = config.vocab_size / tps;
  d.C = config.dim;
  d.D = config.head_dim();
  d.seq_len = config.seq_len;
  d.cp = cps > 1;
  d.parts = d.cp ? 2 : 1;
  T3D_USER_CHECK(config.seq_len % (d.parts * cps) == 0, "recipe error: `parallel.cp` = ", cps,
                 ": model.seq_len = ", config.seq_len, " must divide into 2·cp equal parts");
  d.T = config.seq_len / cps;
  d.part_len = d.T / d.parts;
  d.B = micro_rows;
  d.N = micro_rows * d.T;
  d.sp = layout.sequence_parallel && tps > 1;
  T3D_USER_CHECK(!d.sp || d.N % tps == 0, "recipe error: `parallel.sequence_parallel`: the ", d.N,
                 " tokens of a micro-batch do not split evenly over tp = ", tps,
                 "; change train.global_batch, train.micro_batches or model.seq_len");
  d.Nl = d.sp ? d.N / tps : d.N;
  return d;
}

ActivationSpec activation_spec(const ModelConfig& config, const SpecLayout& layout,
                               const SpecOptions& options) {
  T3D_ASSERT(options.chunk_slots.size() == layout.chunks.size(), options.chunk_slots.size(),
             " slot counts for ", layout.chunks.size(), " chunks");
  ActivationSpec spec;
  spec.dims = model_dims(config, layout, options.micro_rows);
  for (size_t ci = 0; ci < layout.chunks.size(); ++ci)
    spec.chunks.push_back(
        chunk_spec(spec.dims, layout.chunks[ci], options.chunk_slots[ci], options));
  spec.scratch = scratch_spec(spec.dims, layout, options);
  const bool copies = options.storage == ActivationStorage::kBf16Copies;
  Builder(spec.dims, options.storage)
      .block(spec.stored_block, copies ? Role::kBlockStored : Role::kBlock, -1);
  return spec;
}

}  // namespace t3d::runtime
