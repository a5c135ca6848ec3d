// Small, fast, non-cryptographic hashes for counters and names: the deterministic initialisation,
// the data sampler and checksums all draw from these, so "the same seed" means the same bits.
#pragma once

#include <cstddef>
#include <cstdint>
#include <string_view>

namespace t3d::kernels {

// splitmix64's finaliser: a bijection of 64-bit words with good avalanche.
inline uint64_t splitmix64(uint64_t x) {
  x += 0x9E3779B97F4A7C15ull;
  x = (x ^ (x >> 30)) * 0xBF58476D1CE4E5B9ull;
  x = (x ^ (x >> 27)) * 0x94D049BB133111EBull;
  return x ^ (x >> 31);
}

// FNV-1a over the bytes of a string (e.g. a parameter name).
inline uint64_t fnv1a64(std::string_view s) {
  uint64_t h = 1469598103934665603ull;
  for (unsigned char c : s) h = (h ^ c) * 1099511628211ull;
  return h;
}

// 64-bit hash, four independent multiply-rotate lanes over 32-byte blocks (the xxHash64 round
// structure), several GB/s per core: hashing never dominates a snapshot. Not cryptographic: it
// detects damage, not tampering.
std::uint64_t hash64(const void* data, std::size_t bytes, std::uint64_t seed = 0);

// hash64 of bytes handed over in pieces: after update() with pieces whose concatenation is X,
// value() == hash64(X, seed). hash64 itself is this over one piece.
class Hash64Stream;

// XXH3's 64-bit hash (Debian's libxxhash, compiled in from its header: no library at run time),
// for memory compared within one run (the replay's checks, kernels::hash_floats): 16.5 GB/s on
// one core of a Xeon family 6 model 167 in its SSE2 build, 26 GB/s (memory speed) in the AVX2
// build it takes where the CPU has AVX2 (hash_avx2.cpp; the same value either way), against
// hash64's 6. Never stored in a file: hash64 is the
// snapshots' checksum, and stays so that older snapshots still verify.
std::uint64_t hash64_xxh3(const void* data, std::size_t bytes);
// Its two builds (call the AVX2 one only where the CPU has AVX2); hash64_xxh3 picks one.
std::uint64_t hash64_xxh3_baseline(const void* data, std::size_t bytes);
std::uint64_t hash64_xxh3_avx2(const void* data, std::size_t bytes);

class Hash64Stream {
 public:
  explicit Hash64Stream(std::uint64_t seed = 0);
  void update(const void* data, std::size_t bytes);
  std::uint64_t value() const;

 private:
  std::uint64_t v_[4];
  std::uint64_t seed_, total_ = 0;
  unsigned char buf_[32];  // the last partial 32-byte stripe
  std::size_t held_ = 0;
};

}  // namespace t3d::kernels
