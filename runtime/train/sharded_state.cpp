#include "runtime/train/sharded_state.h"

#include <spdlog/spdlog.h>

#include <algorithm>
#include <utility>

#include "kernels/check.h"
#include "kernels/ops.h"

namespace t3d::runtime {

namespace {

// Boxes of a row-major [rows, cols] (or 1-D) tensor covering its flat elements [a, b): a partial
// first row, whole rows, a partial last row. Each is contiguous in flat order, so its data is
// one span of a flat array. Returns (offset, shape) pairs in flat order.
std::vector<std::pair<std::vector<int64_t>, std::vector<int64_t>>> flat_boxes(
    const std::vector<int64_t>& shape, int64_t a, int64_t b) {
  if (shape.size() == 1) return {{{a}, {b - a}}};
  const int64_t cols = shape[1];
  std::vector<std::pair<std::vector<int64_t>, std::vector<int64_t>>> out;
  if (a % cols != 0) {
    const int64_t end = std::min(b, (a / cols + 1) * cols);
    out.push_back({{a / cols, a % cols}, {1, end - a}});
    a = end;
  }
  if (b / cols > a / cols) {
    out.push_back({{a / cols, 0}, {b / cols - a / cols, cols}});
    a = b / cols * cols;
  }
  if (a < b) out.push_back({{a / cols, 0}, {1, b - a}});
  return out;
}

// The sections of the state a snapshot holds, as dataset-path prefixes.
constexpr const char* kSections[] = {"model/", "optim/exp_avg/", "optim/exp_avg_sq/"};

}  // namespace

ShardedState::ShardedState(Model& model, StateGroup kind, const parallel::TensorComm& group,
                           int zero, double bucket_mb, kernels::Arena& arena)
    : model_(model),
      kind_(kind),
      region_(model.group_region(kind)),
      group_(group),
      zero_(zero),
      bucket_mb_(bucket_mb) {
  const parallel::FullRegions full = parallel::full_regions(zero_);
  T3D_ASSERT(full.params == (model.state().params.data() != nullptr) &&
                 full.grads == (model.state().grads.data() != nullptr) &&
                 full.moments == (model.state().adam_m.data() != nullptr),
             "ZeRO ", zero_, ": the model's regions do not fit the stage");
  std::vector<parallel::FloatRange> units;
  for (const auto& u : model.grad_units(kind)) units.push_back(u.range);
  T3D_ASSERT(!units.empty(), "the model holds no gradient unit of this state group");
  partition_ = parallel::BucketPartition(
      parallel::make_buckets(units, parallel::bucket_floats(bucket_mb), &units_per_bucket_),
      group.size(), group.rank());
  buffers_ = parallel::ZeroBuffers::allocate(zero_, partition_, arena);
  reducer_ = std::make_unique<parallel::GradReducer>(model.exec(), group, zero_, partition_,
                                                     units_per_bucket_, model.state().grads.data(),
                                                     buffers_);
  attach_to_model();
  if (full.moments) return;
  const auto n = static_cast<size_t>(partition_.shard_floats);
  m_shard_ = arena.alloc_floats("optimizer.exp_avg (ZeRO shard)", n);
  v_shard_ = arena.alloc_floats("optimizer.exp_avg_sq (ZeRO shard)", n);
  kernels::zero(model_.exec(), m_shard_, static_cast<int64_t>(n));
  kernels::zero(model_.exec(), v_shard_, static_cast<int64_t>(n));
}

ShardedState::~ShardedState() = default;

void ShardedState::attach_to_model() {
  const auto& buckets = partition_.buckets;
  // [unit + 1] -> its bucket, and its offset from the bucket's start.
  std::vector<int> bucket_of(static_cast<size_t>(unit_slots(model_.config())), -1);
  std::vector<int64_t> unit_offset(bucket_of.size(), 0);
  size_t b = 0;
  for (const auto& u : model_.grad_units(kind_)) {
    while (u.range.begin >= buckets[b].end) ++b;
    bucket_of[static_cast<size_t>(u.unit + 1)] = static_cast<int>(b);
    unit_offset[static_cast<size_t>(u.unit + 1)] = u.range.begin - buckets[b].begin;
  }
  parallel::GradReducer* red = reducer_.get();
  red->set_before_reduce([this, red](int bucket, float* data) {
    model_.sum_replicated_grads(red->buckets()[bucket], data);  // sequence parallel only
    const int64_t n = red->buckets()[bucket].size();
    if (flip_bit_ >= 0) kernels::flip_bit(model_.exec(), data, n / 2, std::exchange(flip_bit_, -1));
    if (tap_) tap_(bucket, data, n);
  });
  model_.set_grad_source(kind_, [red, bucket_of, unit_offset](int64_t unit) {
    const auto u = static_cast<size_t>(unit + 1);
    return red->bucket_grads(bucket_of[u]) + unit_offset[u];
  });
  model_.set_grad_hook(kind_, [red, bucket_of](int64_t unit) {
    red->unit_done(bucket_of[static_cast<size_t>(unit + 1)]);
  });
  if (buffers_.param_shard)
    model_.set_weight_source(kind_, [red, bucket_of, unit_offset](int64_t unit) {
      const auto u = static_cast<size_t>(unit + 1);
      return red->bucket_params(bucket_of[u]) + unit_offset[u];
    });
}

void ShardedState::keep_shard(int64_t offset, const float* values, int64_t n) {
  for (size_t b = 0; b < partition_.buckets.size(); ++b) {
    const parallel::FloatRange& mine = partition_.mine[b];
    const int64_t lo = std::max(mine.begin, offset), hi = std::min(mine.end, offset + n);
    if (lo >= hi) continue;
    kernels::copy_from_host(model_.exec(),
                            buffers_.param_shard + partition_.shard_offset[b] + (lo - mine.begin),
                            values + (lo - offset), sizeof(float) * static_cast<size_t>(hi - lo));
  }
}

void ShardedState::restored() {
  if (buffers_.param_shard) reducer_->gather_params(nullptr);
}

parallel::StateBytes ShardedState::footprint() const {
  const auto region = static_cast<double>(region_.size());
  return parallel::zero_state_bytes(zero_,
                                    {region, static_cast<double>(partition_.shard_floats),
                                     static_cast<double>(partition_.largest_bucket)},
                                    parallel::StateBytesPerFloat{});
}

void ShardedState::log_footprint(bool rank0) const {
  const size_t shard = kernels::aligned_bytes(sizeof(float) * partition_.shard_floats);
  const size_t buffer = kernels::aligned_bytes(sizeof(float) * partition_.largest_bucket);
  if (buffers_.param_shard)
    spdlog::info("ZeRO-3 parameter bytes: shard {} + {} gather buffers × {} (the largest bucket)",
                 shard, parallel::kGatherBuffers, buffer);
  if (!buffers_.grad_shard) return;
  spdlog::info("ZeRO-2 gradient bytes: shard {} + {} staging buffers × {} (the largest bucket)",
               shard, parallel::kStagingBuffers, buffer);
  // A bucket is at least one layer; parallel.bucket_mb larger than the stage's gradients/dp
  // makes the staging buffers cost more than the sharding saves.
  if (rank0 && parallel::kStagingBuffers * buffer > shard)
    spdlog::warn(
        "parallel.zero = 2: the {} staging buffers ({} bytes each, the largest gradient "
        "bucket) outweigh the gradient shard ({} bytes); lower parallel.bucket_mb "
        "(now {}) to about 1/{} of the stage's gradients or less, or use ZeRO-1",
        parallel::kStagingBuffers, buffer, shard, bucket_mb_, 4 * group_.size());
}

void ShardedState::log_counters() const {
  if (buffers_.grad_shard)
    spdlog::info("gradient bucket reductions: {} ({} early: ZeRO-2 staging buffers all busy)",
                 reducer_->reductions(), reducer_->early_reductions());
  if (buffers_.param_shard) spdlog::info("parameter bucket gathers: {}", reducer_->gathers());
}

void ShardedState::for_each_piece(const std::vector<parallel::FloatRange>& ranges,
                                  const std::function<void(const Piece&)>& fn) const {
  const auto& params = model_.params();
  for (size_t i = 0; i < params.size(); ++i) {
    const auto& e = model_.layout().at(params[i].name);
    int64_t at = 0;  // where the current range starts in the compact array
    for (const auto& range : ranges) {
      const int64_t lo = std::max(range.begin, e.offset);
      const int64_t hi = std::min(range.end, e.offset + e.numel);
      if (lo < hi) fn(Piece{i, lo, hi, at + (lo - range.begin)});
      at += range.size();
    }
  }
}

float* ShardedState::params(const Piece& p) const {
  return buffers_.param_shard ? buffers_.param_shard + p.at : model_.state().params.data() + p.lo;
}
float* ShardedState::grads(const Piece& p) const {
  return buffers_.grad_shard ? buffers_.grad_shard + p.at : model_.state().grads.data() + p.lo;
}
float* ShardedState::exp_avg(const Piece& p) const {
  return zero_ > 0 ? m_shard_ + p.at : model_.state().adam_m.data() + p.lo;
}
float* ShardedState::exp_avg_sq(const Piece& p) const {
  return zero_ > 0 ? v_shard_ + p.at : model_.state().adam_v.data() + p.lo;
}

ShardedState::Store ShardedState::store(const std::vector<parallel::FloatRange>& ranges,
                                        float* shard, float* region) const {
  if (!shard) return {{region_}, region, region_.size(), false};
  int64_t floats = 0;
  for (const auto& r : ranges) floats += r.size();
  return {ranges, shard, floats, true};
}
ShardedState::Store ShardedState::param_store() const {
  return store(owned(), buffers_.param_shard, model_.state().params.data());
}
ShardedState::Store ShardedState::exp_avg_store() const {
  return store(owned(), m_shard_, model_.state().adam_m.data());
}
ShardedState::Store ShardedState::exp_avg_sq_store() const {
  return store(owned(), v_shard_, model_.state().adam_v.data());
}

std::vector<checkpoint::Slice> ShardedState::boxes(bool only_owned) const {
  const int writers = group_.size(), me = group_.rank();
  std::vector<checkpoint::Slice> out;
  const auto& table = model_.params();
  // One section from an array holding `store.ranges` of the region (back to back if sharded).
  const auto add_section = [&](int section, const float* base, const Store& store) {
    for_each_piece(store.ranges, [&](const Piece& piece) {
      const auto& p = table[piece.param];
      const auto& e = model_.layout().at(p.name);
      if (only_owned && ((!store.sharded && static_cast<int>(piece.param % writers) != me) ||
                         (p.split_dim < 0 && model_.tp_rank() != 0)))
        return;
      const float* at = base + (store.sharded ? piece.at : piece.lo);
      for (auto& [off, shape] :
           flat_boxes(e.spec.shape, piece.lo - e.offset, piece.hi - e.offset)) {
        int64_t first = off.back();  // flat index of the box's first element in the tensor
        if (off.size() == 2) first += off[0] * e.spec.shape[1];
        const TensorBox held = tp_shard_box(p, model_.tp_size(), model_.tp_rank());
        for (size_t d = 0; d < off.size(); ++d) off[d] += held.offset[d];
        out.push_back({kSections[section] + p.name, p.global_shape, off, shape,
                       const_cast<float*>(at + (first - (piece.lo - e.offset)))});
      }
    });
  };
  const Store params = param_store(), exp_avg = exp_avg_store(), exp_avg_sq = exp_avg_sq_store();
  T3D_USER_CHECK(exp_avg.data && exp_avg_sq.data, "snapshots need the optimizer state");
  add_section(0, params.data, params);
  add_section(1, exp_avg.data, exp_avg);
  add_section(2, exp_avg_sq.data, exp_avg_sq);
  return out;
}

void ShardedState::add_grad_pieces(std::vector<const float*>& ranges,
                                   std::vector<int64_t>& sizes) const {
  const auto& tensors = model_.params();
  const bool tp_rank0 = model_.tp_rank() == 0;
  for_each_piece(partition(), [&](const Piece& p) {
    if (tensors[p.param].split_dim < 0 && !tp_rank0)
      return;  // replicated: identical on every tp rank
    ranges.push_back(grads(p));
    sizes.push_back(p.size());
  });
}

std::vector<parallel::FloatRange> ShardedState::partition_of(int r) const {
  std::vector<parallel::FloatRange> out;
  const auto rank = static_cast<size_t>(r);
  for (size_t b = 0; b < partition_.buckets.size(); ++b) {
    const int64_t begin = partition_.buckets[b].begin + partition_.displs[b][rank];
    if (partition_.counts[b][rank] > 0) out.push_back({begin, begin + partition_.counts[b][rank]});
  }
  return out;
}

bool ShardedState::updates(const Piece& p) const { return !model_.params()[p.param].router_bias(); }

kernels::AdamWConfig ShardedState::adamw_config(const TrainConfig& t, double lr, float grad_scale,
                                                const Piece& p) const {
  return {static_cast<float>(lr),
          static_cast<float>(t.beta1),
          static_cast<float>(t.beta2),
          static_cast<float>(t.eps),
          model_.params()[p.param].decay ? static_cast<float>(t.weight_decay) : 0.0f,
          grad_scale};
}

void ShardedState::adamw_step(const TrainConfig& t, double lr, int64_t step, float grad_scale) {
  float* flip_at = nullptr;
  std::vector<kernels::AdamWTensor> tensors;  // every piece in one call: few launches on a GPU
  for_each_piece(owned(), [&](const Piece& p) {
    if (!updates(p)) return;  // RouterBalance's
    tensors.push_back({params(p), grads(p), exp_avg(p), exp_avg_sq(p), p.size(),
                       adamw_config(t, lr, grad_scale, p)});
    if (!flip_at) flip_at = params(p) + p.size() / 2;
  });
  kernels::adamw_step_many(model_.exec(), tensors.data(), static_cast<int64_t>(tensors.size()),
                           step);
  if (update_flip_bit_ >= 0 && flip_at) {
    kernels::flip_bit(model_.exec(), flip_at, 0, update_flip_bit_);
    update_flip_bit_ = -1;
  }
  reducer_->gather_params(model_.state().params.data());
}

TrainingState::TrainingState(Model& model, const parallel::TensorComm& dense_group,
                             const parallel::TensorComm& experts_group, int zero, double bucket_mb,
                             kernels::Arena& arena)
    : model_(model) {
  groups_.push_back(std::make_unique<ShardedState>(model, StateGroup::kDense, dense_group, zero,
                                                   bucket_mb, arena));
  if (!model.grad_units(StateGroup::kExperts).empty())
    groups_.push_back(std::make_unique<ShardedState>(model, StateGroup::kExperts, experts_group,
                                                     zero, bucket_mb, arena));
}

void TrainingState::init(uint64_t seed) {
  if (!dense().param_shard()) {
    model_.init(seed);
  } else {
    // ZeRO-3: each tensor exists on the host long enough to keep this rank's slices of it.
    model_.init(seed, [&](int64_t offset, const float* values, int64_t n) {
      for (const auto& g : groups_) g->keep_shard(offset, values, n);
    });
  }
  restored();
}

void TrainingState::restored() {
  for (const auto& g : groups_) g->restored();
}

void TrainingState::begin_step(int micro_batches, bool local) {
  for (const auto& g : groups_) g->reducer().begin_step(micro_batches, local);
}

void TrainingState::finish_step() {
  for (const auto& g : groups_) g->reducer().finish();
}

parallel::StateBytes TrainingState::footprint() const {
  parallel::StateBytes sum;
  for (const auto& g : groups_) {
    const parallel::StateBytes b = g->footprint();
    sum.params += b.params, sum.grads += b.grads, sum.optimizer += b.optimizer;
  }
  return sum;
}

void TrainingState::log_footprint(bool rank0) const {
  for (const auto& g : groups_) g->log_footprint(rank0);
}

void TrainingState::log_counters() const {
  for (const auto& g : groups_) g->log_counters();
}

std::vector<checkpoint::Slice> TrainingState::boxes(bool only_owned) const {
  std::vector<checkpoint::Slice> out;
  for (const auto& g : groups_) {
    auto mine = g->boxes(only_owned);
    out.insert(out.end(), std::make_move_iterator(mine.begin()),
               std::make_move_iterator(mine.end()));
  }
  return out;
}

double TrainingState::grad_sum_of_squares() const {
  std::vector<const float*> ranges;
  std::vector<int64_t> sizes;
  std::vector<size_t> group_end;  // each group's pieces end here
  for (const auto& g : groups_) {
    g->add_grad_pieces(ranges, sizes);
    group_end.push_back(ranges.size());
  }
  std::vector<double> sums(ranges.size());
  kernels::sum_of_squares_each(exec(), sums.data(), ranges.data(), sizes.data(),
                               static_cast<int64_t>(ranges.size()));
  // Each group's pieces in order, then the groups in order: the bits of a sum per group.
  double sum = 0;
  size_t i = 0;
  for (const size_t end : group_end) {
    double group = 0;
    for (; i < end; ++i) group += sums[i];
    sum += group;
  }
  return sum;
}

void TrainingState::adamw_step(const TrainConfig& t, double lr, int64_t step, float grad_scale) {
  for (const auto& g : groups_) g->adamw_step(t, lr, step, grad_scale);
}

}  // namespace t3d::runtime
