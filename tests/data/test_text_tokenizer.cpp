// The SentencePiece tokenizer (runtime/data/text_tokenizer.h): trained here on a small synthetic
// corpus (seconds), it must give back every text exactly, encode '\n' as its byte piece between
// lines, and refuse missing or foreign model files and a vocabulary larger than the model's.
// The real corpus's round trip, and Python SentencePiece's agreement, are tests/use/tokenizer.sh.
#include <gtest/gtest.h>
#include <sentencepiece_processor.h>
#include <sentencepiece_trainer.h>
#include <unistd.h>

#include <algorithm>
#include <filesystem>
#include <fstream>
#include <random>

#include "kernels/check.h"
#include "runtime/data/data.h"
#include "runtime/data/text_tokenizer.h"

namespace t3d::runtime {
namespace {

namespace fs = std::filesystem;

// One tokenizer of each type for the whole suite: training is the slow part.
class data_TextTokenizer : public ::testing::Test {
 protected:
  static void SetUpTestSuite() {
    dir_ = new fs::path(fs::temp_directory_path() /
                        ("t3d_text_tokenizer_" + std::to_string(::getpid())));
    fs::create_directories(*dir_);
    // Sentences of common words in random order: enough distinct pairs for a few hundred merges.
    const char* words[] = {"the",   "quick", "brown", "fox",    "jumps", "over",  "lazy",
                           "dog",   "and",   "then",  "runs",   "away",  "from",  "a",
                           "large", "cat",   "who",   "sleeps", "in",    "sun",   "all",
                           "day",   "long",  "while", "birds",  "sing",  "songs", "of",
                           "joy",   "under", "blue",  "sky",    "near",  "river", "bank"};
    std::mt19937 rng(7);
    std::ofstream out(*dir_ / "corpus.txt");
    for (int line = 0; line < 3000; ++line) {
      const int n = 3 + static_cast<int>(rng() % 10);
      for (int w = 0; w < n; ++w) out << (w ? " " : "") << words[rng() % std::size(words)];
      out << (line % 7 == 0 ? "!" : ".") << "\n";
    }
    out.close();
    train_tokenizer({(*dir_ / "corpus.txt").string(), (*dir_ / "bpe.model").string(), 400, "bpe"});
    train_tokenizer(
        {(*dir_ / "corpus.txt").string(), (*dir_ / "uni.model").string(), 340, "unigram"});
  }
  static void TearDownTestSuite() {
    fs::remove_all(*dir_);
    delete dir_;
  }
  static fs::path* dir_;
};
fs::path* data_TextTokenizer::dir_ = nullptr;

// Texts a tokenizer must give back byte for byte: leading, repeated and trailing spaces, tabs,
// empty lines, control bytes, multi-byte UTF-8 unseen in training, no final '\n'.
const std::vector<std::string>& hard_texts() {
  static const std::vector<std::string> texts = {
      "the quick brown fox",
      "  two leading spaces\n\n\tand a tab, then   three spaces   \n",
      "control \x01\x02\x7f bytes; \xc3\xbc\xc3\xb1\xc3\xaf\xc3\xa7\xc3\xb8"
      "d\xc3\xa9 and "
      "\xe6\x97\xa5\xe6\x9c\xac\n",
      "three empty lines\n\n\n",
      "\n",
      "",
      "dog.\nlazy cat sleeps!\r\n~ 12345 {}[]|\\ \"quoted\"",
  };
  return texts;
}

TEST_F(data_TextTokenizer, BpeAndUnigramRoundTripExactly) {
  // The small corpus has too few distinct pieces for a 400-id unigram model.
  for (const auto& [name, vocab] : {std::pair{"bpe.model", 400u}, std::pair{"uni.model", 340u}}) {
    const TextTokenizer tok = TextTokenizer::open((*dir_ / name).string());
    EXPECT_FALSE(tok.is_bytes());
    EXPECT_EQ(tok.vocab_size(), static_cast<int>(vocab)) << name;
    for (const auto& text : hard_texts()) {
      const auto ids = tok.encode(text);
      for (const uint32_t id : ids) ASSERT_LT(id, vocab);
      EXPECT_EQ(tok.decode(std::span<const uint32_t>(ids)), text) << name << ": " << text;
    }
  }
}

// The documented exception: SentencePiece reads text as UTF-8 and replaces each invalid byte with
// U+FFFD, as Python SentencePiece does; the byte tokenizer keeps such bytes.
TEST_F(data_TextTokenizer, InvalidUtf8BecomesReplacementCharacters) {
  const TextTokenizer tok = TextTokenizer::open((*dir_ / "bpe.model").string());
  const auto ids = tok.encode("a\xff b");
  EXPECT_EQ(tok.decode(std::span<const uint32_t>(ids)), "a\xef\xbf\xbd b");
}

TEST_F(data_TextTokenizer, CompressesTextItWasTrainedOn) {
  const TextTokenizer tok = TextTokenizer::open((*dir_ / "bpe.model").string());
  const std::string text = "the lazy dog runs away from a large cat.\n";
  // Merges learnt: well under one id per byte (bytes would be 41 ids).
  EXPECT_LT(tok.encode(text).size(), text.size() / 2);
}

TEST_F(data_TextTokenizer, NewlineIsItsBytePieceBetweenLines) {
  const TextTokenizer tok = TextTokenizer::open((*dir_ / "bpe.model").string());
  const auto nl = tok.encode("\n");
  ASSERT_EQ(nl.size(), 1u);
  // <unk> <s> </s> come first, then the 256 byte pieces <0x00>..<0xFF>.
  EXPECT_EQ(nl[0], 3u + 0x0A);
  auto joined = tok.encode("fox jumps");
  joined.push_back(nl[0]);
  const auto second = tok.encode("over dog");
  joined.insert(joined.end(), second.begin(), second.end());
  EXPECT_EQ(tok.encode("fox jumps\nover dog"), joined);
}

// A model with a dummy prefix (LLaMA's tokenizer.model: add_dummy_prefix, byte fallback, identity
// normalisation) reads a text whole, as transformers' LlamaTokenizer does with
// `sp_model.encode(text)`: "▁" before the text only, not after each '\n' as line by line.
TEST_F(data_TextTokenizer, ADummyPrefixModelReadsTheWholeTextAsTransformersDoes) {
  const std::string prefix = (*dir_ / "llama_like").string();
  ASSERT_TRUE(sentencepiece::SentencePieceTrainer::Train(
                  "--input=" + (*dir_ / "corpus.txt").string() + " --model_prefix=" + prefix +
                  " --vocab_size=400 --model_type=bpe --byte_fallback=true "
                  "--normalization_rule_name=identity --add_dummy_prefix=true "
                  "--remove_extra_whitespaces=false --minloglevel=1")
                  .ok());
  sentencepiece::SentencePieceProcessor sp;
  ASSERT_TRUE(sp.Load(prefix + ".model").ok());
  const TextTokenizer tok = TextTokenizer::open(prefix + ".model");
  for (const std::string& text : hard_texts()) {
    std::vector<int> whole;
    ASSERT_TRUE(sp.Encode(text, &whole).ok());
    EXPECT_EQ(tok.encode(text), std::vector<uint32_t>(whole.begin(), whole.end())) << text;
    EXPECT_EQ(tok.decode(tok.encode(text)), text);
  }
  // Line by line the second line would start with "▁over", not "over".
  const auto ids = tok.encode("fox jumps\nover dog");
  const auto nl = std::find(ids.begin(), ids.end(), static_cast<uint32_t>(sp.PieceToId("<0x0A>")));
  ASSERT_NE(nl, ids.end());
  EXPECT_EQ(sp.IdToPiece(static_cast<int>(*(nl + 1))).rfind("\xE2\x96\x81", 0), std::string::npos);
}

TEST_F(data_TextTokenizer, BytesSpecIsTheByteTokenizer) {
  const TextTokenizer tok = TextTokenizer::open("bytes");
  EXPECT_TRUE(tok.is_bytes());
  EXPECT_EQ(tok.vocab_size(), 256);
  EXPECT_EQ(tok.encode("A\n"), (std::vector<uint32_t>{65, 10}));
  for (const auto& text : hard_texts())
    EXPECT_EQ(tok.decode(std::span<const uint32_t>(tok.encode(text))), text);
}

TEST_F(data_TextTokenizer, LoadStreamEncodesTextAndChecksTheVocabulary) {
  const TextTokenizer tok = TextTokenizer::open((*dir_ / "bpe.model").string());
  const fs::path corpus = *dir_ / "corpus.txt";
  const TokenStream s = load_stream(corpus, DataFormat::kAuto, 400, &tok);
  std::ifstream in(corpus, std::ios::binary);
  const std::string text((std::istreambuf_iterator<char>(in)), std::istreambuf_iterator<char>());
  EXPECT_EQ(s.tokens.to_vector(), tok.encode(text));
  EXPECT_LT(s.size(), static_cast<int64_t>(text.size()) / 2);
  try {
    load_stream(corpus, DataFormat::kAuto, 300, &tok);
    FAIL() << "a vocabulary of 300 cannot hold 400 ids";
  } catch (const UserError& e) {
    const std::string msg = e.what();
    EXPECT_NE(msg.find("model.vocab_size is 300"), std::string::npos) << msg;
    EXPECT_NE(msg.find("data.tokenizer"), std::string::npos) << msg;
    EXPECT_NE(msg.find("400 ids"), std::string::npos) << msg;
  }
}

// data.bos: a text (file or prompt) starts with <s> once, lines are encoded as without it, and
// decoding drops it again. The byte tokenizer and a model without <s> refuse it, naming data.bos.
TEST_F(data_TextTokenizer, BosStartsEachDocumentWhenAsked) {
  const std::string model = (*dir_ / "bpe.model").string();
  const TextTokenizer plain = TextTokenizer::open(model);
  const TextTokenizer bos = TextTokenizer::open(model, "data.tokenizer", true);
  EXPECT_FALSE(plain.adds_bos());
  EXPECT_TRUE(bos.adds_bos());
  ASSERT_EQ(bos.bos_id(), 1);  // <unk> <s> </s> come first
  const std::string text = "fox jumps\nover dog";
  std::vector<uint32_t> expected{1};
  const auto ids = plain.encode(text);
  expected.insert(expected.end(), ids.begin(), ids.end());
  EXPECT_EQ(bos.encode_document(text), expected);
  EXPECT_EQ(bos.encode(text), ids);
  EXPECT_EQ(plain.encode_document(text), ids);
  EXPECT_EQ(bos.decode(std::span<const uint32_t>(expected)), text);
  EXPECT_NE(bos.describe().find("BOS 1 first"), std::string::npos) << bos.describe();

  const fs::path corpus = *dir_ / "corpus.txt";
  const TokenStream with = load_stream(corpus, DataFormat::kAuto, 400, &bos);
  const TokenStream without = load_stream(corpus, DataFormat::kAuto, 400, &plain);
  ASSERT_EQ(with.size(), without.size() + 1);
  EXPECT_EQ(with.tokens[0], 1u);
  const std::vector<uint32_t> a = without.tokens.to_vector(), b = with.tokens.to_vector();
  EXPECT_TRUE(std::equal(a.begin(), a.end(), b.begin() + 1));

  const auto refused = [](const std::string& spec, const char* what) {
    try {
      TextTokenizer::open(spec, "data.tokenizer", true);
      ADD_FAILURE() << what << " has no BOS id, yet data.bos was accepted";
    } catch (const UserError& e) {
      EXPECT_NE(std::string(e.what()).find("data.bos"), std::string::npos) << e.what();
    }
  };
  refused("bytes", "the byte tokenizer");
  const std::string no_bos = (*dir_ / "no_bos.model").string();
  ASSERT_TRUE(sentencepiece::SentencePieceTrainer::Train(
                  "--input=" + corpus.string() + " --model_prefix=" + (*dir_ / "no_bos").string() +
                  " --vocab_size=300 --model_type=bpe --byte_fallback=true --bos_id=-1 "
                  "--minloglevel=1")
                  .ok());
  EXPECT_EQ(TextTokenizer::open(no_bos).bos_id(), -1);
  refused(no_bos, "a model without <s>");
}

TEST_F(data_TextTokenizer, RefusesMissingAndForeignModelFiles) {
  const auto expect_error = [](const std::string& spec, const std::string& fragment) {
    try {
      TextTokenizer::open(spec);
      FAIL() << spec;
    } catch (const UserError& e) {
      const std::string msg = e.what();
      EXPECT_NE(msg.find("data.tokenizer"), std::string::npos) << msg;
      EXPECT_NE(msg.find(spec), std::string::npos) << msg;
      EXPECT_NE(msg.find(fragment), std::string::npos) << msg;
    }
  };
  expect_error((*dir_ / "missing.model").string(), "does not exist");
  expect_error((*dir_ / "corpus.txt").string(), "not a SentencePiece model");
}

TEST_F(data_TextTokenizer, TrainingRefusesBadOptions) {
  const std::string corpus = (*dir_ / "corpus.txt").string();
  const std::string out = (*dir_ / "x.model").string();
  EXPECT_THROW(train_tokenizer({corpus, out, 100, "bpe"}), UserError);   // below 256 + 3
  EXPECT_THROW(train_tokenizer({corpus, out, 320, "word"}), UserError);  // not bpe / unigram
  EXPECT_THROW(train_tokenizer({corpus + ".nope", out, 320, "bpe"}), UserError);
  EXPECT_FALSE(fs::exists(out));
}

}  // namespace
}  // namespace t3d::runtime
