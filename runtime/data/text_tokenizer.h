// The tokenizer a run reads text through (recipe key data.tokenizer): the byte tokenizer
// ("bytes", the default: token = byte), a SentencePiece model file (BPE or unigram, trained by
// `titan3d tokenize` or taken from a Hugging Face LLaMA directory's tokenizer.model), or a
// byte-level BPE `tokenizer.json` (GPT-2, Llama 3, Qwen2: runtime/data/byte_bpe.h), told apart by
// the file's content.
//
// Encoding contract. Bytes and SentencePiece: the text is cut at '\n'; each line (without its
// '\n') goes through the tokenizer, and each '\n' becomes one token, the byte piece <0x0A> of a
// SentencePiece model (its byte fallback) or byte 10. So a model sees the same ids for a line
// wherever the line sits in a file, memory stays bounded by the longest line, and a Python user
// reproduces the ids with `sp.encode(line)` per line (tests/use/sentencepiece_check.py does).
// A SentencePiece model that puts its dummy prefix "▁" before a text (add_dummy_prefix: LLaMA's
// and Mistral's tokenizer.model; titan3d trains none) reads the whole text at once instead, as
// transformers' LlamaTokenizer does (`sp.encode(text)`): line by line, every line would gain
// that prefix, ids the model never saw after a '\n'.
// Byte-level BPE: the whole text goes through the tokenizer at once (its patterns treat newlines
// as text), the ids Hugging Face's `tokenizer.encode(text, add_special_tokens=False)` gives.
// encode adds no BOS or EOS id; encode_document, what a text file or a prompt becomes, starts
// with the BOS id when the tokenizer was opened with `bos` (recipe key data.bos, as Hugging Face's
// LLaMA tokenizers do: once per text, not per line). decode(encode(text)) == text for every valid
// UTF-8 text when the model has byte fallback and the identity normalisation, as `titan3d
// tokenize` trains it (SentencePiece replaces each invalid UTF-8 byte with U+FFFD); a model with
// another normaliser (NFKC; NFC for Qwen2's BPE) may map some characters to others. Byte-level
// BPE round-trips invalid UTF-8 bytes too.
#pragma once

#include <cstdint>
#include <memory>
#include <span>
#include <string>
#include <string_view>
#include <vector>

namespace sentencepiece {
class SentencePieceProcessor;
}

namespace t3d::runtime {

class ByteLevelBpe;

inline constexpr const char* kByteTokenizerName = "bytes";

class TextTokenizer {
 public:
  // `spec`: "bytes", or the path of a SentencePiece model file. UserError naming `key` (the recipe
  // key or option the spec came from) and the file when it is missing or not a model, and naming
  // data.bos / --bos when `bos` is asked of a tokenizer without a BOS id (bytes, or a model
  // without <s>).
  static TextTokenizer open(const std::string& spec, const std::string& key = "data.tokenizer",
                            bool bos = false);
  // The SentencePiece model in `model_bytes` (read by the caller, e.g. through a descriptor
  // checked to lie inside a directory); `spec` names it in messages and is its spec().
  static TextTokenizer load(std::string model_bytes, const std::string& spec,
                            const std::string& key, bool bos = false);

  bool is_bytes() const { return sp_ == nullptr && bpe_ == nullptr; }
  bool is_byte_level_bpe() const { return bpe_ != nullptr; }
  int vocab_size() const;
  const std::string& spec() const { return spec_; }
  std::string describe() const;  // "bytes (256 ids)" / "path (BPE, 512 ids)" for logs

  std::vector<uint32_t> encode(std::string_view text) const;
  // A whole text (a file, a prompt): encode(text), after the BOS id when opened with `bos`.
  std::vector<uint32_t> encode_document(std::string_view text) const;
  bool adds_bos() const { return bos_; }
  int bos_id() const;  // the model's BOS id (<s>), -1 when it has none (bytes: none)
  // The model's EOS id (</s>); -1 when it has none or does not say (bytes; a tokenizer.json).
  int eos_id() const;
  // UserError on an id outside the vocabulary (the ids come from another tokenizer).
  std::string decode(std::span<const int32_t> ids) const;
  std::string decode(std::span<const uint32_t> ids) const;

  // The model file's bytes ("" for bytes), and the name Hugging Face gives such a file
  // (tokenizer.model, tokenizer.json): export and import copy it under that name.
  const std::string& model_bytes() const { return model_bytes_; }
  const char* file_name() const { return bpe_ ? "tokenizer.json" : "tokenizer.model"; }

 private:
  std::string spec_ = kByteTokenizerName;
  std::string model_bytes_;
  std::shared_ptr<const sentencepiece::SentencePieceProcessor> sp_;
  std::shared_ptr<const ByteLevelBpe> bpe_;
  int32_t newline_id_ = '\n';
  bool whole_text_ = false;  // a SentencePiece model with a dummy prefix: one text, not lines
  bool bos_ = false;
};

struct TokenizerTraining {
  std::string corpus;        // a text file, one sentence per line as SentencePiece reads it
  std::string out;           // the model file to write
  int64_t vocab = 0;         // ids in all, byte pieces and <unk> <s> </s> included
  std::string type = "bpe";  // bpe | unigram
  int threads = 1;
};

// Trains a SentencePiece model with byte fallback (every byte has a piece, so no text is
// unencodable), identity normalisation and no dummy prefix or whitespace folding (so decoding
// gives the text back exactly), and writes it to `out`. UserError naming the option at fault.
void train_tokenizer(const TokenizerTraining& t);

}  // namespace t3d::runtime
