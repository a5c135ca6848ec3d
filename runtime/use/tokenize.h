// `titan3d tokenize`: trains a SentencePiece tokenizer on a text corpus and / or encodes text into
// a token file with it (or decodes a token file back into text). The tokenizer itself lives in
// runtime/data/text_tokenizer.h; this is the verb around it (docs/tokenizers-and-import.md).
#pragma once

#include <cstdint>
#include <string>

namespace t3d::runtime {

struct TokenizeOptions {
  std::string input;      // text to encode (and train on), or with `decode` a token file
  std::string tokenizer;  // model file: written when vocab > 0, else read ("bytes" allowed)
  std::string out;        // token file to write (decode: text file; "" stdout)
  int64_t vocab = 0;      // > 0: train a tokenizer of this many ids on `input` first
  std::string type = "bpe";
  bool decode = false;
  bool bos = false;  // the token file starts with the BOS id, as data.bos reads a text file
};

struct TokenizeSummary {
  bool trained = false;
  double train_s = 0;
  int vocab = 0;
  int64_t bytes = 0, tokens = 0;  // of the text and of the token file
  int version = 0;                // of the token file written (1: uint16, 2: uint32)
};

// UserError naming the option at fault.
TokenizeSummary run_tokenize(const TokenizeOptions& options);

}  // namespace t3d::runtime
