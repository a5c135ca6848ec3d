#include "runtime/model/model_spec.h"

#include <algorithm>
#include <array>

#include "kernels/arena.h"
#include "kernels/check.h"
#include "kernels/ops.h"
#include "kernels/ops_moe.h"

namespace t3d::runtime {

namespace {

using Role = SpecTensor::Role;

int64_t padded(int64_t floats) {
  const auto a = static_cast<int64_t>(kernels::kAlignmentFloats);
  return (floats + a - 1) / a * a;
}

#define T3D_SHAPE(...) \
  std::vector<int64_t> { __VA_ARGS__ }

constexpr const char* kBlockWeightSuffixes[] = {
#define T3D_ROW_NAME(e, member, name, ...) name,
    T3D_BLOCK_WEIGHTS(T3D_ROW_NAME)
#undef T3D_ROW_NAME
};
#define T3D_ROW_NAME(e, member, name, ...) name,
constexpr const char* kBlockNames[] = {T3D_BLOCK_ACTS(T3D_ROW_NAME)};
constexpr const char* kWGradNames[] = {T3D_WGRADS(T3D_ROW_NAME)};
constexpr const char* kScratchNames[] = {T3D_SCRATCH(T3D_ROW_NAME)};
#undef T3D_ROW_NAME

// A block's activations in BlockAct order: elements, and whether it is a per-row statistic
// (those stay fp32 whatever the storage).
struct BlockRow {
  int64_t elems;
  bool statistic;
};
std::array<BlockRow, kBlockActs> block_rows(const ModelDims& d, const BlockDims& b) {
#define T3D_ROW(e, member, name, type, statistic, elems) BlockRow{elems, statistic},
  return {{T3D_BLOCK_ACTS(T3D_ROW)}};
#undef T3D_ROW
}

// The rows of block `layer`, or with layer -1 (the work block every recomputed or bf16-stored
// block computes in) each row as large as any kind of block in the model makes it.
std::array<BlockRow, kBlockActs> block_rows(const ModelDims& d, int64_t layer, bool moe_layer) {
  if (layer >= 0) return block_rows(d, block_dims(d, moe_layer));
  auto rows = block_rows(d, block_dims(d, false));
  if (d.E == 0) return rows;
  const auto moe = block_rows(d, block_dims(d, true));
  if (!d.dense_blocks) return moe;
  for (int i = 0; i < kBlockActs; ++i) rows[i].elems = std::max(rows[i].elems, moe[i].elems);
  return rows;
}

// The W rows of a block of dims `b` in WGrad order: elements, and whether the row stays fp32.
struct WGradRow {
  int64_t elems;
  bool fp32;
};
std::array<WGradRow, kWGrads> wgrad_rows(const ModelDims& d, const BlockDims& b) {
#define T3D_ROW(e, member, name, fp32, elems) WGradRow{elems, fp32},
  return {{T3D_WGRADS(T3D_ROW)}};
#undef T3D_ROW
}

// Builds the rows: `wide` (activation-sized) tensors take the storage's element type.
class Builder {
 public:
  Builder(const ModelDims& d, ActivationStorage storage, const ModelConfig* config = nullptr)
      : d_(d), storage_(storage), config_(config) {}
  Dtype wide() const { return storage_ == ActivationStorage::kBf16 ? Dtype::kBF16 : Dtype::kF32; }

  // One block's rows: computed in place (kBlock) or its stored copy (kBlockStored: bf16 tensors
  // first, then the fp32 statistics, the codec's order).
  // Rows of 0 elements (the other kind of block's) are left out.
  void block(std::vector<SpecTensor>& out, Role role, int64_t layer) const {
    const auto rows = block_rows(d_, layer, layer >= 0 && config_ && config_->moe_block(layer));
    if (role != Role::kBlockStored) {
      for (int i = 0; i < kBlockActs; ++i)
        if (rows[i].elems > 0)
          out.push_back({role, i, layer, rows[i].statistic ? Dtype::kF32 : wide(), rows[i].elems});
      return;
    }
    for (bool statistic : {false, true})
      for (int i = 0; i < kBlockActs; ++i)
        if (rows[i].statistic == statistic && rows[i].elems > 0)
          out.push_back({role, i, layer, statistic ? Dtype::kF32 : Dtype::kBF16, rows[i].elems});
  }

