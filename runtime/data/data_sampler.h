// Deterministic, counter-based batch sampler.
//
// Nothing is carried from one step to the next: the rows of global step s are a pure function of
// (seed, s), so the whole state a snapshot needs is SamplerState{seed, step}, and resuming at any
// step (or with another layout) reproduces the same data.
//
// Rows: a step draws `global_batch` rows of seq_len + 1 tokens (inputs, and the same window
// shifted by one as targets). Global row r of step s starts at
//  - random:     splitmix64(seed, s, r) mod (N - T)            (every valid start, 0..N-T-1)
//  - sequential: ((s * B + r) mod W) * T, W = (N - 1) / T       (windows tile the stream and
//                                                                wrap after W of them)
// Layout independence: the B rows are cut into dp contiguous blocks, and each block into n_micro
// contiguous micro-batches. So dp rank d, micro-batch m, local row i is global row
//   d * (B / dp) + m * (B / (dp * n_micro)) + i,
// and the set of rows a step sees does not depend on dp or n_micro.
#pragma once

#include <array>
#include <cstdint>
#include <span>
#include <string>
#include <string_view>
#include <utility>

#include "runtime/data/data.h"
#include "runtime/data/data_choices.h"

namespace t3d::runtime {

std::string_view to_string(SampleMode mode);

// Rows in one micro-batch of one dp rank: global_batch / (dp_size · n_micro); UserError unless it
// divides evenly.
int64_t rows_per_micro(int64_t global_batch, int dp_size, int n_micro);

struct SamplerConfig {
  SampleMode mode = SampleMode::kRandom;
  uint64_t seed = 0;
  int64_t global_batch = 0;  // B: rows per optimizer step, over all dp ranks and micro-batches
  int64_t seq_len = 0;       // T
};

// Everything a snapshot must store to resume the data stream exactly.
struct SamplerState {
  uint64_t seed = 0;
  int64_t step = 0;  // the next step to sample
};

// One micro-batch, written into caller-owned buffers.
struct Batch {
  std::span<int32_t> tokens;   // (rows, seq_len)
  std::span<int32_t> targets;  // (rows, seq_len): tokens shifted by one
  int64_t rows = 0;
  int64_t seq_len = 0;
  int64_t first_global_row = 0;  // global row index of local row 0
};

// 64-bit counter hash (splitmix64 finaliser chained over the three words).
uint64_t sample_hash(uint64_t seed, uint64_t step, uint64_t row);

class Sampler {
 public:
  // `source` names `tokens` in messages (the sampler shares their storage). Throws UserError when
  // the stream is shorter than one window.
  Sampler(Tokens tokens, std::string source, SamplerConfig config);

  const SamplerConfig& config() const { return config_; }

  int64_t rows_per_micro(int dp_size, int n_micro) const {
    return runtime::rows_per_micro(config_.global_batch, dp_size, n_micro);
  }

  // First token of global row `row` of step `step`.
  int64_t row_offset(int64_t step, int64_t row) const;

  // Number of distinct windows in sequential mode, (N - 1) / T; a step covers B of them.
  int64_t num_windows() const { return num_windows_; }

  // Fills micro-batch `micro` of dp rank `dp_rank` for `step`. Both buffers must hold at least
  // rows_per_micro(dp_size, n_micro) * seq_len ints; no allocation.
  Batch sample(int64_t step, int dp_rank, int dp_size, int micro, int n_micro,
               std::span<int32_t> tokens_buf, std::span<int32_t> targets_buf) const;

 private:
  Tokens tokens_;
  std::string source_;
  SamplerConfig config_;
  int64_t num_windows_ = 0;
};

}  // namespace t3d::runtime
