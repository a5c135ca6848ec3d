#include "runtime/data/data.h"

#include <glob.h>

#include <algorithm>
#include <array>
#include <bit>
#include <cmath>
#include <cstring>
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

TokenLayout parse_header(const std::byte* bytes, int64_t size, const std::string& name) {
  constexpr int64_t header_bytes = kTokenFileHeaderInts * 4;
  T3D_USER_CHECK(size >= header_bytes, "token file '", name, "' is truncated: it has ", size,
                 " bytes, less than the ", header_bytes, "-byte header; regenerate it");
  std::array<int32_t, 3> header{};
  std::memcpy(header.data(), bytes, sizeof(header));
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

// Every id < vocab_size: one pass for the largest (the pages it reads are the ones training
// samples from), a second only to name the first offender.
void check_vocab(const Tokens& tokens, int vocab_size, const std::string& name) {
  uint32_t largest = 0;
  tokens.for_each_part([&](int64_t, auto ids) {
    for (const auto t : ids) largest = std::max<uint32_t>(largest, t);
  });
  if (largest < static_cast<uint32_t>(vocab_size)) return;
  int64_t i = 0;
  while (tokens[i] < static_cast<uint32_t>(vocab_size)) ++i;
  T3D_USER_CHECK(false, "token file '", name, "': token ", tokens[i], " at position ", i,
                 " is >= vocab_size ", vocab_size,
                 "; the file was made with a larger vocabulary, set model.vocab_size to at least ",
                 largest + uint64_t{1}, " or re-tokenize");
}

}  // namespace

Tokens::Tokens(std::vector<uint32_t> ids) {
  auto owned = std::make_shared<const std::vector<uint32_t>>(std::move(ids));
  const Part whole{owned, owned->data(), static_cast<int64_t>(owned->size()), 4};
  *this = Tokens(std::vector<Part>{whole});
}

Tokens::Tokens(std::vector<Part> parts) {
  starts_.push_back(0);
  for (Part& p : parts) {
    T3D_ASSERT((p.width == 2 || p.width == 4) && p.size >= 0, "width ", p.width, " size ", p.size);
    if (p.size == 0) continue;
    starts_.push_back(starts_.back() + p.size);
    parts_.push_back(std::move(p));
  }
}

int Tokens::width() const {
  for (const Part& p : parts_)
    if (p.width != parts_.front().width) return 0;
  return parts_.empty() ? 4 : parts_.front().width;
}

size_t Tokens::part_of(int64_t i) const {
  T3D_ASSERT(i >= 0 && i < size(), "id ", i, " of ", size());
  return static_cast<size_t>(std::upper_bound(starts_.begin(), starts_.end(), i) - starts_.begin() -
                             1);
}

uint32_t Tokens::operator[](int64_t i) const {
  const size_t p = part_of(i);
  const Part& part = parts_[p];
  const int64_t j = i - starts_[p];
  return part.width == 2 ? static_cast<const uint16_t*>(part.data)[j]
                         : static_cast<const uint32_t*>(part.data)[j];
}

void Tokens::copy(int64_t first, int64_t n, int32_t* out) const {
  T3D_ASSERT(first >= 0 && n >= 0 && first + n <= size(), "ids [", first, ", ", first + n, ") of ",
             size());
  for (size_t p = n > 0 ? part_of(first) : parts_.size(); n > 0; ++p) {
    const Part& part = parts_[p];
    const int64_t from = first - starts_[p], take = std::min(n, part.size - from);
    if (part.width == 2)
      std::copy_n(static_cast<const uint16_t*>(part.data) + from, take, out);
    else
      std::copy_n(static_cast<const uint32_t*>(part.data) + from, take, out);
    first += take, out += take, n -= take;
  }
}

Tokens Tokens::slice(int64_t first, int64_t n) const {
  T3D_ASSERT(first >= 0 && n >= 0 && first + n <= size(), "ids [", first, ", ", first + n, ") of ",
             size());
  std::vector<Part> kept;
  for (size_t p = n > 0 ? part_of(first) : parts_.size(); n > 0; ++p) {
    Part part = parts_[p];
    const int64_t from = first - starts_[p], take = std::min(n, part.size - from);
    part.data = static_cast<const char*>(part.data) + from * part.width;
    part.size = take;
    kept.push_back(std::move(part));
    first += take, n -= take;
  }
  return Tokens(std::move(kept));
}

std::vector<uint32_t> Tokens::to_vector() const {
  std::vector<uint32_t> ids;
  ids.reserve(static_cast<size_t>(size()));
  for_each_part([&](int64_t, auto part) { ids.insert(ids.end(), part.begin(), part.end()); });
  return ids;
}

