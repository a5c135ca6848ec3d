// The counter-based sampler: exact offsets, determinism, range, and layout independence.
#include <gtest/gtest.h>

#include <algorithm>
#include <set>
#include <vector>

#include "kernels/check.h"
#include "runtime/data/data_sampler.h"

namespace t3d::runtime {
namespace {

// Token i has value i % 65536, so a row's first token reveals its offset (for N < 65536).
Tokens ramp(size_t n) {
  std::vector<uint32_t> v(n);
  for (size_t i = 0; i < n; ++i) v[i] = static_cast<uint32_t>(i);
  return Tokens(std::move(v));
}

SamplerConfig config(SampleMode mode, int64_t b, int64_t t, uint64_t seed = 1234) {
  return {mode, seed, b, t};
}

// All rows of `step` drawn through (dp, n_micro), concatenated in global row order.
std::vector<int32_t> gather_step(const Sampler& s, int64_t step, int dp, int n_micro,
                                 std::vector<int32_t>* targets = nullptr) {
  const int64_t rows = s.rows_per_micro(dp, n_micro);
  const int64_t t = s.config().seq_len;
  std::vector<int32_t> all, all_tgt, tok(rows * t), tgt(rows * t);
  for (int d = 0; d < dp; ++d) {
    for (int m = 0; m < n_micro; ++m) {
      const Batch b = s.sample(step, d, dp, m, n_micro, tok, tgt);
      EXPECT_EQ(b.rows, rows);
      EXPECT_EQ(b.first_global_row, static_cast<int64_t>(all.size()) / t);
      all.insert(all.end(), b.tokens.begin(), b.tokens.end());
      all_tgt.insert(all_tgt.end(), b.targets.begin(), b.targets.end());
    }
  }
  if (targets) *targets = all_tgt;
  return all;
}

TEST(data_Sampler, SequentialOffsetsAreExact) {
  const auto tokens = ramp(10000);
  const int64_t b = 4, t = 16;
  const Sampler s(tokens, "ramp", config(SampleMode::kSequential, b, t));
  EXPECT_EQ(s.num_windows(), (10000 - 1) / t);
  for (int64_t step = 0; step < 20; ++step) {
    for (int64_t r = 0; r < b; ++r) EXPECT_EQ(s.row_offset(step, r), (step * b + r) * t);
  }
  // And through sample(): targets are inputs shifted by one.
  std::vector<int32_t> tok(2 * t), tgt(2 * t);
  const Batch batch = s.sample(/*step=*/3, /*dp_rank=*/1, /*dp_size=*/2, 0, 1, tok, tgt);
  ASSERT_EQ(batch.rows, 2);
  for (int64_t r = 0; r < 2; ++r) {
    const int64_t start = (3 * b + 2 + r) * t;
    for (int64_t j = 0; j < t; ++j) {
      EXPECT_EQ(batch.tokens[r * t + j], start + j);
      EXPECT_EQ(batch.targets[r * t + j], start + j + 1);
    }
  }
}

TEST(data_Sampler, SequentialWrapsAfterLastWholeWindow) {
  const auto tokens = ramp(101);  // windows of T + 1 = 11 at stride 10: exactly 10 of them
  const Sampler s(tokens, "ramp", config(SampleMode::kSequential, 3, 10));
  ASSERT_EQ(s.num_windows(), 10);
  EXPECT_EQ(s.row_offset(3, 0), 90);  // window 9, the last: tokens 90..100
  EXPECT_EQ(s.row_offset(3, 1), 0);   // window 10 wraps to 0
  EXPECT_EQ(s.row_offset(3, 2), 10);
  for (int64_t step = 0; step < 1000; ++step) {
    for (int64_t r = 0; r < 3; ++r) EXPECT_EQ(s.row_offset(step, r), ((step * 3 + r) % 10) * 10);
  }
}

TEST(data_Sampler, RandomIsDeterministicAndInRange) {
  const auto tokens = ramp(5000);
  const int64_t b = 8, t = 32;
  const Sampler s1(tokens, "ramp", config(SampleMode::kRandom, b, t, 42));
  const Sampler s2(tokens, "ramp", config(SampleMode::kRandom, b, t, 42));
  const Sampler other(tokens, "ramp", config(SampleMode::kRandom, b, t, 43));
  int64_t lo = INT64_MAX, hi = 0, same_as_other = 0;
  std::set<int64_t> distinct;
  for (int64_t step = 0; step < 500; ++step) {
    for (int64_t r = 0; r < b; ++r) {
      const int64_t off = s1.row_offset(step, r);
      EXPECT_EQ(off, s2.row_offset(step, r));
      same_as_other += off == other.row_offset(step, r);
      lo = std::min(lo, off);
      hi = std::max(hi, off);
      distinct.insert(off);
    }
  }
  EXPECT_GE(lo, 0);
  EXPECT_LE(hi, 5000 - t - 1);  // the last window's target is token N - 1
  // 4000 draws over 4968 starts: spread out, reaching both ends, and the seed matters.
  EXPECT_LT(lo, 50);
  EXPECT_GT(hi, 5000 - t - 50);
  EXPECT_GT(distinct.size(), 2000u);
  EXPECT_LT(same_as_other, 10);
}

TEST(data_Sampler, RandomCoversTheLastValidStart) {
  const auto tokens = ramp(40);  // T = 8: starts 0..31, 32 of them
  const Sampler s(tokens, "ramp", config(SampleMode::kRandom, 4, 8, 7));
  std::set<int64_t> seen;
  for (int64_t step = 0; step < 500; ++step)
    for (int64_t r = 0; r < 4; ++r) seen.insert(s.row_offset(step, r));
  EXPECT_EQ(seen.size(), 32u);
  EXPECT_EQ(*seen.rbegin(), 31);
}

TEST(data_Sampler, StateIsSeedAndStep) {
  // Resuming = constructing a fresh sampler with the same config and asking for the saved step.
  const auto tokens = ramp(3000);
  const SamplerState saved{99, 17};
  const Sampler before(tokens, "ramp", config(SampleMode::kRandom, 4, 8, saved.seed));
  const Sampler after(tokens, "ramp", config(SampleMode::kRandom, 4, 8, saved.seed));
  EXPECT_EQ(gather_step(before, saved.step, 1, 1), gather_step(after, saved.step, 2, 2));
}

TEST(data_Sampler, LayoutIndependence) {
  const auto tokens = ramp(20000);
  for (SampleMode mode : {SampleMode::kRandom, SampleMode::kSequential}) {
    const Sampler s(tokens, "ramp", config(mode, 24, 12, 5));
    for (int64_t step : {0, 1, 7, 123}) {
      std::vector<int32_t> ref_tgt;
      const auto ref = gather_step(s, step, 1, 1, &ref_tgt);
      ASSERT_EQ(ref.size(), 24u * 12);
      for (auto [dp, micro] : {std::pair{2, 2}, {3, 1}, {1, 4}, {4, 3}, {2, 6}, {24, 1}}) {
        std::vector<int32_t> tgt;
        EXPECT_EQ(gather_step(s, step, dp, micro, &tgt), ref)
            << to_string(mode) << " step " << step << " dp " << dp << " micro " << micro;
        EXPECT_EQ(tgt, ref_tgt);
      }
    }
  }
}

TEST(data_Sampler, IndivisibleBatchIsAUserError) {
  const auto tokens = ramp(1000);
  const Sampler s(tokens, "ramp", config(SampleMode::kRandom, 6, 4));
  EXPECT_EQ(s.rows_per_micro(3, 2), 1);
  try {
    s.rows_per_micro(2, 2);
    FAIL();
  } catch (const UserError& e) {
    EXPECT_NE(std::string(e.what()).find("global_batch"), std::string::npos) << e.what();
  }
}

TEST(data_Sampler, StreamShorterThanAWindowNamesTheSource) {
  const auto tokens = ramp(16);
  try {
    Sampler s(tokens, "tiny.bin", config(SampleMode::kRandom, 1, 16));
    FAIL();
  } catch (const UserError& e) {
    EXPECT_NE(std::string(e.what()).find("tiny.bin"), std::string::npos) << e.what();
  }
  EXPECT_NO_THROW(Sampler(ramp(17), "ok", config(SampleMode::kRandom, 1, 16)));
}

}  // namespace
}  // namespace t3d::runtime
