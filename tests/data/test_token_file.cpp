// Token files, text, the byte tokenizer, the train/val split and the entropy helper.
// Suite names start with `data_` so `ctest -R data` selects them.
#include <gtest/gtest.h>
#include <unistd.h>

#include <cmath>
#include <cstring>
#include <filesystem>
#include <fstream>
#include <numeric>

#include "kernels/check.h"
#include "runtime/data/data.h"
#include "runtime/data/tokenizer.h"

namespace t3d::runtime {
namespace {

namespace fs = std::filesystem;

// A fresh directory per test, removed afterwards.
class data_TokenFile : public ::testing::Test {
 protected:
  void SetUp() override {
    const auto* info = ::testing::UnitTest::GetInstance()->current_test_info();
    dir_ = fs::temp_directory_path() /
           (std::string("t3d_data_") + info->name() + "_" + std::to_string(::getpid()));
    fs::create_directories(dir_);
  }
  void TearDown() override { fs::remove_all(dir_); }

  fs::path write_bytes(const std::string& name, const void* data, size_t n) {
    const fs::path p = dir_ / name;
    std::ofstream(p, std::ios::binary).write(static_cast<const char*>(data), n);
    return p;
  }

  // Expects a UserError whose message contains the file name and `fragment`.
  template <typename F>
  void expect_user_error(F&& f, const fs::path& file, const std::string& fragment) {
    try {
      f();
      FAIL() << "expected UserError for " << file;
    } catch (const UserError& e) {
      const std::string msg = e.what();
      EXPECT_NE(msg.find(file.string()), std::string::npos) << msg;
      EXPECT_NE(msg.find(fragment), std::string::npos) << msg;
    }
  }

