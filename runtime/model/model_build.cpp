// Building the Model: its parameter table and regions, then its activations and scratch from
// the model spec table (model_spec.h), each row bound to its pointer; the bf16 codec of stored
// blocks; the parameters' initialisation. The math is in model.cpp, the exchanges in
// model_collectives.cpp.
#include <cmath>
#include <cstring>

#include "kernels/check.h"
#include "kernels/gemm.h"
#include "kernels/hash.h"
#include "kernels/ops.h"
#include "kernels/precision.h"
#include "runtime/model/model.h"
#include "runtime/model/model_scratch.h"

namespace t3d::runtime {

namespace k = t3d::kernels;

namespace {

using k::splitmix64;

// Standard normal from a counter: Box-Muller on two hashed uniforms in (0, 1].
float normal_at(uint64_t key, uint64_t index) {
  const uint64_t a = splitmix64(key ^ splitmix64(2 * index)),
                 b = splitmix64(key ^ splitmix64(2 * index + 1));
  const double u1 = (static_cast<double>(a >> 11) + 1.0) * 0x1.0p-53;
  const double u2 = static_cast<double>(b >> 11) * 0x1.0p-53;
  return static_cast<float>(std::sqrt(-2.0 * std::log(u1)) * std::cos(2.0 * M_PI * u2));
}

}  // namespace

Model::Model(const ModelConfig& config, std::vector<parallel::LayerRange> chunks,
             const parallel::TensorComm& tp, k::Arena& arena, const ModelOptions& options)
    : config_(config), chunks_(std::move(chunks)), tp_(tp), arena_(arena), options_(options) {
  T3D_ASSERT(options_.chunk_slots.empty() || options_.chunk_slots.size() == chunks_.size(),
             options_.chunk_slots.size(), " slot counts for ", chunks_.size(), " chunks");
  SpecOptions spec_options;
  spec_options.micro_rows = options_.micro_rows;
  spec_options.chunk_slots = options_.chunk_slots.empty()
                                 ? std::vector<int64_t>(chunks_.size(), options_.slots)
                                 : options_.chunk_slots;
  spec_options.checkpoint_every = options_.checkpoint_every;
  spec_options.split_backward = options_.split_backward;
  spec_options.storage = options_.bf16 ? ActivationStorage::kBf16Copies : ActivationStorage::kFp32;
  const SpecLayout spec_layout{chunks_, tp_.size(), options_.sequence_parallel,
                               options_.cp ? options_.cp->size() : 1,
                               options_.ep ? options_.ep->size() : 1};
  const ActivationSpec spec = activation_spec(config_, spec_layout, spec_options);
  const ModelDims& d = spec.dims;
  dims_ = d;
  heads_ = d.H, kv_heads_ = d.Hkv, ffn_ = d.F, vocab_ = d.V;
  vocab_start_ = vocab_ * tp_.rank();
  cp_ = d.cp, sp_ = d.sp;
  parts_ = d.parts, part_len_ = d.part_len, seq_local_ = d.T;
  rows_ = d.N, rows_local_ = d.Nl;
  bool first = false, last = false;
  for (const auto& c : chunks_) first |= c.first, last |= c.last;
  // Whoever holds one end of a tied model must hold the other (ZB-V: stage 0 holds both).
  T3D_USER_CHECK(!config_.tie_embeddings || first == last,
                 "recipe error: `model.tie_embeddings` needs the embedding and the LM head on the "
                 "same rank (parallel.pp = 1, or parallel.schedule = \"zb_v\", whose stage 0 "
                 "holds both)");
  build_params();
  options_.exec.weight_copy = weight_copy_.get();
  allocate_activations(spec);
  allocate_scratch(spec);
  spec_ = spec;
}

void Model::build_params() {
  experts_ = options_.ep ? expert_share(config_, options_.ep->size(), options_.ep->rank())
                         : ExpertRange{0, config_.n_experts};
  params_ = param_table(config_, chunks_, experts_);
  std::vector<k::TensorSpec> table;
  for (const auto& p : params_)
    table.push_back({p.name, tp_shard_box(p, tp_.size(), tp_.rank()).shape});
  layout_ = k::ParamLayout(std::move(table));
  state_ = k::ModelState::allocate(arena_, layout_, options_.with_optimizer, options_.grad_region,
                                   options_.param_region);
  const ParamUnits units = param_units(config_, chunks_, tp_.size(), experts_);
  T3D_ASSERT(units.total_floats == layout_.total_floats(), "the spec's parameter region (",
             units.total_floats, " floats) is not the layout's (", layout_.total_floats(), ")");
  for (const StateGroup group : kStateGroups) {
    const GroupUnits g = group_units(config_, units, group);
    group_region_[static_cast<size_t>(group)] = {g.begin, g.end};
  }
  unit_begin_.assign(static_cast<size_t>(unit_slots(config_)), -1);
  for (const auto& u : units.units) {
    units_.push_back({u.unit, {u.begin, u.end}});
    unit_begin_[static_cast<size_t>(u.unit + 1)] = u.begin;
  }
  // Each block tensor's offset from the start of its unit, looked up once: a step does no name
  // lookups. Offsets, not pointers, because ZeRO moves a unit's gradients (and with ZeRO-3 its
  // gathered weights) between buffers; weights and gradients share the layout.
  block_offsets_.resize(static_cast<size_t>(config_.n_layers));
  for (const auto& range : chunks_)
    for (int64_t l = range.begin; l < range.end; ++l) {
      for (const BlockWeight t : kAllBlockWeights) {
        if (!block_has(config_, l, t)) continue;
        const bool expert = is_expert_weight(t);
        const int64_t unit0 =
            unit_begin_[static_cast<size_t>((expert ? experts_unit(config_, l) : l) + 1)];
        const int64_t first =
            layout_.at(block_param_name(l, t, expert ? experts_.begin : 0)).offset;
        block_offsets_[l][t] = first - unit0;
        if (!expert) continue;
        // The grouped pass reads a routed experts' row as one stack of the rank's experts.
        for (int64_t e = 1; e < experts_.size(config_); ++e) {
          const auto& x = layout_.at(block_param_name(l, t, experts_.begin + e));
          T3D_ASSERT(x.offset == first + e * x.numel, block_param_name(l, t, experts_.begin + e),
                     " does not follow expert ", experts_.begin + e - 1,
                     " in the region: recipe validation lets through an expert whose matrix is no "
                     "multiple of the arena's alignment");
        }
      }
      if (config_.moe_block(l)) moe_layers_.push_back(l);
    }
  expert_counts_.assign(moe_layers_.size() * static_cast<size_t>(config_.n_experts), 0.0);
  dropped_slots_.assign(moe_layers_.size(), 0.0);
  for (auto* v : {&routing_host_.chosen, &routing_host_.row_of_slot, &routing_host_.slot_of_row})
    v->assign(static_cast<size_t>(dims_.S), 0);
  const auto P = static_cast<size_t>(options_.ep ? options_.ep->size() : 1);
  ep_route_.mine.assign(static_cast<size_t>(config_.n_experts), 0);
  for (auto* v : {&ep_route_.send_counts, &ep_route_.send_displs, &ep_route_.recv_counts,
                  &ep_route_.recv_displs})
    v->assign(P, 0);
  ep_route_.local_offsets.assign(static_cast<size_t>(experts_.size(config_) + 1), 0);
  ep_route_.source_offsets.assign(P * static_cast<size_t>(experts_.size(config_)) + 1, 0);
  const size_t region = static_cast<size_t>(layout_.total_floats()) * sizeof(float);
  footprint_.params = options_.param_region ? region : 0;
  footprint_.grads = options_.grad_region ? region : 0;
  footprint_.optimizer = options_.with_optimizer ? 2 * region : 0;
}

void Model::allocate_activations(const ActivationSpec& spec) {
  const size_t before = arena_.used();
  acts_.resize(chunks_.size());
  for (size_t ci = 0; ci < chunks_.size(); ++ci) {
    const ChunkSpec& chunk = spec.chunks[ci];
    const auto blocks = static_cast<size_t>(chunk.range.size());
    for (int64_t s = 0; s < chunk.slots; ++s) {
      auto a = std::make_unique<ChunkActs>();
      a->x.resize(blocks + 1);
      a->layers.resize(blocks);  // recomputed and bf16-stored blocks: the work block, below
      if (options_.split_backward) a->wgrads.resize(blocks);
      if (options_.bf16) a->stored.resize(blocks);
      const std::string p = "activations.chunk" + std::to_string(ci) + ".slot" + std::to_string(s);
      for (const auto& t : chunk.per_slot)
        bind(*a, chunk.range, t, arena_.alloc_bytes(p + "." + t.name(), t.bytes()));
      acts_[ci].push_back(std::move(a));
    }
  }
  footprint_.activations = arena_.used() - before;
  T3D_ASSERT(footprint_.activations == spec.activation_bytes(), "activations took ",
             footprint_.activations, " bytes, the spec says ", spec.activation_bytes());
}

void Model::bind(ChunkActs& a, const parallel::LayerRange& range, const SpecTensor& t, void* p) {
  using Role = SpecTensor::Role;
  auto* f = static_cast<float*>(p);
  const auto i = static_cast<size_t>(t.layer - range.begin);
  // clang-format off
  switch (t.role) {
    case Role::kResidual: a.x[static_cast<size_t>(t.index)] = f; return;
    case Role::kBlock: set_block_act(a.layers[i], t.index, p); return;
    case Role::kBlockStored: a.stored[i][static_cast<size_t>(t.index)] = p; return;
    case Role::kWGrad: wgrad(a.wgrads[i], t.index) = f; return;
    case Role::kTokens: a.tokens = static_cast<int32_t*>(p); return;
    case Role::kFinalNorm: a.xf = f; return;
    case Role::kFinalRstd: a.rstdf = f; return;
    case Role::kLossGrad: a.dx_last = f; return;
    case Role::kInputGrad: a.dx_in = f; return;
    default: T3D_ASSERT(false, t.name(), " is not an activation");
  }
  // clang-format on
}

void Model::allocate_scratch(const ActivationSpec& spec) {
  const size_t before = arena_.used();
  scratch_ = std::make_unique<Scratch>();
  LayerActs& work = scratch_->work;
  for (const auto& t : spec.scratch) {
    void* p = arena_.alloc_bytes(t.name(), t.bytes());
    if (t.role == SpecTensor::Role::kWorkBlock)
      set_block_act(work, t.index, p);
    else
      bind_scratch(static_cast<ScratchBuf>(t.index), p);
  }
  // Each MoE block of each slot its own routing on the host (expert parallelism's counts only
  // with ep > 1), also where its arena rows are the work block's.
  const int64_t ep_counts = ep_size() > 1 ? ep_size() * experts_.size(config_) : 0;
  for (size_t ci = 0; ci < chunks_.size(); ++ci)
    for (auto& slot : acts_[ci])
      for (int64_t i = 0; i < chunks_[ci].size(); ++i) {
        LayerActs& a = slot->layers[static_cast<size_t>(i)];
        if (recomputed(i) || stored16(i)) a = work;
        if (!config_.moe_block(chunks_[ci].begin + i)) continue;
        auto routing = std::make_unique<BlockRouting>();
        routing->offsets.assign(static_cast<size_t>(config_.n_experts + 1), 0);
        routing->ep_recv.assign(static_cast<size_t>(ep_counts), 0);
        if (recomputed(i)) {
          routing->row_of_slot.assign(static_cast<size_t>(dims_.S), 0);
          routing->slot_of_row.assign(routing->row_of_slot.size(), 0);
        }
        a.routing = routing.get();
        routings_.push_back(std::move(routing));
      }
  stored_block_ = spec.stored_block;
  ep_rows_ = spec.dims.R;
  // Built on the host once, then copied in (the initial values' crossing).
  if (scratch_->moe_ep_index) {  // the identity: expert parallelism's rows are their own slots
    std::vector<int32_t> identity(static_cast<size_t>(spec.dims.R));
    for (int64_t r = 0; r < spec.dims.R; ++r)
      identity[static_cast<size_t>(r)] = static_cast<int32_t>(r);
    k::copy_from_host(options_.exec, scratch_->moe_ep_index, identity.data(),
                      identity.size() * sizeof(int32_t));
  }
  std::vector<float> rope(static_cast<size_t>(config_.seq_len * config_.head_dim()));
  k::rope_table(rope.data(), config_.seq_len, config_.head_dim(), config_.rope_theta,
                config_.rope());
  k::copy_from_host(options_.exec, scratch_->rope, rope.data(), rope.size() * sizeof(float));
  if (scratch_->ones) {
    const std::vector<float> ones(static_cast<size_t>(rows_), 1.0f);
    k::copy_from_host(options_.exec, scratch_->ones, ones.data(), ones.size() * sizeof(float));
  }
  footprint_.scratch = arena_.used() - before;
  T3D_ASSERT(footprint_.scratch == spec.scratch_bytes(), "scratch took ", footprint_.scratch,
             " bytes, the spec says ", spec.scratch_bytes());
}

void Model::bind_scratch(ScratchBuf buf, void* p) {
  auto& s = *scratch_;
  switch (buf) {
#define T3D_ROW_BIND(e, member, name, type, ...) \
  case ScratchBuf::e:                            \
    s.member = static_cast<type*>(p);            \
    return;
    T3D_SCRATCH(T3D_ROW_BIND)
#undef T3D_ROW_BIND
  }
}

const void* Model::bound(const ChunkActs& a, const parallel::LayerRange& range,
                         const SpecTensor& t) const {
  using Role = SpecTensor::Role;
  const auto i = static_cast<size_t>(t.layer - range.begin);
  switch (t.role) {
    case Role::kResidual:
      return a.x[static_cast<size_t>(t.index)];
    case Role::kBlock:
      return block_act(a.layers[i], t.index);
    case Role::kBlockStored:
      return a.stored[i][static_cast<size_t>(t.index)];
    case Role::kWGrad:
      return wgrad(const_cast<LayerGrads&>(a.wgrads[i]), t.index);
    case Role::kTokens:
      return a.tokens;
    case Role::kFinalNorm:
      return a.xf;
    case Role::kFinalRstd:
      return a.rstdf;
    case Role::kLossGrad:
      return a.dx_last;
    case Role::kInputGrad:
      return a.dx_in;
    default:
      return nullptr;
  }
}

const void* Model::bound_scratch(const SpecTensor& t) const {
  const Scratch& s = *scratch_;
  if (t.role == SpecTensor::Role::kWorkBlock) return block_act(s.work, t.index);
  switch (static_cast<ScratchBuf>(t.index)) {
#define T3D_ROW_READ(e, member, ...) \
  case ScratchBuf::e:                \
    return s.member;
    T3D_SCRATCH(T3D_ROW_READ)
#undef T3D_ROW_READ
  }
  return nullptr;
}

std::vector<Model::BoundRow> Model::bound_rows() const {
  std::vector<BoundRow> out;
  for (size_t ci = 0; ci < spec_.chunks.size(); ++ci)
    for (size_t s = 0; s < acts_[ci].size(); ++s)
      for (const auto& t : spec_.chunks[ci].per_slot)
        out.push_back({"activations.chunk" + std::to_string(ci) + ".slot" + std::to_string(s) +
                           "." + t.name(),
                       bound(*acts_[ci][s], chunks_[ci], t), t.arena_bytes()});
  for (const auto& t : spec_.scratch) out.push_back({t.name(), bound_scratch(t), t.arena_bytes()});
  return out;
}

Model::~Model() = default;

void Model::round_weights() {
  const k::Exec& exec = options_.exec;
  if (!k::gemm_kind_is_bf16(exec.gemm) || !state_.params.data()) return;
  k::WeightCopy& copy = *weight_copy_;
  if (copy.tensors.empty()) {  // laid out at the first call: each tensor's copy on kAlignment
    constexpr int64_t kAlign = static_cast<int64_t>(k::kAlignment / sizeof(k::bf16));
    int64_t at = 0;
    for (const auto& e : layout_.entries()) {
      copy.tensors.push_back({e.offset, e.offset + e.numel, at});
      at = (at + e.numel + kAlign - 1) / kAlign * kAlign;
    }
    weight_copy_memory_.reserve(exec, static_cast<size_t>(at) * sizeof(k::bf16),
                                "the bf16 copy of the weights");
    copy.rounded = weight_copy_memory_.as<k::bf16>();
  }
  copy.data = state_.params.data();
  weight_casts_.clear();
  for (const auto& t : copy.tensors)
    weight_casts_.push_back(
        {weight_copy_memory_.as<k::bf16>() + t.at, copy.data + t.begin, t.end - t.begin});
  k::float_to_bf16_many(exec, weight_casts_.data(),
                        static_cast<std::int64_t>(weight_casts_.size()));
  copy.current = true;
}

void* Model::block_act(const LayerActs& a, int index) {
  switch (static_cast<BlockAct>(index)) {
#define T3D_ROW_READ(e, member, ...) \
  case BlockAct::e:                  \
    return a.member;
    T3D_BLOCK_ACTS(T3D_ROW_READ)
#undef T3D_ROW_READ
  }
  return nullptr;
}

void Model::set_block_act(LayerActs& a, int index, void* p) {
  switch (static_cast<BlockAct>(index)) {
#define T3D_ROW_BIND(e, member, name, type, ...) \
  case BlockAct::e:                              \
    a.member = static_cast<type*>(p);            \
    return;
    T3D_BLOCK_ACTS(T3D_ROW_BIND)
#undef T3D_ROW_BIND
  }
}

float*& Model::wgrad(LayerGrads& g, int index) {
#define T3D_ROW_MEMBER_PTR(e, member, ...) &LayerGrads::member,
  static constexpr float* LayerGrads::*kMember[kWGrads] = {T3D_WGRADS(T3D_ROW_MEMBER_PTR)};
#undef T3D_ROW_MEMBER_PTR
  return g.*kMember[index];
}

namespace {
// The SwiGLU rows a fused bf16 SwiGLU writes and reads as copies: the routed experts' and the
// shared experts' (the dense MLP's are kGate, kUp, kH).
bool expert_row(BlockAct row) {
  return row == BlockAct::kEGate || row == BlockAct::kEUp || row == BlockAct::kEH ||
         row == BlockAct::kSGate || row == BlockAct::kSUp || row == BlockAct::kSH;
}
}  // namespace

// h's copies (the dense MLP's and the shared experts') are filled by the forward even unfused:
// the down GEMM's input rounded there (kernels/ops_swiglu.h).
bool Model::filled_by_forward(int index, bool bf16_gemms) {
  const auto row = static_cast<BlockAct>(index);
  return row == BlockAct::kXn1 || row == BlockAct::kAttn || row == BlockAct::kXn2 ||
         row == BlockAct::kH || row == BlockAct::kSH ||
         (bf16_gemms && (row == BlockAct::kGate || row == BlockAct::kUp)) ||
         (bf16_gemms && expert_row(row));
}

bool Model::only_copy_read(int index, bool bf16_gemms) {
  const auto row = static_cast<BlockAct>(index);
  return bf16_gemms && (row == BlockAct::kXn1 || row == BlockAct::kXn2 || row == BlockAct::kH ||
                        row == BlockAct::kGate || row == BlockAct::kUp || expert_row(row));
}

Model::BlockCopies Model::block_copies(ChunkActs& a, int64_t local_layer) const {
  if (!stored16(local_layer)) return {};
  const StoredBlock& st = a.stored[static_cast<size_t>(local_layer)];
  const auto at = [&](BlockAct row) { return static_cast<k::bf16*>(st[static_cast<size_t>(row)]); };
  BlockCopies c;
  c.xn1 = at(BlockAct::kXn1), c.att = at(BlockAct::kAttn), c.xn2 = at(BlockAct::kXn2);
  c.gate = at(BlockAct::kGate), c.up = at(BlockAct::kUp), c.h = at(BlockAct::kH);
  c.egate = at(BlockAct::kEGate), c.eup = at(BlockAct::kEUp), c.eh = at(BlockAct::kEH);
  c.sgate = at(BlockAct::kSGate), c.sup = at(BlockAct::kSUp), c.sh = at(BlockAct::kSH);
  c.fused_swiglu = k::gemm_kind_is_bf16(options_.exec.gemm);
  return c;
}

// The codec of bf16-stored blocks: the spec's stored rows, each copied between the block's fp32
// buffers and its stored copy (bf16, or fp32 for the per-row statistics), except the rows the
// forward fills itself and those only read from the copy (BlockCopies).
void Model::encode16(LayerActs& from, const StoredBlock& to) const {
  const bool bf16_gemms = k::gemm_kind_is_bf16(options_.exec.gemm);
  for (const auto& t : stored_block_) {
    if (filled_by_forward(t.index, bf16_gemms)) continue;
    const void* f = block_act(from, t.index);
    void* stored = to[static_cast<size_t>(t.index)];
    if (!stored) continue;  // a row of the other kind of block (dense or mixture of experts)
    if (t.dtype == Dtype::kBF16)
      k::float_to_bf16(options_.exec, static_cast<k::bf16*>(stored), static_cast<const float*>(f),
                       t.elems);
    else  // fp32 or int32 rows: a bit copy of 4-byte elements
      k::copy(options_.exec, static_cast<float*>(stored), static_cast<const float*>(f), t.elems);
  }
}

void Model::decode16(const StoredBlock& from, LayerActs& to) const {
  const bool bf16_gemms = k::gemm_kind_is_bf16(options_.exec.gemm);
  for (const auto& t : stored_block_) {
    if (only_copy_read(t.index, bf16_gemms)) continue;
    void* f = block_act(to, t.index);
    const void* stored = from[static_cast<size_t>(t.index)];
    if (!stored) continue;  // a row of the other kind of block (dense or mixture of experts)
    if (t.dtype == Dtype::kBF16)
      k::bf16_to_float(options_.exec, static_cast<float*>(f), static_cast<const k::bf16*>(stored),
                       t.elems);
    else  // fp32 or int32 rows: a bit copy of 4-byte elements
      k::copy(options_.exec, static_cast<float*>(f), static_cast<const float*>(stored), t.elems);
  }
}

void Model::init(uint64_t seed, const InitSink& keep) {
  T3D_ASSERT(keep || state_.params.data(),
             "a model without a parameter region initialises into its caller's sink");
  const double base_std = 0.02;
  // GPT-2 / Megatron: projections into the residual stream shrink with depth.
  const double out_std = base_std / std::sqrt(2.0 * config_.n_layers);
  std::vector<float> values;  // one tensor at a time, on the host
  for (const auto& p : params_) {
    const auto& e = layout_.at(p.name);
    values.resize(static_cast<size_t>(e.numel));
    if (p.init == ParamInit::kOnes || p.init == ParamInit::kZeros) {
      std::fill(values.begin(), values.end(), p.init == ParamInit::kOnes ? 1.0f : 0.0f);
    } else {
      const auto stddev =
          static_cast<float>(p.init == ParamInit::kResidualOut ? out_std : base_std);
      draw_normal(p, splitmix64(static_cast<uint64_t>(seed) ^ k::fnv1a64(p.name)), stddev,
                  values.data());
    }
    if (keep)
      keep(e.offset, values.data(), e.numel);
    else
      k::copy_from_host(options_.exec, state_.params.data() + e.offset, values.data(),
                        values.size() * sizeof(float));
  }
}

void Model::draw_normal(const ParamInfo& p, uint64_t key, float stddev, float* data) const {
  T3D_ASSERT(p.global_shape.size() >= 2, p.name, ": normal init of a matrix or a stack of them");
  // Element g of the global tensor (row-major) draws normal_at(key, g): the box's rows are
  // walked as (leading indices, last dimension), each row contiguous locally.
  const TensorBox box = tp_shard_box(p, tp_.size(), tp_.rank());
  const size_t dims = box.shape.size();
  const int64_t cols = box.shape[dims - 1], col0 = box.offset[dims - 1];
  const int64_t rows = box.numel() / cols;
  std::vector<int64_t> index(dims - 1, 0);  // the local row's leading indices
  for (int64_t r = 0; r < rows; ++r) {
    int64_t g = 0;  // the global flat index of the row's first element
    for (size_t i = 0; i + 1 < dims; ++i)
      g = (g + box.offset[i] + index[i]) * p.global_shape[i + 1];
    g += col0;
    for (int64_t c = 0; c < cols; ++c)
      data[r * cols + c] = stddev * normal_at(key, static_cast<uint64_t>(g + c));
    for (size_t i = dims - 1; i-- > 0;) {  // next row: odometer over the leading indices
      if (++index[i] < box.shape[i]) break;
      index[i] = 0;
    }
  }
}

std::vector<Model::GradUnit> Model::grad_units(StateGroup group) const {
  std::vector<GradUnit> out;
  for (const auto& u : units_)
    if (state_group(config_, u.unit) == group) out.push_back(u);
  return out;
}

}  // namespace t3d::runtime
