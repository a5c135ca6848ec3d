// The model's collectives: tensor parallelism (all-reduce, or sequence parallelism's gathers and
// reduce-scatters) and context parallelism (the zig-zag split, key/value gathers and gradient
// reduce-scatters). The math they serve is in model.cpp.
#include <algorithm>

#include "kernels/ops.h"
#include "runtime/model/model.h"
#include "runtime/model/model_scratch.h"

namespace t3d::runtime {

namespace k = t3d::kernels;

void Model::tp_sum(float* data, int64_t n) const {
  if (tp_.size() == 1) return;
  if (!options_.bf16) return tp_.all_reduce(data, static_cast<size_t>(n));
  // bf16 on the wire: half the bytes; each partial sum is rounded to bf16 once per hop.
  k::float_to_bf16(options_.exec, scratch_->tp16, data, n);
  tp_.all_reduce_bf16(scratch_->tp16, static_cast<size_t>(n));
  k::bf16_to_float(options_.exec, data, scratch_->tp16, n);
}

// Sequence parallelism (Megatron): outside the tensor-parallel blocks each tp rank holds only its
// rows of the residual stream. Entering a column-parallel block all-gathers them; leaving a
// row-parallel block reduce-scatters its partial sums. The backward swaps the two.
const float* Model::gather_rows(const float* local, float* full) const {
  if (!sp_) return local;
  const int64_t n = rows_local_ * config_.dim;
  auto& s = *scratch_;
  if (!options_.bf16) {
    tp_.all_gather(local, full, static_cast<size_t>(n));
  } else {
    k::float_to_bf16(options_.exec, s.tp16, local, n);
    tp_.all_gather(s.tp16, s.tp16_rows, static_cast<size_t>(n));
    k::bf16_to_float(options_.exec, full, s.tp16_rows, n * tp_.size());
  }
  return full;
}

namespace {
// Zig-zag: cp rank r holds parts r and 2·cp−1−r of the 2·cp equal parts of a sequence.
int64_t zigzag_part(int cp, int cp_rank, int64_t part) {
  return part == 0 ? cp_rank : 2 * cp - 1 - cp_rank;
}
}  // namespace

void cp_local_positions(const int32_t* whole, int32_t* local, int64_t rows, int64_t seq_len, int cp,
                        int cp_rank) {
  if (cp == 1) {
    std::copy_n(whole, rows * seq_len, local);
    return;
  }
  const int64_t len = seq_len / (2 * cp);
  for (int64_t part = 0; part < 2; ++part)
    for (int64_t row = 0; row < rows; ++row)
      std::copy_n(whole + row * seq_len + zigzag_part(cp, cp_rank, part) * len, len,
                  local + (part * rows + row) * len);
}

int64_t Model::part_begin(int64_t part) const {
  return cp_ ? zigzag_part(options_.cp->size(), options_.cp->rank(), part) * part_len_ : 0;
}

k::AttentionShape Model::attention_shape(int64_t part) const {
  k::AttentionShape shape{options_.micro_rows, part_len_, heads_, kv_heads_, config_.head_dim()};
  if (cp_) shape.q_pos = part_begin(part), shape.kv_len = config_.seq_len;
  return shape;
}

// The staging buffer is in collective order (rank, part, row, position); `full` is (row, position).
void Model::gather_sequence(const float* local, float* full, int64_t width) const {
  const int64_t B = options_.micro_rows, len = part_len_;
  const int cps = options_.cp->size();
  auto& s = *scratch_;
  options_.cp->all_gather(local, s.cp_stage, static_cast<size_t>(B * seq_local_ * width));
  for (int r = 0; r < cps; ++r)
    for (int64_t part = 0; part < 2; ++part)
      for (int64_t b = 0; b < B; ++b)
        k::copy(options_.exec,
                full + (b * config_.seq_len + zigzag_part(cps, r, part) * len) * width,
                s.cp_stage + (((r * 2 + part) * B + b) * len) * width, len * width);
}

void Model::scatter_sequence_grad(const float* full, float* local, int64_t width) const {
  const int64_t B = options_.micro_rows, len = part_len_;
  const int cps = options_.cp->size();
  auto& s = *scratch_;
  for (int r = 0; r < cps; ++r)
    for (int64_t part = 0; part < 2; ++part)
      for (int64_t b = 0; b < B; ++b)
        k::copy(options_.exec, s.cp_stage + (((r * 2 + part) * B + b) * len) * width,
                full + (b * config_.seq_len + zigzag_part(cps, r, part) * len) * width,
                len * width);
  options_.cp->reduce_scatter(s.cp_stage, local, static_cast<size_t>(B * seq_local_ * width));
}

float* Model::reduce_rows(float* partial) const {
  if (!sp_) {
    tp_sum(partial, rows_ * config_.dim);
    return partial;
  }
  const int64_t n = rows_local_ * config_.dim;
  auto& s = *scratch_;
  if (!options_.bf16) {
    tp_.reduce_scatter(partial, s.rows, static_cast<size_t>(n));
  } else {
    k::float_to_bf16(options_.exec, s.tp16, partial, n * tp_.size());
    tp_.reduce_scatter_bf16(s.tp16, s.tp16_rows, static_cast<size_t>(n));
    k::bf16_to_float(options_.exec, s.rows, s.tp16_rows, n);
  }
  return s.rows;
}

void Model::sum_replicated_grads(const parallel::FloatRange& range, float* data) const {
  if (tp_.size() == 1 || (!sp_ && !config_.qk_norm)) return;
  for (const auto& p : params_) {
    if (p.split_dim >= 0) continue;
    const bool per_head = p.row == BlockWeight::kQNorm || p.row == BlockWeight::kKNorm;
    if (!sp_ && !per_head) continue;  // computed from every row: the same on each tp rank
    const auto& e = layout_.at(p.name);
    if (e.offset >= range.begin && e.offset + e.numel <= range.end)
      tp_.all_reduce(data + (e.offset - range.begin), static_cast<size_t>(e.numel));
  }
}

}  // namespace t3d::runtime