TokenStream read_token_file(const std::filesystem::path& path, int vocab_size) {
  const std::string name = path.string();
  const auto file = checkpoint::ReadOnlyFile::open(name, "token file");
  const auto size = static_cast<int64_t>(file.size());
  T3D_USER_CHECK(size > 0, "token file '", name, "' is empty");
  const std::shared_ptr<const std::byte> bytes = file.map();

  int32_t first = 0;
  if (size >= 4) std::memcpy(&first, bytes.get(), 4);
  TokenLayout layout;
  if (first == kTokenFileMagic) {
    layout = parse_header(bytes.get(), size, name);
  } else {
    // Headerless nanoGPT layout: nothing to check but whole uint16s.
    T3D_USER_CHECK(size % 2 == 0, "token file '", name, "' has no llm.c header (magic ",
                   kTokenFileMagic, ") and an odd size (", size,
                   " bytes), so it is not raw uint16 tokens either; the file is truncated or in "
                   "another format");
    layout.count = size / 2;
  }
  TokenStream out{name, Tokens({Tokens::Part{bytes, bytes.get() + layout.offset, layout.count,
                                             static_cast<int>(layout.width)}})};
  if (vocab_size > 0) check_vocab(out.tokens, vocab_size, name);
  return out;
}

std::vector<std::string> data_files(const std::string& path, const std::string& key) {
  std::error_code ec;
  if (path.find_first_of("*?[") == std::string::npos || std::filesystem::exists(path, ec))
    return {path};
  glob_t found{};
  const int rc = ::glob(path.c_str(), GLOB_ERR | GLOB_NOSORT, nullptr, &found);
  std::vector<std::string> files(found.gl_pathv, found.gl_pathv + found.gl_pathc);
  ::globfree(&found);
  T3D_USER_CHECK(rc == 0 && !files.empty(), key, ": no file matches the pattern `", path,
                 "` (relative paths start at ", std::filesystem::current_path().string(),
                 "); name a token file or a pattern of them, e.g. data/train_*.bin");
  std::sort(files.begin(), files.end());  // byte order, whatever the locale's collation
  return files;
}

TokenStream read_token_files(const std::string& path, int vocab_size, const std::string& key) {
  const std::vector<std::string> files = data_files(path, key);
  if (files.size() == 1 && files.front() == path) return read_token_file(path, vocab_size);
  std::vector<Tokens::Part> parts;
  for (const std::string& file : files) {
    const TokenStream one = read_token_file(file, vocab_size);
    parts.insert(parts.end(), one.tokens.parts().begin(), one.tokens.parts().end());
  }
  return {path, Tokens(std::move(parts))};
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
  return {path.string(), Tokens(std::vector<uint32_t>(ids.begin(), ids.end()))};
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
  return {TokenStream{all.source + " [train]", all.tokens.slice(0, n - n_val)},
          TokenStream{all.source + " [val]", all.tokens.slice(n - n_val, n_val)}};
}

double unigram_entropy_bits(const Tokens& tokens) {
  if (tokens.empty()) return 0.0;
  std::vector<int64_t> counts;
  tokens.for_each_part([&](int64_t, auto ids) {
    const auto largest = *std::max_element(ids.begin(), ids.end());
    if (counts.size() <= largest) counts.resize(largest + size_t{1}, 0);
    for (const auto t : ids) ++counts[t];
  });
  const double n = static_cast<double>(tokens.size());
  double h = 0.0;
  for (int64_t c : counts) {
    if (c == 0) continue;
    const double p = static_cast<double>(c) / n;
    h -= p * std::log2(p);
  }
  return h;
}

double unigram_entropy_nats(const Tokens& tokens) {
  return unigram_entropy_bits(tokens) * std::numbers::ln2;
}

TokenStream load_stream(const std::filesystem::path& path, DataFormat format, int vocab_size,
                        const TextTokenizer* tokenizer, const std::string& key) {
  const bool text =
      format == DataFormat::kText || (format == DataFormat::kAuto && path.extension() == ".txt");
  if (!text) return read_token_files(path.string(), vocab_size, key);
  const std::vector<std::string> files = data_files(path.string(), key);
  T3D_USER_CHECK(files.size() == 1 && files.front() == path.string(), key, ": `", path.string(),
                 "` is a pattern of text files; a pattern reads token files only: concatenate "
                 "the texts into one file, or encode them (titan3d tokenize) into token files");
  if (!tokenizer || tokenizer->is_bytes())
    return format == DataFormat::kText ? read_text_file(path) : load_corpus(path, vocab_size);
  T3D_USER_CHECK(vocab_size <= 0 || tokenizer->vocab_size() <= vocab_size, "data.tokenizer `",
                 tokenizer->spec(), "` has ", tokenizer->vocab_size(),
                 " ids but model.vocab_size is ", vocab_size, "; set model.vocab_size to at least ",
                 tokenizer->vocab_size());
  const std::string bytes = checkpoint::read_regular_file(path.string(), "text file");
  T3D_USER_CHECK(!bytes.empty(), "text file '", path.string(), "' is empty");
  return {path.string(), Tokens(tokenizer->encode_document(bytes))};
}

}  // namespace t3d::runtime
