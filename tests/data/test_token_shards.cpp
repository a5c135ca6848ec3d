// Token files as one stream: the shards a pattern names (data_files, read_token_files), read end
// to end in name order through the parts of a Tokens, and what reads them (copy, slice, split,
// sampler, entropy) against the same ids concatenated in one vector.
#include <gtest/gtest.h>
#include <unistd.h>

#include <filesystem>
#include <fstream>
#include <string>
#include <vector>

#include "kernels/check.h"
#include "runtime/data/data.h"
#include "runtime/data/data_sampler.h"

namespace t3d::runtime {
namespace {

namespace fs = std::filesystem;

class data_TokenShards : public ::testing::Test {
 protected:
  void SetUp() override {
    const auto* info = ::testing::UnitTest::GetInstance()->current_test_info();
    dir_ = fs::temp_directory_path() /
           (std::string("t3d_shards_") + info->name() + "_" + std::to_string(::getpid()));
    fs::create_directories(dir_);
    // Three shards, written out of name order, in all three layouts: llm.c version 1 (uint16),
    // version 2 (uint32) and nanoGPT's raw uint16.
    write_token_file(dir_ / "train_002.bin", std::span<const uint32_t>(wide_));
    write_token_file(dir_ / "train_001.bin", std::span<const uint16_t>(narrow_));
    std::ofstream(dir_ / "train_003.bin", std::ios::binary)
        .write(reinterpret_cast<const char*>(raw_.data()), raw_.size() * 2);
    write_token_file(dir_ / "other.bin", std::span<const uint16_t>(narrow_));  // not matched
    for (const uint16_t t : narrow_) all_.push_back(t);
    all_.insert(all_.end(), wide_.begin(), wide_.end());
    for (const uint16_t t : raw_) all_.push_back(t);
  }
  void TearDown() override { fs::remove_all(dir_); }

  static std::vector<uint16_t> ids16(size_t n, uint16_t mod, uint16_t shift) {
    std::vector<uint16_t> v(n);
    for (size_t i = 0; i < n; ++i) v[i] = static_cast<uint16_t>((i * 7 + shift) % mod);
    return v;
  }

