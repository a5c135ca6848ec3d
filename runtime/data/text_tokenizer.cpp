#include "runtime/data/text_tokenizer.h"

#include <sentencepiece_processor.h>
#include <sentencepiece_trainer.h>

#include <algorithm>
#include <climits>
#include <filesystem>
#include <fstream>
#include <unordered_map>

#include "checkpoint/paths.h"
#include "kernels/check.h"
#include "runtime/data/byte_bpe.h"
#include "runtime/data/tokenizer.h"

namespace t3d::runtime {

namespace fs = std::filesystem;
namespace sp = sentencepiece;

TextTokenizer TextTokenizer::open(const std::string& spec, const std::string& key, bool bos) {
  TextTokenizer t;
  T3D_USER_CHECK(!bos || spec != kByteTokenizerName,
                 "a BOS id is asked for (data.bos / --bos), but the byte tokenizer has none (`",
                 key, "` is \"bytes\"); leave BOS off, or give a SentencePiece model with <s>");
  if (spec == kByteTokenizerName) return t;
  T3D_USER_CHECK(!spec.empty(), "`", key,
                 "` is empty; give \"bytes\", a SentencePiece model file (titan3d tokenize "
                 "writes one) or a byte-level BPE tokenizer.json");
  std::error_code ec;
  T3D_USER_CHECK(fs::is_regular_file(spec, ec), "`", key, "`: tokenizer model `", spec,
                 "` does not exist (relative paths start at ", fs::current_path().string(),
                 "); give \"bytes\" or a SentencePiece model file (titan3d tokenize writes one)");
  return load(checkpoint::read_regular_file(spec, "tokenizer model"), spec, key, bos);
}

TextTokenizer TextTokenizer::load(std::string model_bytes, const std::string& spec,
                                  const std::string& key, bool bos) {
  TextTokenizer t;
  t.spec_ = spec;
  t.model_bytes_ = std::move(model_bytes);
  const size_t first = t.model_bytes_.find_first_not_of(" \t\r\n");
  if (first != std::string::npos && t.model_bytes_[first] == '{') {  // a tokenizer.json
    t.bpe_ = std::make_shared<const ByteLevelBpe>(ByteLevelBpe::parse(t.model_bytes_, spec));
    T3D_USER_CHECK(!bos || t.bpe_->bos_id() >= 0, "a BOS id is asked for (data.bos / --bos), but `",
                   key, "`: `", spec,
                   "` names none (its post_processor's template puts no special token first); "
                   "leave BOS off");
    t.bos_ = bos;
    return t;
  }
  auto proc = std::make_shared<sp::SentencePieceProcessor>();
  const auto status = proc->LoadFromSerializedProto(t.model_bytes_);
  T3D_USER_CHECK(status.ok(), "`", key, "`: `", spec, "` is not a SentencePiece model (",
                 status.ToString(),
                 "); give \"bytes\" or a file written by titan3d tokenize or a Hugging Face "
                 "tokenizer.model");
  const int nl = proc->PieceToId("<0x0A>");
  T3D_USER_CHECK(proc->IsByte(nl), "`", key, "`: SentencePiece model `", spec,
                 "` has no byte fallback (no <0x0A> piece), so a newline cannot be encoded; "
                 "train one with titan3d tokenize, which turns byte fallback on");
  t.newline_id_ = nl;
  std::vector<std::string> probe;  // "a" -> "▁a" or "▁" "a" where the model adds the prefix
  T3D_ASSERT(proc->Encode("a", &probe).ok(), "SentencePiece cannot encode \"a\"");
  t.whole_text_ = !probe.empty() && probe[0].rfind("\xE2\x96\x81", 0) == 0;
  T3D_USER_CHECK(!bos || proc->bos_id() >= 0, "a BOS id is asked for (data.bos / --bos), but `",
                 key, "`: SentencePiece model `", spec, "` has no BOS piece; leave BOS off");
  t.bos_ = bos;
  t.sp_ = std::move(proc);
  return t;
}

int TextTokenizer::bos_id() const {
  if (bpe_) return bpe_->bos_id();
  return sp_ ? sp_->bos_id() : -1;
}

int TextTokenizer::eos_id() const { return sp_ ? sp_->eos_id() : -1; }

int TextTokenizer::vocab_size() const {
  if (bpe_) return bpe_->vocab_size();
  return sp_ ? sp_->GetPieceSize() : ByteTokenizer::kVocabSize;
}

std::string TextTokenizer::describe() const {
  if (is_bytes()) return "bytes (256 ids)";
  return spec_ + (bpe_ ? " (byte-level BPE, " : " (SentencePiece, ") +
         std::to_string(vocab_size()) + " ids" +
         (bos_ ? ", BOS " + std::to_string(bos_id()) + " first" : "") + ")";
}

std::vector<uint32_t> TextTokenizer::encode(std::string_view text) const {
  if (bpe_) return bpe_->encode(text);
  std::vector<uint32_t> out;
  if (!sp_) {
    const auto bytes = ByteTokenizer{}.encode(text);
    return {bytes.begin(), bytes.end()};
  }
  std::vector<int> ids;
  if (whole_text_) {
    const auto status = sp_->Encode(text, &ids);
    T3D_ASSERT(status.ok(), "SentencePiece cannot encode a text: ", status.ToString());
    return {ids.begin(), ids.end()};
  }
  out.reserve(text.size() / 3);
  size_t pos = 0;
  while (pos <= text.size()) {
    const size_t nl = std::min(text.find('\n', pos), text.size());
    const auto status = sp_->Encode(text.substr(pos, nl - pos), &ids);
    T3D_ASSERT(status.ok(), "SentencePiece cannot encode a line: ", status.ToString());
    out.insert(out.end(), ids.begin(), ids.end());
    if (nl == text.size()) break;
    out.push_back(static_cast<uint32_t>(newline_id_));
    pos = nl + 1;
  }
  return out;
}

std::vector<uint32_t> TextTokenizer::encode_document(std::string_view text) const {
  if (!bos_) return encode(text);
  std::vector<uint32_t> out{static_cast<uint32_t>(bos_id())};
  const std::vector<uint32_t> ids = encode(text);
  out.insert(out.end(), ids.begin(), ids.end());
  return out;
}

std::string TextTokenizer::decode(std::span<const int32_t> ids) const {
  if (is_bytes()) return ByteTokenizer{}.decode(ids);
  const int n = vocab_size();
  for (size_t i = 0; i < ids.size(); ++i)
    T3D_USER_CHECK(ids[i] >= 0 && ids[i] < n, "tokenizer ", spec_, ": id ", ids[i], " at position ",
                   i, " is outside [0, ", n, "); the ids come from another vocabulary");
  if (bpe_) return bpe_->decode(std::vector<uint32_t>(ids.begin(), ids.end()));
  std::string text;
  const auto status = sp_->Decode(std::vector<int>(ids.begin(), ids.end()), &text);
  T3D_ASSERT(status.ok(), "SentencePiece cannot decode: ", status.ToString());
  return text;
}

std::string TextTokenizer::decode(std::span<const uint32_t> ids) const {
  std::vector<int32_t> narrow(ids.size());
  for (size_t i = 0; i < ids.size(); ++i)
    narrow[i] = ids[i] > INT32_MAX ? -1 : static_cast<int32_t>(ids[i]);
  return decode(std::span<const int32_t>(narrow));
}

void train_tokenizer(const TokenizerTraining& t) {
  T3D_USER_CHECK(t.type == "bpe" || t.type == "unigram", "--type is `", t.type,
                 "`; give bpe or unigram");
  // 256 byte pieces plus <unk>, <s>, </s> are reserved; fewer leaves nothing to learn.
  T3D_USER_CHECK(t.vocab >= 300 && t.vocab <= (int64_t{1} << 31) - 1, "--vocab is ", t.vocab,
                 "; give at least 300 (256 byte pieces and 3 special ids are reserved)");
  std::error_code ec;
  T3D_USER_CHECK(fs::is_regular_file(t.corpus, ec), "the corpus `", t.corpus,
                 "` does not exist or is not a file");
  const std::unordered_map<std::string, std::string> args = {
      {"input", t.corpus},
      {"vocab_size", std::to_string(t.vocab)},
      {"model_type", t.type},
      {"byte_fallback", "true"},
      {"normalization_rule_name", "identity"},
      {"add_dummy_prefix", "false"},
      {"remove_extra_whitespaces", "false"},
      {"num_threads", std::to_string(std::max(1, t.threads))},
      {"minloglevel", "1"},  // SentencePiece's progress lines (hundreds) only at INFO
  };
  std::string model;
  const auto status = sp::SentencePieceTrainer::Train(args, nullptr, &model);
  T3D_USER_CHECK(status.ok(), "training a ", t.type, " tokenizer of ", t.vocab, " ids on `",
                 t.corpus, "` failed: ", status.ToString(),
                 " (a smaller --vocab fits a small corpus)");
  checkpoint::write_file_atomically(t.out, model, "--tokenizer");
}

}  // namespace t3d::runtime
