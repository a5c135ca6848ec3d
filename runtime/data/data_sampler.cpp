#include "runtime/data/data_sampler.h"

#include "kernels/check.h"
#include "kernels/hash.h"

namespace t3d::runtime {

std::string_view to_string(SampleMode mode) {
  for (const auto& [m, name] : kSampleModeNames)
    if (m == mode) return name;
  return "?";
}

using kernels::splitmix64;

// Chaining (rather than xor-ing the three words together) keeps (s, r) and (r, s) apart.
uint64_t sample_hash(uint64_t seed, uint64_t step, uint64_t row) {
  return splitmix64(splitmix64(splitmix64(seed) ^ step) ^ row);
}

Sampler::Sampler(Tokens tokens, std::string source, SamplerConfig config)
    : tokens_(std::move(tokens)), source_(std::move(source)), config_(config) {
  T3D_USER_CHECK(config_.seq_len > 0, "model.seq_len is ", config_.seq_len, "; it must be > 0");
  T3D_USER_CHECK(config_.global_batch > 0, "train.global_batch is ", config_.global_batch,
                 "; it must be > 0");
  const int64_t n = tokens_.size();
  T3D_USER_CHECK(n >= config_.seq_len + 1, "'", source_, "' has ", n,
                 " tokens, fewer than one window of seq_len + 1 = ", config_.seq_len + 1,
                 "; use a longer corpus or a shorter model.seq_len");
  num_windows_ = (n - 1) / config_.seq_len;
}

int64_t rows_per_micro(int64_t global_batch, int dp_size, int n_micro) {
  T3D_ASSERT(dp_size > 0 && n_micro > 0);
  const int64_t parts = int64_t{dp_size} * n_micro;
  T3D_USER_CHECK(global_batch % parts == 0, "train.global_batch = ", global_batch,
                 " does not split into dp (", dp_size, ") x micro-batches (", n_micro,
                 ") = ", parts, " equal parts; make global_batch a multiple of ", parts);
  return global_batch / parts;
}

int64_t Sampler::row_offset(int64_t step, int64_t row) const {
  T3D_ASSERT(step >= 0 && row >= 0 && row < config_.global_batch, "step ", step, " row ", row);
  const int64_t t = config_.seq_len;
  if (config_.mode == SampleMode::kRandom) {
    const auto starts = static_cast<uint64_t>(tokens_.size() - t);  // N - T valid starts
    return static_cast<int64_t>(
        sample_hash(config_.seed, static_cast<uint64_t>(step), static_cast<uint64_t>(row)) %
        starts);
  }
  // (s * B + r) can exceed int64 only after ~1e18 rows; reduce step first to stay exact anyway.
  const int64_t w = num_windows_;
  const int64_t k = ((step % w) * (config_.global_batch % w) + row) % w;
  return k * t;
}

Batch Sampler::sample(int64_t step, int dp_rank, int dp_size, int micro, int n_micro,
                      std::span<int32_t> tokens_buf, std::span<int32_t> targets_buf) const {
  T3D_ASSERT(dp_rank >= 0 && dp_rank < dp_size && micro >= 0 && micro < n_micro, "dp_rank ",
             dp_rank, "/", dp_size, " micro ", micro, "/", n_micro);
  const int64_t rows = rows_per_micro(dp_size, n_micro);
  const int64_t t = config_.seq_len;
  T3D_ASSERT(static_cast<int64_t>(tokens_buf.size()) >= rows * t &&
                 static_cast<int64_t>(targets_buf.size()) >= rows * t,
             "batch buffers hold ", tokens_buf.size(), " / ", targets_buf.size(), ", need ",
             rows * t);
  const int64_t first = int64_t{dp_rank} * (rows * n_micro) + micro * rows;
  for (int64_t i = 0; i < rows; ++i) {
    const int64_t start = row_offset(step, first + i);
    tokens_.copy(start, t, tokens_buf.data() + i * t);       // (T)
    tokens_.copy(start + 1, t, targets_buf.data() + i * t);  // (T)
  }
  return {tokens_buf.first(static_cast<size_t>(rows * t)),
          targets_buf.first(static_cast<size_t>(rows * t)), rows, t, first};
}

}  // namespace t3d::runtime
