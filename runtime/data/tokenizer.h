// Byte-level tokenizer: token = byte, vocab 256. No merges, no special tokens: it needs no files,
// round-trips any input exactly, and is the baseline every corpus can be trained on.
#pragma once

#include <cstdint>
#include <span>
#include <string>
#include <string_view>
#include <vector>

namespace t3d::runtime {

class ByteTokenizer {
 public:
  static constexpr int kVocabSize = 256;

  int vocab_size() const { return kVocabSize; }
  std::vector<uint16_t> encode(std::string_view text) const;
  // Throws UserError on a token outside [0, 256): the caller fed ids from a different vocabulary.
  std::string decode(std::span<const int32_t> tokens) const;
  std::string decode(std::span<const uint16_t> tokens) const;
};

}  // namespace t3d::runtime
