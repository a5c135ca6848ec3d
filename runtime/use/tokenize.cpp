#include "runtime/use/tokenize.h"

#include <algorithm>
#include <cerrno>
#include <chrono>
#include <cstdio>
#include <cstring>
#include <filesystem>
#include <fstream>
#include <thread>

#include "checkpoint/paths.h"
#include "kernels/check.h"
#include "runtime/data/data.h"
#include "runtime/data/text_tokenizer.h"

namespace t3d::runtime {

namespace fs = std::filesystem;

namespace {

void write_text(const std::string& path, const std::string& text) {
  if (path.empty()) {
    std::fwrite(text.data(), 1, text.size(), stdout);
    const bool failed = std::fflush(stdout) != 0 || std::ferror(stdout);
    const int err = errno;
    T3D_USER_CHECK(!failed,
                   "writing the decoded text to standard output failed: ", std::strerror(err),
                   "; it is lost. Redirect it where there is space, or give --out.");
    return;
  }
  checkpoint::write_file_atomically(path, text, "--out");
}

}  // namespace

TokenizeSummary run_tokenize(const TokenizeOptions& o) {
  TokenizeSummary s;
  T3D_USER_CHECK(!o.tokenizer.empty(), "--tokenizer is missing: give the model file to ",
                 o.vocab > 0 ? "write" : "read", " (or \"bytes\")");
  if (o.vocab > 0) {
    T3D_USER_CHECK(!o.decode, "--decode reads a token file; train (--vocab) on text instead");
    T3D_USER_CHECK(o.tokenizer != kByteTokenizerName,
                   "--tokenizer names the model file to write; \"bytes\" needs no training");
    const auto t0 = std::chrono::steady_clock::now();
    const int threads = static_cast<int>(std::max(1u, std::thread::hardware_concurrency()));
    train_tokenizer({o.input, o.tokenizer, o.vocab, o.type, threads});
    s.trained = true;
    s.train_s = std::chrono::duration<double>(std::chrono::steady_clock::now() - t0).count();
  }
  const TextTokenizer tok = TextTokenizer::open(o.tokenizer, "--tokenizer", o.bos && !o.decode);
  s.vocab = tok.vocab_size();
  if (o.decode) {
    const TokenStream ids = read_token_file(o.input, s.vocab);
    const std::string text = tok.decode(ids.tokens.to_vector());
    s.tokens = ids.size(), s.bytes = static_cast<int64_t>(text.size());
    write_text(o.out, text);
    return s;
  }
  if (o.out.empty()) return s;  // trained only
  const std::string text = checkpoint::read_regular_file(o.input, "text file");
  const std::vector<uint32_t> ids = tok.encode_document(text);
  write_token_file(o.out, std::span<const uint32_t>(ids));
  s.bytes = static_cast<int64_t>(text.size());
  s.tokens = static_cast<int64_t>(ids.size());
  const bool wide = std::any_of(ids.begin(), ids.end(), [](uint32_t t) { return t > 65535; });
  s.version = wide ? kTokenFileVersionU32 : kTokenFileVersion;
  return s;
}

}  // namespace t3d::runtime
