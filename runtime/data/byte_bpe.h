// Byte-level BPE, the tokenizer of GPT-2, Llama 3 and Qwen2 (Hugging Face's `tokenizer.json` with
// a "BPE" model and a "ByteLevel" pre-tokenizer), encoding exactly as Hugging Face `tokenizers`
// does (tests/data/test_byte_bpe.cpp checks it against ids that library produced):
//   1. added tokens (`added_tokens`, e.g. <|endoftext|>, <|im_start|>) are cut out of the text
//      first, leftmost match first and the longest at one place, and become their own ids;
//   2. every other stretch is normalised (`normalizer`: none, or NFC as Qwen2's) and split into
//      pieces by the pre-tokenizer's pattern (the GPT-2 pattern of "ByteLevel" with use_regex, or
//      a "Split" with behaviour "Isolated" as Llama 3's and Qwen2's: matches and the text between
//      them are pieces), a PCRE2 regular expression with Unicode properties;
//   3. each piece's UTF-8 bytes are mapped one to one onto GPT-2's printable byte alphabet and
//      merged by BPE: the adjacent pair of lowest merge rank first (leftmost among equals) until
//      no ranked pair is left; with `ignore_merges` (Llama 3) a piece that is a vocabulary entry
//      as a whole is that entry.
// Text that is not valid UTF-8 is encoded too: its invalid bytes match no pattern, so they stay
// in the pieces between matches, and are not normalised. decode(encode(text)) == text for every
// text when the normalizer is none (NFC may recompose characters).
//
// Every key of the file is read or refused: an option this encoder does not implement (another
// model or pre-tokenizer type, a normalizer other than NFC, byte fallback, subword prefixes,
// dropout, added tokens that strip spaces or match whole words only) is a UserError naming the
// file and the key, never a silent difference.
#pragma once

#include <cstdint>
#include <memory>
#include <nlohmann/json_fwd.hpp>
#include <span>
#include <string>
#include <string_view>
#include <unordered_map>
#include <vector>

namespace t3d::runtime {

class ByteLevelBpe {
 public:
  // Ids are below model.vocab_size's limit (docs/recipe.md, "Limits"): no model holds more.
  static constexpr int64_t kMaxIds = int64_t{1} << 24;
  // `json_text`: a tokenizer.json's content; `source` names it in messages.
  static ByteLevelBpe parse(const std::string& json_text, const std::string& source);
  ~ByteLevelBpe();
  ByteLevelBpe(ByteLevelBpe&&) noexcept;
  ByteLevelBpe& operator=(ByteLevelBpe&&) noexcept;

  int vocab_size() const { return static_cast<int>(token_of_id_.size()); }
  int id_of(std::string_view token) const;  // a vocabulary or added token; -1 when absent
  // The id the file's post-processor puts first (TemplateProcessing's first special token, e.g.
  // Llama 3's <|begin_of_text|>); -1 when it puts none (GPT-2, Qwen2). encode never adds it.
  int bos_id() const { return bos_id_; }
  std::vector<uint32_t> encode(std::string_view text) const;
  // UserError on an id outside the vocabulary. Added tokens decode to their content.
  std::string decode(std::span<const uint32_t> ids) const;

 private:
  struct Regex;  // a compiled PCRE2 pattern
  struct Added {
    std::string content;
    uint32_t id;
  };
  ByteLevelBpe() = default;
  // The parts of parse(), each refusing by key what it does not implement.
  void read_parts(const nlohmann::json& file, const std::string& source);
  void read_model(const nlohmann::json& model, const std::string& source);
  void read_added(const nlohmann::json& file, const std::string& source);
  void read_pre_tokenizer(const nlohmann::json& file, const std::string& source);
  void add_token(const std::string& token, int64_t id, const std::string& key,
                 const std::string& source);
  void encode_stretch(std::string_view text, std::vector<uint32_t>& out) const;
  void encode_piece(std::string_view bytes, std::vector<uint32_t>& out) const;

  std::unordered_map<std::string, uint32_t> id_of_token_;  // vocabulary, byte-level strings
  std::vector<std::string> token_of_id_;                   // by id ("" for gaps)
  std::vector<bool> is_added_;                             // by id: decodes to its content as is
  std::unordered_map<uint64_t, std::pair<uint32_t, uint32_t>> merge_;  // (left, right) -> rank, id
  std::vector<Added> added_;                                           // longest first
  bool added_starts_[256] = {};  // some added token starts with this byte: a cheap pre-test
  std::unique_ptr<Regex> split_;
  bool nfc_ = false;
  bool add_prefix_space_ = false;
  bool ignore_merges_ = false;
  int bos_id_ = -1;
  uint32_t byte_id_[256] = {};  // the id of each byte's one-character token
};

}  // namespace t3d::runtime
