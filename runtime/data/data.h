// Token streams: reading and writing token files, plain text through the byte tokenizer, the
// train / validation split, and a unigram entropy helper.
//
// Token file layouts (chosen by the first int32):
//  - llm.c: 256 int32 header {magic 20240520, version, token count, 0...}, then the tokens:
//    version 1 uint16 (llm.c's own), version 2 uint32 (titan3d's, for vocabularies past 65,536;
//    write_token_file picks it only when a token needs it).
//  - nanoGPT: raw uint16 tokens, no header. A headerless file whose first two tokens happen to
//    spell the magic (54600, 308) would be misread as headed; the size check then rejects it.
// Files are read once into memory: corpora here are megabytes, and a private copy keeps every
// rank independent of later changes to the file.
#pragma once

#include <array>
#include <cstdint>
#include <filesystem>
#include <span>
#include <string>
#include <string_view>
#include <utility>
#include <vector>

namespace t3d::runtime {

class TextTokenizer;

inline constexpr int32_t kTokenFileMagic = 20240520;
inline constexpr int32_t kTokenFileVersion = 1;     // uint16 tokens
inline constexpr int32_t kTokenFileVersionU32 = 2;  // uint32 tokens
inline constexpr int64_t kTokenFileHeaderInts = 256;

// Tokens in memory plus where they came from (a path or a label), for error messages. uint32:
// a subword vocabulary may pass 65,536 (the byte tokenizer's ids are the same numbers).
struct TokenStream {
  std::string source;
  std::vector<uint32_t> tokens;

  int64_t size() const { return static_cast<int64_t>(tokens.size()); }
};

// Reads a token file in either layout. vocab_size > 0: every token must be < vocab_size.
// Throws UserError naming the file when it is missing, empty, truncated or has a bad header.
TokenStream read_token_file(const std::filesystem::path& path, int vocab_size);

// Writes the llm.c layout (with header): version 1 (uint16) when every token fits, else version 2
// (uint32). Throws UserError when the file cannot be written.
void write_token_file(const std::filesystem::path& path, std::span<const uint32_t> tokens);
void write_token_file(const std::filesystem::path& path, std::span<const uint16_t> tokens);

// Reads a text file and tokenizes it with the byte tokenizer (vocab 256).
TokenStream read_text_file(const std::filesystem::path& path);

// Picks by extension: `.txt` is text (byte tokenizer, needs vocab_size >= 256), anything else a
// token file.
TokenStream load_corpus(const std::filesystem::path& path, int vocab_size);

// data.format: text (a text file), bin (a token file), auto (load_corpus's choice by extension).
enum class DataFormat { kAuto, kText, kBin };
inline constexpr std::array<std::pair<DataFormat, std::string_view>, 3> kDataFormatNames = {{
    {DataFormat::kAuto, "auto"},
    {DataFormat::kText, "text"},
    {DataFormat::kBin, "bin"},
}};
// Text goes through `tokenizer` (null: the byte tokenizer) as one document (encode_document: BOS
// first when it adds one); its ids must be < vocab_size (UserError naming both otherwise).
TokenStream load_stream(const std::filesystem::path& path, DataFormat format, int vocab_size,
                        const TextTokenizer* tokenizer = nullptr);

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
double unigram_entropy_bits(std::span<const uint32_t> tokens);
double unigram_entropy_nats(std::span<const uint32_t> tokens);

}  // namespace t3d::runtime