 private:
  ModelDims d_;
  ActivationStorage storage_;
  const ModelConfig* config_;  // which blocks are mixtures of experts (null: layer -1 only)
};

ChunkSpec chunk_spec(const ModelConfig& config, const ModelDims& d,
                     const parallel::LayerRange& range, int64_t slots, const SpecOptions& o) {
  const Builder b(d, o.storage, &config);
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
    const auto w = wgrad_rows(d, block_dims(d, config.moe_block(l)));
    for (int i = 0; i < kWGrads; ++i)
      if (w[static_cast<size_t>(i)].elems > 0)
        rows.push_back({Role::kWGrad, i, l, w[i].fp32 ? Dtype::kF32 : b.wide(), w[i].elems});
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
  const Builder b(d, o.storage);
  ScratchContext x;
  for (const auto& c : layout.chunks) x.last |= c.last;
  x.copies = o.storage == ActivationStorage::kBf16Copies;
  x.attention_tiles =
      kernels::attention_scratch_floats(kernels::AttentionShape{d.B, d.part_len, d.H, d.Hkv, d.D});
  x.whole_kv = d.B * d.seq_len * d.Hkv * d.D;
  // The names of T3D_SCRATCH's precision column.
  const Dtype kWide = b.wide(), kF32 = Dtype::kF32, kBF16 = Dtype::kBF16, kI32 = Dtype::kI32;
  std::vector<SpecTensor> s;
  const auto row = [&](ScratchBuf buf, Dtype dtype, bool present, int64_t elems) {
    // One block's activations, shared by every recomputed or bf16-stored block: written by its
    // forward (then stored in bf16, or dropped), rebuilt right before its backward. Allocated
    // before the TP staging buffers.
    if (buf == ScratchBuf::kTpBf16 && (o.checkpoint_every > 0 || x.copies))
      b.block(s, Role::kWorkBlock, -1);
    // A row of 0 elements (the dense MLP's backward where no block has one) is absent.
    if (present && elems > 0)
      s.push_back({Role::kScratch, static_cast<int>(buf), -1, dtype, elems});
  };
#define T3D_ROW(e, member, name, type, precision, present, elems) \
  row(ScratchBuf::e, precision, present, elems);
  T3D_SCRATCH(T3D_ROW)
#undef T3D_ROW
  return s;
}

}  // namespace

const char* block_weight_suffix(BlockWeight w) {
  return kBlockWeightSuffixes[static_cast<size_t>(w)];
}

std::string block_param_name(int64_t layer, BlockWeight w, int64_t expert) {
  const std::string block = "model.layers." + std::to_string(layer) + ".";
  if (is_expert_weight(w))
    return block + "mlp.experts." + std::to_string(expert) + "." + block_weight_suffix(w);
  return block + block_weight_suffix(w);
}

bool block_has(const ModelConfig& m, int64_t layer, BlockPart part) {
  switch (part) {
    case BlockPart::kAll:
      return true;
    case BlockPart::kDense:
      return !m.moe_block(layer);
    case BlockPart::kRouted:
    case BlockPart::kExperts:
      return m.moe_block(layer);
    case BlockPart::kRouterBias:
      return m.moe_block(layer) && m.router_bias_rate > 0;
    case BlockPart::kShared:
      return m.moe_block(layer) && m.n_shared_experts > 0;
    case BlockPart::kQkvBias:
      return m.qkv_bias;
    case BlockPart::kQkNorm:
      return m.qk_norm;
    case BlockPart::kSharedGated:
      return m.moe_block(layer) && m.n_shared_experts > 0 && m.shared_expert_gate;
  }
  return false;
}

#define T3D_ROW_PART(e, member, suffix, shape, split_dim, decay, init, part) BlockPart::part,
constexpr BlockPart kBlockWeightParts[] = {T3D_BLOCK_WEIGHTS(T3D_ROW_PART)};
#undef T3D_ROW_PART

bool block_has(const ModelConfig& m, int64_t layer, BlockWeight w) {
  return block_has(m, layer, kBlockWeightParts[static_cast<size_t>(w)]);
}

bool is_expert_weight(BlockWeight w) {
  return kBlockWeightParts[static_cast<size_t>(w)] == BlockPart::kExperts;
}

int64_t ExpertRange::size(const ModelConfig& config) const {
  return (end < 0 ? config.n_experts : end) - begin;
}

ExpertRange expert_share(const ModelConfig& config, int64_t ep, int64_t rank) {
  const int64_t n = config.n_experts / ep;
  return {rank * n, (rank + 1) * n};
}

std::vector<ParamInfo> param_table(const ModelConfig& m,
                                   const std::vector<parallel::LayerRange>& chunks,
                                   ExpertRange experts) {
  const int64_t C = m.dim, D = m.head_dim(), V = m.vocab_size;
  const int64_t H = m.n_heads, Hkv = m.n_kv_heads, F = m.ffn_dim;
  const int64_t E = m.n_experts, Fe = m.moe_ffn_dim, Fs = m.shared_ffn_dim();
  const int64_t first = experts.begin, last = experts.begin + experts.size(m);
  using enum ParamInit;
  std::vector<ParamInfo> t, routed;
  for (const auto& range : chunks) {
    if (range.first) t.push_back({"model.embed_tokens.weight", {V, C}, 0, true, kNormal, -1});
    for (int64_t l = range.begin; l < range.end; ++l) {
#define T3D_ROW(e, member, suffix, shape, split_dim, decay, init, part)                            \
  if (BlockPart::part == BlockPart::kExperts && block_has(m, l, BlockPart::part)) {                \
    for (int64_t x = first; x < last; ++x)                                                         \
      routed.push_back({block_param_name(l, BlockWeight::e, x), T3D_SHAPE shape, split_dim, decay, \
                        init, experts_unit(m, l), BlockWeight::e, x});                             \
  } else if (block_has(m, l, BlockPart::part)) {                                                   \
    t.push_back({block_param_name(l, BlockWeight::e), T3D_SHAPE shape, split_dim, decay, init, l,  \
                 BlockWeight::e});                                                                 \
  }
      T3D_BLOCK_WEIGHTS(T3D_ROW)
#undef T3D_ROW
    }
    if (range.last) {
      t.push_back({"model.norm.weight", {C}, -1, false, kOnes, m.n_layers});
      if (!m.tie_embeddings) t.push_back({"lm_head.weight", {V, C}, 0, true, kNormal, m.n_layers});
    }
  }
  t.insert(t.end(), routed.begin(), routed.end());
  return t;
}

std::vector<ParamInfo> param_table(const ModelConfig& config) {
  return param_table(config, {parallel::LayerRange{0, config.n_layers, true, true}});
}

int64_t TensorBox::numel() const {
  int64_t n = 1;
  for (const int64_t s : shape) n *= s;
  return n;
}

TensorBox tp_shard_box(const ParamInfo& p, int64_t tp, int64_t rank) {
  TensorBox box{std::vector<int64_t>(p.global_shape.size(), 0), p.global_shape};
  if (p.split_dim >= 0) {
    const auto dim = static_cast<size_t>(p.split_dim);
    box.shape[dim] /= tp;
    box.offset[dim] = rank * box.shape[dim];
  }
  return box;
}

ParamUnits param_units(const ModelConfig& config, const std::vector<parallel::LayerRange>& chunks,
                       int64_t tp, ExpertRange experts) {
  ParamUnits out;
  for (const ParamInfo& p : param_table(config, chunks, experts)) {
    const int64_t n = tp_shard_box(p, tp, 0).numel();
    if (out.units.empty() || out.units.back().unit != p.unit)
      out.units.push_back({p.unit, out.total_floats, 0});
    out.units.back().end = out.total_floats + n;
    out.total_floats += padded(n);
  }
  return out;
}

GroupUnits group_units(const ModelConfig& config, const ParamUnits& all, StateGroup group) {
  GroupUnits out;
  for (const auto& u : all.units) {
    if (state_group(config, u.unit) == group) {
      if (out.units.empty()) out.begin = out.end = u.begin;
      out.units.push_back(u);
    } else if (!out.units.empty() && out.end == out.begin) {
      out.end = u.begin;  // the next group starts
    }
  }
  if (!out.units.empty() && out.end == out.begin) out.end = all.total_floats;
  return out;
}

int64_t block_param_floats(const ModelConfig& config, int64_t tp) {
  int64_t largest = 0;  // a dense block (the first) and a mixture of experts (the last)
  for (const int64_t l : {int64_t{0}, config.n_layers - 1})
    largest = std::max(
        largest,
        param_units(config, {parallel::LayerRange{l, l + 1, false, false}}, tp).total_floats);
  return largest;
}

BlockFlops block_flops_per_token(const ModelConfig& config, int64_t tp, int64_t layer) {
  if (layer < 0) layer = config.n_layers - 1;
  double weights = 0;  // the block's matrices on one tp rank (its norm weights are no matmul)
  for (const ParamInfo& p :
       param_table(config, {parallel::LayerRange{layer, layer + 1, false, false}})) {
    const auto n = static_cast<double>(tp_shard_box(p, tp, 0).numel());
    if (p.global_shape.size() != 2) continue;
    if (p.expert < 0)
      weights += n;
    else  // a routed expert: K of the E per token
      weights +=
          n * static_cast<double>(config.experts_per_token) / static_cast<double>(config.n_experts);
  }
  const double heads = static_cast<double>(config.n_heads / tp);
  return {2.0 * weights,
          4 * heads * static_cast<double>(config.head_dim()) * static_cast<double>(config.seq_len)};
}

double head_train_flops_per_token(const ModelConfig& config, int64_t tp) {
  return 6.0 * static_cast<double>(config.vocab_size / tp) * static_cast<double>(config.dim);
}

double model_train_flops_per_token(const ModelConfig& config) {
  double blocks = 0;
  for (int64_t l = 0; l < config.n_layers; ++l)
    blocks += block_flops_per_token(config, 1, l).train();
  return blocks + head_train_flops_per_token(config, 1);
}

int64_t dtype_bytes(Dtype dtype) { return dtype == Dtype::kBF16 ? 2 : 4; }

size_t SpecTensor::arena_bytes() const { return kernels::aligned_bytes(bytes()); }

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
  d.dense_blocks = config.dense_blocks();
  d.qkv_bias = config.qkv_bias;
  d.qk_norm = config.qk_norm;
  d.Fw = d.dense_blocks ? d.F : 0;
  if (config.moe()) {
    T3D_ASSERT(config.moe_ffn_dim % tps == 0 && config.shared_ffn_dim() % tps == 0,
               "recipe validation lets through experts tp cannot shard");
    d.E = config.n_experts;
    d.K = config.experts_per_token;
    d.S = d.N * d.K;
    d.Fe = config.moe_ffn_dim / tps;
    d.Fs = config.shared_ffn_dim() / tps;
    d.aux = config.router_aux_coef > 0;
    d.shared_gate = config.shared_expert_gate && config.n_shared_experts > 0;
    d.Fw = std::max(d.Fw, d.Fs);
    d.P = layout.ep;
    d.El = d.E / d.P;
    d.R = d.P * d.S;
    // With a capacity every expert takes at most its capacity from each source rank: E of them.
    if (config.capacity_factor > 0)
      d.R = std::min(d.R, d.E * kernels::moe_capacity(config.capacity_factor, d.N, d.E, d.K));
  }
  return d;
}

BlockDims block_dims(const ModelDims& d, bool moe) {
  if (!moe) return {d.F, 0, 0, 0, 0, 0};
  return {0, d.E, d.K, d.S, d.Fe, d.Fs, d.P, d.El, d.R};
}

ActivationSpec activation_spec(const ModelConfig& config, const SpecLayout& layout,
                               const SpecOptions& options) {
  T3D_ASSERT(options.chunk_slots.size() == layout.chunks.size(), options.chunk_slots.size(),
             " slot counts for ", layout.chunks.size(), " chunks");
  ActivationSpec spec;
  spec.dims = model_dims(config, layout, options.micro_rows);
  for (size_t ci = 0; ci < layout.chunks.size(); ++ci)
    spec.chunks.push_back(
        chunk_spec(config, spec.dims, layout.chunks[ci], options.chunk_slots[ci], options));
  spec.scratch = scratch_spec(spec.dims, layout, options);
  const bool copies = options.storage == ActivationStorage::kBf16Copies;
  Builder(spec.dims, options.storage)
      .block(spec.stored_block, copies ? Role::kBlockStored : Role::kBlock, -1);
  return spec;
}

}  // namespace t3d::runtime
