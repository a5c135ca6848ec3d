#include "runtime/data/data.h"

#include <algorithm>
#include <array>
#include <bit>
#include <cmath>
#include <cstring>
#include <fstream>
#include <numbers>

#include "checkpoint/paths.h"
#include "kernels/check.h"
#include "runtime/data/text_tokenizer.h"
#include "runtime/data/tokenizer.h"

namespace t3d::runtime {

// Both layouts are little-endian on disk; reading them raw is only right on such a host.
static_assert(std::endian::native == std::endian::little,
              "token files assume a little-endian host");

namespace {

// The llm.c header of a token file: where the tokens start, how many, and their width.
struct TokenLayout {
  int64_t offset = 0, count = 0, width = 2;
};

TokenLayout parse_header(const std::string& bytes, const std::string& name) {
  const auto size = static_cast<int64_t>(bytes.size());
  constexpr int64_t header_bytes = kTokenFileHeaderInts * 4;
  T3D_USER_CHECK(size >= header_bytes, "token file '", name, "' is truncated: it has ", size,
                 " bytes, less than the ", header_bytes, "-byte header; regenerate it");
  std::array<int32_t, 3> header{};
  std::memcpy(header.data(), bytes.data(), sizeof(header));
  T3D_USER_CHECK(header[1] == kTokenFileVersion || header[1] == kTokenFileVersionU32,
                 "token file '", name, "' has version ", header[1], ", expected ",
                 kTokenFileVersion, " (uint16 tokens) or ", kTokenFileVersionU32,
                 " (uint32 tokens); re-export it in the llm.c layout");
  TokenLayout l{header_bytes, header[2], header[1] == kTokenFileVersionU32 ? 4 : 2};
  T3D_USER_CHECK(l.count >= 0, "token file '", name, "' has a negative token count ", l.count);
  const int64_t expected = header_bytes + l.width * l.count;
  T3D_USER_CHECK(size >= expected, "token file '", name, "' is truncated: its header promises ",
                 l.count, " tokens (", expected, " bytes) but the file has ", size,
                 " bytes; regenerate it");
  T3D_USER_CHECK(size == expected, "token file '", name, "' has ", size - expected,
                 " bytes after the ", l.count,
                 " tokens its header announces; the file is "
                 "corrupt or not in the llm.c layout");
  return l;
}

template <typename T>
void copy_tokens(const std::string& bytes, const TokenLayout& l, std::vector<uint32_t>& out) {
  std::vector<T> raw(static_cast<size_t>(l.count));
  std::memcpy(raw.data(), bytes.data() + l.offset, raw.size() * sizeof(T));
  out.assign(raw.begin(), raw.end());
}

}  // namespace

TokenStream read_token_file(const std::filesystem::path& path, int vocab_size) {
  const std::string name = path.string();
  const std::string bytes = checkpoint::read_regular_file(path.string(), "token file");
  const auto size = static_cast<int64_t>(bytes.size());
  T3D_USER_CHECK(size > 0, "token file '", name, "' is empty");

  int32_t first = 0;
  if (size >= 4) std::memcpy(&first, bytes.data(), 4);
  TokenLayout layout;
  if (first == kTokenFileMagic) {
    layout = parse_header(bytes, name);
  } else {
    // Headerless nanoGPT layout: nothing to check but whole uint16s.
    T3D_USER_CHECK(size % 2 == 0, "token file '", name, "' has no llm.c header (magic ",
                   kTokenFileMagic, ") and an odd size (", size,
                   " bytes), so it is not raw uint16 tokens either; the file is truncated or in "
                   "another format");
    layout.count = size / 2;
  }

  TokenStream out{name, {}};
  if (layout.width == 4)
    copy_tokens<uint32_t>(bytes, layout, out.tokens);
  else
    copy_tokens<uint16_t>(bytes, layout, out.tokens);
  if (vocab_size > 0) {
    for (int64_t i = 0; i < layout.count; ++i) {
      T3D_USER_CHECK(out.tokens[i] < static_cast<uint32_t>(vocab_size), "token file '", name,
                     "': token ", out.tokens[i], " at position ", i, " is >= vocab_size ",
                     vocab_size,
                     "; the file was made with a larger vocabulary, set model.vocab_size to at "
                     "least ",
                     out.tokens[i] + 1, " or re-tokenize");
    }
  }
  return out;
}

void write_token_file(const std::filesystem::path& path, std::span<const uint32_t> tokens) {
  T3D_USER_CHECK(tokens.size() <= static_cast<size_t>(INT32_MAX), "cannot write ", tokens.size(),
                 " tokens to '", path.string(), "': the llm.c header holds an int32 count");
  const bool wide = std::any_of(tokens.begin(), tokens.end(), [](uint32_t t) { return t > 65535; });
  std::array<int32_t, kTokenFileHeaderInts> header{};
  header[0] = kTokenFileMagic;
  header[1] = wide ? kTokenFileVersionU32 : kTokenFileVersion;
  header[2] = static_cast<int32_t>(tokens.size());
  checkpoint::AtomicFile out(path.string(), "token file");
  out.write(header.data(), sizeof(header));
  if (wide) {
    out.write(tokens.data(), tokens.size_bytes());
  } else {
    const std::vector<uint16_t> narrow(tokens.begin(), tokens.end());
    out.write(narrow.data(), narrow.size() * 2);
  }
  out.commit();
}

void write_token_file(const std::filesystem::path& path, std::span<const uint16_t> tokens) {
  const std::vector<uint32_t> wide(tokens.begin(), tokens.end());
  write_token_file(path, std::span<const uint32_t>(wide));
}

TokenStream read_text_file(const std::filesystem::path& path) {
  const std::string bytes = checkpoint::read_regular_file(path.string(), "text file");
  T3D_USER_CHECK(!bytes.empty(), "text file '", path.string(), "' is empty");
  const std::vector<uint16_t> ids = ByteTokenizer{}.encode(bytes);
  return {path.string(), {ids.begin(), ids.end()}};
}

TokenStream load_corpus(const std::filesystem::path& path, int vocab_size) {
  if (path.extension() == ".txt") {
    T3D_USER_CHECK(vocab_size <= 0 || vocab_size >= ByteTokenizer::kVocabSize, "'", path.string(),
                   "' is text, read with the byte tokenizer (256 tokens), but "
                   "model.vocab_size is ",
                   vocab_size, "; set it to at least 256");
    return read_text_file(path);
  }
  return read_token_file(path, vocab_size);
}

TrainValSplit split_train_val(const TokenStream& all, double val_fraction, int64_t min_tokens) {
  T3D_USER_CHECK(val_fraction > 0.0 && val_fraction < 1.0, "data.val_fraction is ", val_fraction,
                 "; it must lie in (0, 1), e.g. 0.05");
  const int64_t n = all.size();
  const int64_t n_val = std::max<int64_t>(min_tokens, static_cast<int64_t>(val_fraction * n));
  T3D_USER_CHECK(n_val < n && n - n_val >= min_tokens, "'", all.source, "' has ", n,
                 " tokens, too few to hold out ", n_val, " for validation and keep at least ",
                 min_tokens,
                 " for training; use a larger corpus or a smaller data.val_fraction "
                 "/ sequence length");
  const auto cut = all.tokens.begin() + (n - n_val);
  return {TokenStream{all.source + " [train]", {all.tokens.begin(), cut}},
          TokenStream{all.source + " [val]", {cut, all.tokens.end()}}};
}

double unigram_entropy_bits(std::span<const uint32_t> tokens) {
  if (tokens.empty()) return 0.0;
  std::vector<int64_t> counts(*std::max_element(tokens.begin(), tokens.end()) + size_t{1}, 0);
  for (uint16_t t : tokens) ++counts[t];
  const double n = static_cast<double>(tokens.size());
  double h = 0.0;
  for (int64_t c : counts) {
    if (c == 0) continue;
    const double p = static_cast<double>(c) / n;
    h -= p * std::log2(p);
  }
  return h;
}

double unigram_entropy_nats(std::span<const uint32_t> tokens) {
  return unigram_entropy_bits(tokens) * std::numbers::ln2;
}

TokenStream load_stream(const std::filesystem::path& path, DataFormat format, int vocab_size,
                        const TextTokenizer* tokenizer) {
  const bool text =
      format == DataFormat::kText || (format == DataFormat::kAuto && path.extension() == ".txt");
  if (!text || !tokenizer || tokenizer->is_bytes()) {
    switch (format) {
      case DataFormat::kText:
        return read_text_file(path);
      case DataFormat::kBin:
        return read_token_file(path, vocab_size);
      case DataFormat::kAuto:
        break;
    }
    return load_corpus(path, vocab_size);
  }
  T3D_USER_CHECK(vocab_size <= 0 || tokenizer->vocab_size() <= vocab_size, "data.tokenizer `",
                 tokenizer->spec(), "` has ", tokenizer->vocab_size(),
                 " ids but model.vocab_size is ", vocab_size, "; set model.vocab_size to at least ",
                 tokenizer->vocab_size());
  const std::string bytes = checkpoint::read_regular_file(path.string(), "text file");
  T3D_USER_CHECK(!bytes.empty(), "text file '", path.string(), "' is empty");
  return {path.string(), tokenizer->encode_document(bytes)};
}

}  // namespace t3d::runtime