  fs::path dir_;
  std::vector<uint16_t> narrow_ = ids16(1000, 50000, 3);
  std::vector<uint32_t> wide_ = {70000, 5, 65536, 9, 100000, 11, 70001};  // forces version 2
  std::vector<uint16_t> raw_ = ids16(777, 300, 1);
  std::vector<uint32_t> all_;  // the three in name order
  std::string pattern() const { return (dir_ / "train_*.bin").string(); }
};

TEST_F(data_TokenShards, APatternReadsItsShardsInNameOrderAsOneStream) {
  const auto files = data_files(pattern(), "data.path");
  ASSERT_EQ(files.size(), 3u);
  EXPECT_EQ(fs::path(files[0]).filename(), "train_001.bin");
  EXPECT_EQ(fs::path(files[2]).filename(), "train_003.bin");
  const TokenStream s = read_token_files(pattern(), 100001, "data.path");
  EXPECT_EQ(s.source, pattern());
  ASSERT_EQ(s.tokens.parts().size(), 3u);
  EXPECT_EQ(s.tokens.width(), 0);  // mixed widths, each part as stored
  EXPECT_EQ(s.tokens.to_vector(), all_);
  for (int64_t i = 0; i < s.size(); i += 97) EXPECT_EQ(s.tokens[i], all_[i]) << i;
  // The same through load_stream, as the trainer reads data.path.
  EXPECT_EQ(
      load_stream(pattern(), DataFormat::kAuto, 100001, nullptr, "data.path").tokens.to_vector(),
      all_);
  // A file whose own name has glob characters is that file, not a pattern.
  const fs::path literal = dir_ / "odd[1].bin";
  write_token_file(literal, std::span<const uint16_t>(raw_));
  EXPECT_EQ(data_files(literal.string(), "data.path"), std::vector<std::string>{literal.string()});
}

TEST_F(data_TokenShards, CopiesAndSlicesCrossShardBoundaries) {
  const Tokens t = read_token_files(pattern(), 0, "data.path").tokens;
  const int64_t n = t.size();
  for (const int64_t first : {int64_t{0}, int64_t{995}, int64_t{1003}, int64_t{1006}, n - 9}) {
    std::vector<int32_t> out(9);
    t.copy(first, 9, out.data());
    const Tokens piece = t.slice(first, 9);
    ASSERT_EQ(piece.size(), 9);
    for (int64_t j = 0; j < 9; ++j) {
      EXPECT_EQ(static_cast<uint32_t>(out[j]), all_[first + j]) << first << "+" << j;
      EXPECT_EQ(piece[j], all_[first + j]) << first << "+" << j;
    }
  }
  // The validation tail of a split spans the last two shards.
  const TrainValSplit split = split_train_val(read_token_files(pattern(), 0, "data.path"), 0.45, 2);
  const std::vector<uint32_t> val = split.val.tokens.to_vector(),
                              train = split.train.tokens.to_vector();
  ASSERT_EQ(train.size() + val.size(), all_.size());
  EXPECT_TRUE(std::equal(train.begin(), train.end(), all_.begin()));
  EXPECT_TRUE(
      std::equal(val.begin(), val.end(), all_.begin() + static_cast<int64_t>(train.size())));
  EXPECT_GE(split.val.tokens.parts().size(), 2u);
}

// The sampler and the entropy see the shards exactly as the same ids in one vector.
TEST_F(data_TokenShards, SamplerAndEntropyMatchTheConcatenation) {
  const Tokens shards = read_token_files(pattern(), 0, "data.path").tokens;
  const Tokens whole{std::vector<uint32_t>(all_)};
  EXPECT_DOUBLE_EQ(unigram_entropy_bits(shards), unigram_entropy_bits(whole));
  for (const SampleMode mode : {SampleMode::kRandom, SampleMode::kSequential}) {
    const SamplerConfig config{mode, 99, 8, 24};
    const Sampler a(shards, "shards", config), b(whole, "whole", config);
    std::vector<int32_t> ta(8 * 24), ga(8 * 24), tb(8 * 24), gb(8 * 24);
    for (int64_t step = 0; step < 40; ++step) {
      a.sample(step, 0, 1, 0, 1, ta, ga);
      b.sample(step, 0, 1, 0, 1, tb, gb);
      ASSERT_EQ(ta, tb) << "step " << step;
      ASSERT_EQ(ga, gb) << "step " << step;
    }
  }
}

TEST_F(data_TokenShards, BadShardsAndEmptyPatternsAreNamed) {
  try {
    data_files((dir_ / "valid_*.bin").string(), "data.val_path");
    FAIL() << "a pattern matching nothing";
  } catch (const UserError& e) {
    const std::string msg = e.what();
    EXPECT_NE(msg.find("data.val_path"), std::string::npos) << msg;
    EXPECT_NE(msg.find("valid_*.bin"), std::string::npos) << msg;
  }
  // A token past the vocabulary names its shard and its position there.
  try {
    read_token_files(pattern(), 70000, "data.path");
    FAIL() << "token 70000 with vocab_size 70000";
  } catch (const UserError& e) {
    const std::string msg = e.what();
    EXPECT_NE(msg.find("train_002.bin"), std::string::npos) << msg;
    EXPECT_NE(msg.find("token 70000 at position 0"), std::string::npos) << msg;
  }
  // Text is one file: a pattern of text files is named as such, not as a missing file.
  std::ofstream(dir_ / "a.txt") << "some text";
  std::ofstream(dir_ / "b.txt") << "more text";
  try {
    load_stream((dir_ / "*.txt").string(), DataFormat::kAuto, 256, nullptr, "data.path");
    FAIL() << "a pattern of text files";
  } catch (const UserError& e) {
    EXPECT_NE(std::string(e.what()).find("is a pattern of text files"), std::string::npos)
        << e.what();
  }
  // A truncated shard among good ones.
  fs::resize_file(dir_ / "train_002.bin", 1024 + 4 * 3);
  try {
    read_token_files(pattern(), 0, "data.path");
    FAIL() << "a truncated shard";
  } catch (const UserError& e) {
    EXPECT_NE(std::string(e.what()).find("train_002.bin' is truncated"), std::string::npos)
        << e.what();
  }
}

}  // namespace
}  // namespace t3d::runtime
