// Token streams: reading and writing token files, plain text through the byte tokenizer, the
// train / validation split, and a unigram entropy helper.
//
// Token file layouts (chosen by the first int32):
//  - llm.c: 256 int32 header {magic 20240520, version, token count, 0...}, then the tokens:
//    version 1 uint16 (llm.c's own), version 2 uint32 (titan3d's, for vocabularies past 65,536;
//    write_token_file picks it only when a token needs it).
//  - nanoGPT: raw uint16 tokens, no header. A headerless file whose first two tokens happen to
//    spell the magic (54600, 308) would be misread as headed; the size check then rejects it.
// Token files are memory-mapped, not copied: every rank of a host reads the same pages of the page
// cache, so a corpus of billions of tokens costs its file size once per host, not four bytes a
// token per rank. Replace a token file by renaming a new one over it (titan3d tokenize does);
// rewriting it in place under a running job is not supported. Text is tokenized into memory.
#pragma once

#include <array>
#include <cstdint>
#include <filesystem>
#include <memory>
#include <span>
#include <string>
#include <string_view>
#include <utility>
#include <vector>

#include "runtime/data/data_choices.h"

namespace t3d::runtime {

class TextTokenizer;

inline constexpr int32_t kTokenFileMagic = 20240520;
inline constexpr int32_t kTokenFileVersion = 1;     // uint16 tokens
inline constexpr int32_t kTokenFileVersionU32 = 2;  // uint32 tokens
inline constexpr int64_t kTokenFileHeaderInts = 256;

// A read-only run of token ids that keeps its storage alive: a vector (text tokenized in memory)
// or the memory maps of token files, one part each, read end to end as one stream. Copies and
// slices share the storage. Ids read out as uint32 (a subword vocabulary may pass 65,536).
class Tokens {
 public:
  // `size` ids of `width` bytes (2 or 4) at `data`, kept alive by `storage`.
  struct Part {
    std::shared_ptr<const void> storage;
    const void* data = nullptr;
    int64_t size = 0;
    int width = 4;
  };

  Tokens() = default;
  explicit Tokens(std::vector<uint32_t> ids);
  explicit Tokens(std::vector<Part> parts);  // empty parts are dropped

  int64_t size() const { return starts_.empty() ? 0 : starts_.back(); }
  bool empty() const { return size() == 0; }
  const std::vector<Part>& parts() const { return parts_; }
  // Bytes per id as stored when every part has the same width, else 0.
  int width() const;
  uint32_t operator[](int64_t i) const;
  // ids [first, first + n) into out (widened), across parts: the sampler's read of a row.
  void copy(int64_t first, int64_t n, int32_t* out) const;
  // ids [first, first + n), sharing the storage.
  Tokens slice(int64_t first, int64_t n) const;
  std::vector<uint32_t> to_vector() const;
  // f(first, ids) for each part in order: `first` is the stream index of its first id, `ids` a
  // std::span<const uint16_t> or std::span<const uint32_t>, as stored.
  template <class F>
  void for_each_part(F&& f) const {
    for (size_t p = 0; p < parts_.size(); ++p) {
      const Part& part = parts_[p];
      const auto n = static_cast<size_t>(part.size);
      if (part.width == 2)
        f(starts_[p], std::span<const uint16_t>(static_cast<const uint16_t*>(part.data), n));
      else
        f(starts_[p], std::span<const uint32_t>(static_cast<const uint32_t*>(part.data), n));
    }
  }

 private:
  size_t part_of(int64_t i) const;  // the part holding id i
  std::vector<Part> parts_;
  std::vector<int64_t>
      starts_;  // parts_.size() + 1 entries: part p holds [starts_[p], starts_[p + 1])
};

// Tokens plus where they came from (a path or a label), for error messages.
struct TokenStream {
  std::string source;
  Tokens tokens;

  int64_t size() const { return tokens.size(); }
};

// Maps a token file in either layout (its ids as stored, 16 or 32 bits). vocab_size > 0: every
// token must be < vocab_size. Throws UserError naming the file when it is missing, empty,
// truncated or has a bad header.
TokenStream read_token_file(const std::filesystem::path& path, int vocab_size);

// The files data.path (or data.val_path) names: `path` itself when a file of that name exists
// (or it has no glob characters), else the matches of its glob pattern (* ? [...], glob(3)) in
// byte order of their names, as llm.c names its shards ("fineweb_train_*.bin"). UserError starting
// with `key` (the recipe key or option, with its origin) and naming the pattern when nothing
// matches.
std::vector<std::string> data_files(const std::string& path, const std::string& key);

// The token files of data_files(path) mapped end to end as one stream named `path` (a window
// may span two files); each file is checked as read_token_file checks it.
TokenStream read_token_files(const std::string& path, int vocab_size, const std::string& key);

// Writes the llm.c layout (with header): version 1 (uint16) when every token fits, else version 2
// (uint32). Throws UserError when the file cannot be written.
void write_token_file(const std::filesystem::path& path, std::span<const uint32_t> tokens);
void write_token_file(const std::filesystem::path& path, std::span<const uint16_t> tokens);

// Reads a text file and tokenizes it with the byte tokenizer (vocab 256).
TokenStream read_text_file(const std::filesystem::path& path);

// Picks by extension: `.txt` is text (byte tokenizer, needs vocab_size >= 256), anything else a
// token file.
TokenStream load_corpus(const std::filesystem::path& path, int vocab_size);

// Text goes through `tokenizer` (null: the byte tokenizer) as one document (encode_document: BOS
// first when it adds one); its ids must be < vocab_size (UserError naming both otherwise). Token
// files through read_token_files (`path` may be a pattern of shards).
// `key` names the path in errors (data.path, data.val_path, --data).
TokenStream load_stream(const std::filesystem::path& path, DataFormat format, int vocab_size,
                        const TextTokenizer* tokenizer = nullptr,
                        const std::string& key = "data.path");

struct TrainValSplit {
  TokenStream train;
  TokenStream val;
};

// Holds out the last val_fraction of the stream (at least min_tokens of it) as validation data.
// The tail, not a random subset, so no validation window overlaps a training window except at
// the one boundary token. val_fraction in (0, 1).
TrainValSplit split_train_val(const TokenStream& all, double val_fraction, int64_t min_tokens);

// Entropy of the empirical unigram distribution: a loss a model must beat to have learnt more
// than token frequencies. nats = bits * ln 2.
double unigram_entropy_bits(const Tokens& tokens);
double unigram_entropy_nats(const Tokens& tokens);

}  // namespace t3d::runtime
