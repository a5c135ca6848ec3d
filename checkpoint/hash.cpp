#include "checkpoint/hash.h"

#include <algorithm>
#include <cstdio>
#include <cstring>
#include <memory>
#include <vector>

#include "checkpoint/paths.h"
#include "kernels/check.h"

namespace t3d::checkpoint {

namespace {

// A file's digest: hash64 of every kDigestBlock bytes, seeded with the bytes up to the block's
// end, chained in order.
constexpr size_t kDigestBlock = 4 << 20;
uint64_t chain(uint64_t h, uint64_t block) { return hash64(&block, sizeof(block), h); }

struct File {
  std::FILE* f;
  explicit File(const std::string& path) : f(std::fopen(path.c_str(), "rb")) {
    T3D_USER_CHECK(f, "cannot read snapshot file `", path, "`: ", std::strerror(errno));
  }
  ~File() { std::fclose(f); }
};

}  // namespace

FileDigest digest_file(const std::string& path) {
  return digest_file(ReadOnlyFile::open(path, "snapshot file"));
}

FileDigest digest_file(const ReadOnlyFile& file) {
  // Blocks at fixed offsets, streamed without keeping the file in memory.
  std::vector<unsigned char> buf(kDigestBlock);
  FileDigest d;
  for (uint64_t at = 0; at < file.size(); at += kDigestBlock) {
    const size_t n = static_cast<size_t>(std::min<uint64_t>(kDigestBlock, file.size() - at));
    file.read_at(at, buf.data(), n);
    d.bytes += n;
    d.hash = chain(d.hash, hash64(buf.data(), n, d.bytes));
  }
  return d;
}

FileDigestBuilder::Block& FileDigestBuilder::block(uint64_t k) {
  if (k >= state_.size()) state_.resize(k + 1, Block::kNone), hash_.resize(k + 1, 0);
  return state_[k];
}

void FileDigestBuilder::written(uint64_t offset, const void* data, size_t bytes) {
  const auto* p = static_cast<const unsigned char*>(data);
  for (uint64_t at = offset, end = offset + bytes; at < end;) {
    const uint64_t k = at / kDigestBlock, block_end = (k + 1) * kDigestBlock;
    const size_t len = static_cast<size_t>(std::min(end, block_end) - at);
    Block& b = block(k);
    if (b == Block::kNone && k != current_ && at == k * kDigestBlock) {
      current_ = k, next_ = at, stream_ = Hash64Stream(block_end);  // a block begins
    }
    if (b == Block::kNone && k == current_ && at == next_) {
      stream_.update(p + (at - offset), len);
      next_ += len;
      if (next_ == block_end) b = Block::kHashed, hash_[k] = stream_.value(), current_ = ~0ull;
    } else {
      b = Block::kStale;  // out of order, or written twice: read back
      if (k == current_) current_ = ~0ull;
    }
    at += len;
  }
}

void FileDigestBuilder::overwritten(uint64_t offset, size_t bytes) {
  if (!bytes) return;
  for (uint64_t k = offset / kDigestBlock; k <= (offset + bytes - 1) / kDigestBlock; ++k) {
    block(k) = Block::kStale;
    if (k == current_) current_ = ~0ull;
  }
}

FileDigest FileDigestBuilder::finish(const std::string& path, uint64_t* read_back) const {
  File f(path);
  T3D_USER_CHECK(std::fseek(f.f, 0, SEEK_END) == 0, "cannot read snapshot file `", path, "`");
  const long size = std::ftell(f.f);
  T3D_USER_CHECK(size >= 0, "cannot read snapshot file `", path, "`");
  FileDigest d;
  d.bytes = static_cast<uint64_t>(size);
  std::vector<unsigned char> buf;
  uint64_t read = 0;
  for (uint64_t k = 0; k * kDigestBlock < d.bytes; ++k) {
    const uint64_t end = std::min<uint64_t>(d.bytes, (k + 1) * kDigestBlock);
    if (k < state_.size() && state_[k] == Block::kHashed && end == (k + 1) * kDigestBlock) {
      d.hash = chain(d.hash, hash_[k]);
      continue;
    }
    const size_t n = static_cast<size_t>(end - k * kDigestBlock);
    buf.resize(n);
    T3D_USER_CHECK(std::fseek(f.f, static_cast<long>(k * kDigestBlock), SEEK_SET) == 0 &&
                       std::fread(buf.data(), 1, n, f.f) == n,
                   "error reading snapshot file `", path, "`");
    d.hash = chain(d.hash, hash64(buf.data(), n, end));
    read += n;
  }
  if (read_back) *read_back = read;
  return d;
}

std::string to_hex(uint64_t v) {
  char s[17];
  std::snprintf(s, sizeof(s), "%016llx", static_cast<unsigned long long>(v));
  return s;
}

void xor_floats(const float* a, const float* b, float* out, int64_t n) {
  for (int64_t i = 0; i < n; ++i) {
    uint32_t x, y;
    std::memcpy(&x, a + i, 4);
    std::memcpy(&y, b + i, 4);
    x ^= y;
    std::memcpy(out + i, &x, 4);
  }
}

}  // namespace t3d::checkpoint