  fs::path dir_;
};

std::vector<uint32_t> iota32(const std::vector<uint16_t>& v) { return {v.begin(), v.end()}; }

std::vector<uint16_t> iota_tokens(size_t n, uint16_t mod) {
  std::vector<uint16_t> v(n);
  for (size_t i = 0; i < n; ++i) v[i] = static_cast<uint16_t>((i * 7 + 3) % mod);
  return v;
}

TEST_F(data_TokenFile, RoundTripWithHeader) {
  const auto tokens = iota_tokens(1000, 50257);
  const fs::path p = dir_ / "a.bin";
  write_token_file(p, tokens);
  EXPECT_EQ(fs::file_size(p), 1024u + 2 * tokens.size());
  const TokenStream s = read_token_file(p, 50257);
  EXPECT_EQ(s.tokens.to_vector(), std::vector<uint32_t>(tokens.begin(), tokens.end()));
  EXPECT_EQ(s.tokens.width(), 2);  // mapped as stored, not widened
  EXPECT_EQ(s.source, p.string());
}

TEST_F(data_TokenFile, HeaderLayoutMatchesLlmC) {
  const std::vector<uint16_t> tokens = {1, 2, 3};
  const fs::path p = dir_ / "h.bin";
  write_token_file(p, tokens);
  std::ifstream in(p, std::ios::binary);
  int32_t header[256];
  in.read(reinterpret_cast<char*>(header), sizeof(header));
  EXPECT_EQ(header[0], 20240520);
  EXPECT_EQ(header[1], 1);
  EXPECT_EQ(header[2], 3);
  EXPECT_EQ(header[3], 0);
}

// Past 65,535 the writer switches to version 2 (uint32 tokens); below it stays llm.c's version 1.
TEST_F(data_TokenFile, WideTokensUseVersion2) {
  const std::vector<uint32_t> tokens = {0, 65535, 65536, 1u << 20, 7};
  const fs::path p = dir_ / "wide.bin";
  write_token_file(p, std::span<const uint32_t>(tokens));
  EXPECT_EQ(fs::file_size(p), 1024u + 4 * tokens.size());
  std::ifstream in(p, std::ios::binary);
  int32_t header[3];
  in.read(reinterpret_cast<char*>(header), sizeof(header));
  EXPECT_EQ(header[1], 2);
  EXPECT_EQ(header[2], 5);
  EXPECT_EQ(read_token_file(p, (1 << 20) + 1).tokens.to_vector(), tokens);
  EXPECT_EQ(read_token_file(p, 0).tokens.width(), 4);
  expect_user_error([&] { read_token_file(p, 70000); }, p, "token 1048576 at position 3");
  expect_user_error([&] { read_token_file(p, 70000); }, p, "at least 1048577");
  expect_user_error([&] { read_token_file(p, 65536); }, p, "token 65536 at position 2");
  // A version-2 file cut short is truncated by its own width, not uint16's.
  const fs::path cut = dir_ / "wide_cut.bin";
  fs::copy_file(p, cut);
  fs::resize_file(cut, 1024 + 4 * 5 - 2);
  expect_user_error([&] { read_token_file(cut, 0); }, cut, "truncated");
  const std::vector<uint32_t> narrow = {1, 65535};
  write_token_file(p, std::span<const uint32_t>(narrow));
  EXPECT_EQ(fs::file_size(p), 1024u + 2 * narrow.size());
  EXPECT_EQ(read_token_file(p, 0).tokens.to_vector(), narrow);
}

TEST_F(data_TokenFile, HeaderlessNanoGptFile) {
  const auto tokens = iota_tokens(777, 300);
  const fs::path p = write_bytes("raw.bin", tokens.data(), tokens.size() * 2);
  EXPECT_EQ(read_token_file(p, 300).tokens.to_vector(),
            std::vector<uint32_t>(tokens.begin(), tokens.end()));
}

// A token file is mapped, not copied: slices (the validation split) and samplers share the map,
// which outlives the stream it came from, and reads see the file's ids as stored.
TEST_F(data_TokenFile, MappedIdsAreSharedBySlicesAndOutliveTheStream) {
  const auto ids = iota_tokens(5000, 50000);
  const fs::path p = dir_ / "mapped.bin";
  write_token_file(p, ids);
  Tokens tail;
  {
    const TokenStream s = read_token_file(p, 50000);
    const TrainValSplit split = split_train_val(s, 0.1, 17);
    ASSERT_EQ(split.val.size(), 500);
    tail = split.val.tokens;
    // A slice shares the map: its first id sits where the stream's 4,500th does.
    EXPECT_EQ(tail[0], ids[4500]);
    EXPECT_EQ(split.train.tokens[4499], ids[4499]);
  }
  // The stream and split are gone; the slice still reads the file's ids.
  std::vector<int32_t> out(300);
  tail.copy(200, 300, out.data());
  for (int64_t j = 0; j < 300; ++j) EXPECT_EQ(out[j], ids[4700 + j]) << j;
  // Renaming another file over the name (as write_token_file does) leaves the map as it was.
  write_token_file(p, iota_tokens(5000, 3));
  EXPECT_EQ(tail[499], ids[4999]);
}

TEST_F(data_TokenFile, MissingFileNamesIt) {
  const fs::path p = dir_ / "nope.bin";
  expect_user_error([&] { read_token_file(p, 0); }, p, "does not exist");
}

TEST_F(data_TokenFile, TruncatedHeaderedFileNamesIt) {
  const fs::path good = dir_ / "good.bin";
  write_token_file(good, iota_tokens(100, 256));
  std::vector<char> bytes(fs::file_size(good));
  std::ifstream(good, std::ios::binary).read(bytes.data(), bytes.size());
  const fs::path cut = write_bytes("cut.bin", bytes.data(), bytes.size() - 10);
  expect_user_error([&] { read_token_file(cut, 256); }, cut, "truncated");
  const fs::path tiny = write_bytes("tiny.bin", bytes.data(), 100);  // inside the header
  expect_user_error([&] { read_token_file(tiny, 256); }, tiny, "truncated");
}

TEST_F(data_TokenFile, BadVersionNamesIt) {
  int32_t header[256] = {20240520, 7, 0};
  const fs::path p = write_bytes("v7.bin", header, sizeof(header));
  expect_user_error([&] { read_token_file(p, 0); }, p, "version 7");
}

TEST_F(data_TokenFile, OddSizedHeaderlessFileIsRejected) {
  const char bytes[5] = {1, 2, 3, 4, 5};
  const fs::path p = write_bytes("odd.bin", bytes, sizeof(bytes));
  expect_user_error([&] { read_token_file(p, 0); }, p, "odd size");
}

TEST_F(data_TokenFile, TrailingBytesAreRejected) {
  const fs::path good = dir_ / "good.bin";
  write_token_file(good, iota_tokens(10, 256));
  std::ofstream(good, std::ios::binary | std::ios::app).write("xx", 2);
  expect_user_error([&] { read_token_file(good, 256); }, good, "after the 10 tokens");
}

TEST_F(data_TokenFile, TokenAboveVocabNamesFileAndPosition) {
  std::vector<uint16_t> tokens(20, 5);
  tokens[13] = 999;
  const fs::path p = dir_ / "big.bin";
  write_token_file(p, tokens);
  expect_user_error([&] { read_token_file(p, 512); }, p, "token 999 at position 13");
  EXPECT_NO_THROW(read_token_file(p, 1000));
}

TEST_F(data_TokenFile, EmptyFileIsRejected) {
  const fs::path p = write_bytes("empty.bin", "", 0);
  expect_user_error([&] { read_token_file(p, 0); }, p, "empty");
}

TEST_F(data_TokenFile, LoadCorpusReadsTextWithByteTokenizer) {
  const std::string text = "Hello, world!\nAll bytes: \x01\xff.";
  const fs::path p = write_bytes("c.txt", text.data(), text.size());
  const TokenStream s = load_corpus(p, 256);
  ASSERT_EQ(s.size(), static_cast<int64_t>(text.size()));
  EXPECT_EQ(s.tokens[0], 'H');
  EXPECT_EQ(s.tokens[s.size() - 1], '.');
  const std::vector<uint32_t> all = s.tokens.to_vector();
  const std::vector<int32_t> ids(all.begin(), all.end());
  EXPECT_EQ(ByteTokenizer{}.decode(std::span<const int32_t>(ids)), text);
  expect_user_error([&] { load_corpus(p, 100); }, p, "vocab_size");
}

TEST(data_Tokenizer, RoundTripAllBytes) {
  std::string text;
  for (int b = 0; b < 256; ++b) text.push_back(static_cast<char>(b));
  text += "The quick brown fox.";
  const ByteTokenizer tok;
  const auto ids = tok.encode(text);
  ASSERT_EQ(ids.size(), text.size());
  EXPECT_EQ(ids[255], 255);
  EXPECT_EQ(tok.decode(std::span<const uint16_t>(ids)), text);
  std::vector<int32_t> ids32(ids.begin(), ids.end());
  EXPECT_EQ(tok.decode(std::span<const int32_t>(ids32)), text);
}

TEST(data_Tokenizer, DecodeRejectsForeignIds) {
  const std::vector<int32_t> ids = {72, 300};
  EXPECT_THROW(ByteTokenizer{}.decode(std::span<const int32_t>(ids)), UserError);
  const std::vector<int32_t> neg = {-1};
  EXPECT_THROW(ByteTokenizer{}.decode(std::span<const int32_t>(neg)), UserError);
}

TEST(data_Split, HoldsOutTheTail) {
  TokenStream all{"mem", Tokens(iota32(iota_tokens(1000, 256)))};
  const TrainValSplit s = split_train_val(all, 0.1, 10);
  ASSERT_EQ(s.train.size(), 900);
  ASSERT_EQ(s.val.size(), 100);
  const std::vector<uint32_t> ids = all.tokens.to_vector();
  EXPECT_EQ(s.train.tokens.to_vector(), std::vector<uint32_t>(ids.begin(), ids.begin() + 900));
  EXPECT_EQ(s.val.tokens.to_vector(), std::vector<uint32_t>(ids.begin() + 900, ids.end()));
  // min_tokens wins over a tiny fraction.
  EXPECT_EQ(split_train_val(all, 0.001, 65).val.size(), 65);
}

TEST(data_Split, RejectsBadFractionAndTinyCorpus) {
  TokenStream all{"small.txt", Tokens(iota32(iota_tokens(100, 256)))};
  EXPECT_THROW(split_train_val(all, 0.0, 1), UserError);
  EXPECT_THROW(split_train_val(all, 1.0, 1), UserError);
  try {
    split_train_val(all, 0.5, 60);
    FAIL();
  } catch (const UserError& e) {
    EXPECT_NE(std::string(e.what()).find("small.txt"), std::string::npos);
  }
}

TEST(data_Entropy, KnownDistributions) {
  EXPECT_DOUBLE_EQ(unigram_entropy_bits(Tokens(std::vector<uint32_t>(100, 7))), 0.0);
  // Uniform over 8 symbols: 3 bits = 3 ln 2 nats.
  std::vector<uint32_t> uniform(8 * 50);
  for (size_t i = 0; i < uniform.size(); ++i) uniform[i] = static_cast<uint32_t>(i % 8);
  EXPECT_NEAR(unigram_entropy_bits(Tokens(uniform)), 3.0, 1e-12);
  EXPECT_NEAR(unigram_entropy_nats(Tokens(uniform)), 3.0 * std::log(2.0), 1e-12);
  // p = (1/2, 1/4, 1/4): 1.5 bits.
  EXPECT_NEAR(unigram_entropy_bits(Tokens(std::vector<uint32_t>{0, 0, 1, 2})), 1.5, 1e-12);
  // Ids past 65,535 are symbols of their own (a 128k vocabulary), not folded onto 16 bits:
  // 65,536 + 7 and 7 are two symbols, so two equal halves make 1 bit.
  EXPECT_NEAR(unigram_entropy_bits(Tokens(std::vector<uint32_t>{7, 65543})), 1.0, 1e-12);
  EXPECT_EQ(unigram_entropy_bits(Tokens()), 0.0);
}

}  // namespace
}  // namespace t3d::runtime

