// Small, fast, non-cryptographic hashes for counters and names: the deterministic initialisation,
// the data sampler and checksums all draw from these, so "the same seed" means the same bits.
#pragma once

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

}  // namespace t3d::kernels
