// hash64 and Hash64Stream (kernels/hash.h).
#include "kernels/hash.h"

#include <cstring>

#include "kernels/blas.h"  // detect_cpu_features

#define XXH_INLINE_ALL  // header only: the GPU bundle and the CPU binary need no libxxhash
#include <xxhash.h>

namespace t3d::kernels {

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

Hash64Stream::Hash64Stream(uint64_t seed)
    : v_{seed + kP1 + kP2, seed + kP2, seed, seed - kP1}, seed_(seed) {}

void Hash64Stream::update(const void* data, size_t bytes) {
  const auto* p = static_cast<const unsigned char*>(data);
  const unsigned char* end = p + bytes;
  total_ += bytes;
  const auto stripe = [this](const unsigned char* s) {
    v_[0] = round(v_[0], load64(s)), v_[1] = round(v_[1], load64(s + 8));
    v_[2] = round(v_[2], load64(s + 16)), v_[3] = round(v_[3], load64(s + 24));
  };
  if (held_) {
    const size_t take = std::min<size_t>(32 - held_, bytes);
    std::memcpy(buf_ + held_, p, take);
    held_ += take, p += take;
    if (held_ < 32) return;
    stripe(buf_), held_ = 0;
  }
  // Four independent lanes, kept in registers over the bulk of the bytes.
  uint64_t v1 = v_[0], v2 = v_[1], v3 = v_[2], v4 = v_[3];
  for (; p + 32 <= end; p += 32) {
    v1 = round(v1, load64(p));
    v2 = round(v2, load64(p + 8));
    v3 = round(v3, load64(p + 16));
    v4 = round(v4, load64(p + 24));
  }
  v_[0] = v1, v_[1] = v2, v_[2] = v3, v_[3] = v4;
  held_ = static_cast<size_t>(end - p);
  std::memcpy(buf_, p, held_);
}

uint64_t Hash64Stream::value() const {
  uint64_t h;
  if (total_ >= 32) {
    h = rotl(v_[0], 1) + rotl(v_[1], 7) + rotl(v_[2], 12) + rotl(v_[3], 18);
    h = merge(merge(merge(merge(h, v_[0]), v_[1]), v_[2]), v_[3]);
  } else {
    h = seed_ + kP5;
  }
  h += total_;
  const unsigned char *p = buf_, *end = buf_ + held_;
  for (; p + 8 <= end; p += 8) h = rotl(h ^ round(0, load64(p)), 27) * kP1 + kP4;
  for (; p < end; ++p) h = rotl(h ^ (*p * kP5), 11) * kP1;
  h ^= h >> 33, h *= kP2, h ^= h >> 29, h *= kP3, h ^= h >> 32;
  return h;
}

uint64_t hash64(const void* data, size_t bytes, uint64_t seed) {
  Hash64Stream s(seed);
  s.update(data, bytes);
  return s.value();
}

uint64_t hash64_xxh3_baseline(const void* data, size_t bytes) { return XXH3_64bits(data, bytes); }

uint64_t hash64_xxh3(const void* data, size_t bytes) {
  static const bool avx2 = detect_cpu_features().avx2;  // the same value either way: speed only
  return avx2 ? hash64_xxh3_avx2(data, bytes) : hash64_xxh3_baseline(data, bytes);
}

}  // namespace t3d::kernels