namespace t3d::runtime {
namespace {

// The real corpus, when scripts/get_data.sh has been run; skipped otherwise.
TEST(data_Corpus, FortunesFilesAgreeWithText) {
  const std::filesystem::path dir = std::filesystem::path(T3D_SOURCE_DIR) / "data";
  if (!std::filesystem::exists(dir / "fortunes_val.bin")) GTEST_SKIP() << "run scripts/get_data.sh";
  const TokenStream text = load_corpus(dir / "fortunes.txt", 256);
  const TokenStream train = load_corpus(dir / "fortunes_train.bin", 256);
  const TokenStream val = load_corpus(dir / "fortunes_val.bin", 256);
  ASSERT_EQ(train.size() + val.size(), text.size());
  const std::vector<uint32_t> ids = text.tokens.to_vector();
  EXPECT_EQ(train.tokens.to_vector(),
            std::vector<uint32_t>(ids.begin(), ids.begin() + train.size()));
  EXPECT_EQ(val.tokens.to_vector(), std::vector<uint32_t>(ids.begin() + train.size(), ids.end()));
  EXPECT_GT(text.size(), 1'000'000);
  // English bytes: about 4.5 bits per character under a unigram model.
  const double h = unigram_entropy_bits(text.tokens);
  EXPECT_GT(h, 4.0);
  EXPECT_LT(h, 5.0);
}

}  // namespace
}  // namespace t3d::runtime
