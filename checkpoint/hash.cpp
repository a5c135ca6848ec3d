#include "checkpoint/hash.h"

#include <algorithm>
#include <cstring>
#include <vector>

#include "checkpoint/paths.h"

namespace t3d::checkpoint {

namespace {

constexpr uint64_t kP1 = 0x9E3779B185EBCA87ull, kP2 = 0xC2B2AE3D27D4EB4Full,
                   kP3 = 0x165667B19E3779F9ull, kP4 = 0x85EBCA77C2B2AE63ull,
                   kP5 = 0x27D4EB2F165667C5ull;

inline uint64_t rotl(uint64_t x, int r) { return (x << r) | (x >> (64 - r)); }
inline uint64_t load64(const unsigned char* p) {
  uint64_t v;
  std::memcpy(&v, p, 8);
  return v;
}
inline uint64_t round(uint64_t acc, uint64_t in) { return rotl(acc + in * kP2, 31) * kP1; }
inline uint64_t merge(uint64_t acc, uint64_t lane) { return (acc ^ round(0, lane)) * kP1 + kP4; }

}  // namespace

uint64_t hash64(const void* data, size_t bytes, uint64_t seed) {
  const auto* p = static_cast<const unsigned char*>(data);
  const unsigned char* end = p + bytes;
  uint64_t h;
  if (bytes >= 32) {
    uint64_t v1 = seed + kP1 + kP2, v2 = seed + kP2, v3 = seed, v4 = seed - kP1;
    for (; p + 32 <= end; p += 32) {
      v1 = round(v1, load64(p));
      v2 = round(v2, load64(p + 8));
      v3 = round(v3, load64(p + 16));
      v4 = round(v4, load64(p + 24));
    }
    h = rotl(v1, 1) + rotl(v2, 7) + rotl(v3, 12) + rotl(v4, 18);
    h = merge(merge(merge(merge(h, v1), v2), v3), v4);
  } else {
    h = seed + kP5;
  }
  h += bytes;
  for (; p + 8 <= end; p += 8) h = rotl(h ^ round(0, load64(p)), 27) * kP1 + kP4;
  for (; p < end; ++p) h = rotl(h ^ (*p * kP5), 11) * kP1;
  h ^= h >> 33, h *= kP2, h ^= h >> 29, h *= kP3, h ^= h >> 32;
  return h;
}

FileDigest digest_file(const std::string& path) {
  return digest_file(ReadOnlyFile::open(path, "snapshot file"));
}

FileDigest digest_file(const ReadOnlyFile& file) {
  // Hash of per-block hashes: streaming without keeping the file in memory.
  constexpr size_t kBlock = 4 << 20;
  std::vector<unsigned char> buf(kBlock);
  FileDigest d;
  uint64_t h = 0;
  for (uint64_t at = 0;; at += kBlock) {
    // Blocks at fixed offsets: the digest does not depend on how the kernel splits reads.
    if (at >= file.size()) break;
    const size_t n = static_cast<size_t>(std::min<uint64_t>(kBlock, file.size() - at));
    file.read_at(at, buf.data(), n);
    d.bytes += n;
    const uint64_t block = hash64(buf.data(), n, d.bytes);
    h = hash64(&block, sizeof(block), h);
  }
  d.hash = h;
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
