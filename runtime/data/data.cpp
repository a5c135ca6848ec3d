#include "runtime/data/data.h"

#include <array>
#include <bit>
#include <cmath>
#include <cstring>
#include <fstream>
#include <numbers>

#include "kernels/check.h"
#include "runtime/data/tokenizer.h"

namespace t3d::runtime {

// Both layouts are little-endian on disk; reading them raw is only right on such a host.
static_assert(std::endian::native == std::endian::little,
              "token files assume a little-endian host");

namespace {

std::vector<char> read_all_bytes(const std::filesystem::path& path, const char* what) {
  std::error_code ec;
  T3D_USER_CHECK(std::filesystem::is_regular_file(path, ec), what, " '", path.string(),
                 "' does not exist or is not a regular file; check the path (scripts/get_data.sh "
                 "fetches the default corpus)");
  std::ifstream in(path, std::ios::binary);
  T3D_USER_CHECK(in.good(), "cannot open ", what, " '", path.string(), "'; check permissions");
  const auto size = static_cast<std::streamsize>(std::filesystem::file_size(path));
  std::vector<char> bytes(static_cast<size_t>(size));
  in.read(bytes.data(), size);
  T3D_USER_CHECK(in.gcount() == size, "short read from ", what, " '", path.string(), "' (got ",
                 in.gcount(), " of ", size, " bytes)");
  return bytes;
}

}  // namespace

TokenStream read_token_file(const std::filesystem::path& path, int vocab_size) {
  const std::string name = path.string();
  const std::vector<char> bytes = read_all_bytes(path, "token file");
  const auto size = static_cast<int64_t>(bytes.size());
  T3D_USER_CHECK(size > 0, "token file '", name, "' is empty");

  int32_t first = 0;
  if (size >= 4) std::memcpy(&first, bytes.data(), 4);
  int64_t offset = 0;
  int64_t count = 0;
  if (first == kTokenFileMagic) {
    constexpr int64_t header_bytes = kTokenFileHeaderInts * 4;
    T3D_USER_CHECK(size >= header_bytes, "token file '", name, "' is truncated: it has ", size,
                   " bytes, less than the ", header_bytes, "-byte header; regenerate it");
    std::array<int32_t, 3> header{};
    std::memcpy(header.data(), bytes.data(), sizeof(header));
    T3D_USER_CHECK(header[1] == kTokenFileVersion, "token file '", name, "' has version ",
                   header[1], ", expected ", kTokenFileVersion,
                   " (uint16 tokens); re-export it in the llm.c uint16 layout");
    count = header[2];
    T3D_USER_CHECK(count >= 0, "token file '", name, "' has a negative token count ", count);
    offset = header_bytes;
    const int64_t expected = header_bytes + 2 * count;
    T3D_USER_CHECK(size >= expected, "token file '", name, "' is truncated: its header promises ",
                   count, " tokens (", expected, " bytes) but the file has ", size,
                   " bytes; regenerate it");
    T3D_USER_CHECK(size == expected, "token file '", name, "' has ", size - expected,
                   " bytes after the ", count,
                   " tokens its header announces; the file is "
                   "corrupt or not in the llm.c layout");
  } else {
    // Headerless nanoGPT layout: nothing to check but whole uint16s.
    T3D_USER_CHECK(size % 2 == 0, "token file '", name, "' has no llm.c header (magic ",
                   kTokenFileMagic, ") and an odd size (", size,
                   " bytes), so it is not raw uint16 tokens either; the file is truncated or in "
                   "another format");
    count = size / 2;
  }

  TokenStream out{name, std::vector<uint16_t>(static_cast<size_t>(count))};
  std::memcpy(out.tokens.data(), bytes.data() + offset, static_cast<size_t>(count) * 2);
  if (vocab_size > 0) {
    for (int64_t i = 0; i < count; ++i) {
      T3D_USER_CHECK(out.tokens[i] < vocab_size, "token file '", name, "': token ", out.tokens[i],
                     " at position ", i, " is >= vocab_size ", vocab_size,
                     "; the file was made with a larger vocabulary, set model.vocab_size to at "
                     "least ",
                     out.tokens[i] + 1, " or re-tokenize");
    }
  }
  return out;
}

void write_token_file(const std::filesystem::path& path, std::span<const uint16_t> tokens) {
  T3D_USER_CHECK(tokens.size() <= static_cast<size_t>(INT32_MAX), "cannot write ", tokens.size(),
                 " tokens to '", path.string(), "': the llm.c header holds an int32 count");
  std::array<int32_t, kTokenFileHeaderInts> header{};
  header[0] = kTokenFileMagic;
  header[1] = kTokenFileVersion;
  header[2] = static_cast<int32_t>(tokens.size());
  std::ofstream out(path, std::ios::binary | std::ios::trunc);
  T3D_USER_CHECK(out.good(), "cannot create token file '", path.string(),
                 "'; check that the directory exists and is writable");
  out.write(reinterpret_cast<const char*>(header.data()), sizeof(header));
  out.write(reinterpret_cast<const char*>(tokens.data()),
            static_cast<std::streamsize>(tokens.size_bytes()));
  out.flush();
  T3D_USER_CHECK(out.good(), "writing token file '", path.string(), "' failed (disk full?)");
}

TokenStream read_text_file(const std::filesystem::path& path) {
  const std::vector<char> bytes = read_all_bytes(path, "text file");
  T3D_USER_CHECK(!bytes.empty(), "text file '", path.string(), "' is empty");
  return {path.string(), ByteTokenizer{}.encode({bytes.data(), bytes.size()})};
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

double unigram_entropy_bits(std::span<const uint16_t> tokens) {
  if (tokens.empty()) return 0.0;
  std::vector<int64_t> counts(65536, 0);
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

double unigram_entropy_nats(std::span<const uint16_t> tokens) {
  return unigram_entropy_bits(tokens) * std::numbers::ln2;
}

TokenStream load_stream(const std::filesystem::path& path, DataFormat format, int vocab_size) {
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

}  // namespace t3d::runtime
