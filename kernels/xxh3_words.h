// XXH3's 64-bit hash (seed 0, the default secret) of a whole number of 32-bit words, written as
// plain __host__ __device__ arithmetic from the algorithm's specification (xxHash's
// doc/xxhash_spec.md), for the GPU: kernels::hash_floats hashes a GPU's pieces in device memory
// with it, and the CPU's with Debian's libxxhash (hash64_xxh3, kernels/hash.h), which it must
// equal bit for bit (tests/kernels/test_loss_optim.cpp compares them over every length path).
// Lengths are multiples of 4 bytes and the words 4-byte aligned (floats): every read of the input
// is at a multiple of 4, so 32-bit loads serve (XXH3's 1-3 byte path never arises).
#pragma once

#include <cstdint>

#include "kernels/row_math.h"  // T3D_HD, T3D_UNROLL

namespace t3d::kernels::xxh3 {

// The default secret (192 bytes), as the specification gives it. Passed by pointer: a CUDA
// kernel reads its own __constant__ copy, initialised from the same list.
#define T3D_XXH3_SECRET                                                                           \
  {                                                                                               \
    0xb8, 0xfe, 0x6c, 0x39, 0x23, 0xa4, 0x4b, 0xbe, 0x7c, 0x01, 0x81, 0x2c, 0xf7, 0x21, 0xad,     \
        0x1c, 0xde, 0xd4, 0x6d, 0xe9, 0x83, 0x90, 0x97, 0xdb, 0x72, 0x40, 0xa4, 0xa4, 0xb7, 0xb3, \
        0x67, 0x1f, 0xcb, 0x79, 0xe6, 0x4e, 0xcc, 0xc0, 0xe5, 0x78, 0x82, 0x5a, 0xd0, 0x7d, 0xcc, \
        0xff, 0x72, 0x21, 0xb8, 0x08, 0x46, 0x74, 0xf7, 0x43, 0x24, 0x8e, 0xe0, 0x35, 0x90, 0xe6, \
        0x81, 0x3a, 0x26, 0x4c, 0x3c, 0x28, 0x52, 0xbb, 0x91, 0xc3, 0x00, 0xcb, 0x88, 0xd0, 0x65, \
        0x8b, 0x1b, 0x53, 0x2e, 0xa3, 0x71, 0x64, 0x48, 0x97, 0xa2, 0x0d, 0xf9, 0x4e, 0x38, 0x19, \
        0xef, 0x46, 0xa9, 0xde, 0xac, 0xd8, 0xa8, 0xfa, 0x76, 0x3f, 0xe3, 0x9c, 0x34, 0x3f, 0xf9, \
        0xdc, 0xbb, 0xc7, 0xc7, 0x0b, 0x4f, 0x1d, 0x8a, 0x51, 0xe0, 0x4b, 0xcd, 0xb4, 0x59, 0x31, \
        0xc8, 0x9f, 0x7e, 0xc9, 0xd9, 0x78, 0x73, 0x64, 0xea, 0xc5, 0xac, 0x83, 0x34, 0xd3, 0xeb, \
        0xc3, 0xc5, 0x81, 0xa0, 0xff, 0xfa, 0x13, 0x63, 0xeb, 0x17, 0x0d, 0xdd, 0x51, 0xb7, 0xf0, \
        0xda, 0x49, 0xd3, 0x16, 0x55, 0x26, 0x29, 0xd4, 0x68, 0x9e, 0x2b, 0x16, 0xbe, 0x58, 0x7d, \
        0x47, 0xa1, 0xfc, 0x8f, 0xf8, 0xb8, 0xd1, 0x7a, 0xd0, 0x31, 0xce, 0x45, 0xcb, 0x3a, 0x8f, \
        0x95, 0x16, 0x04, 0x28, 0xaf, 0xd7, 0xfb, 0xca, 0xbb, 0x4b, 0x40, 0x7e                    \
  }
inline constexpr int kSecretBytes = 192;

inline constexpr std::uint64_t kP32_1 = 0x9E3779B1u, kP32_2 = 0x85EBCA77u, kP32_3 = 0xC2B2AE3Du;
inline constexpr std::uint64_t kP64_1 = 0x9E3779B185EBCA87ull, kP64_2 = 0xC2B2AE3D27D4EB4Full,
                               kP64_3 = 0x165667B19E3779F9ull, kP64_4 = 0x85EBCA77C2B2AE63ull,
                               kP64_5 = 0x27D4EB2F165667C5ull;

// A little-endian 64-bit word of the secret at any byte offset.
T3D_HD inline std::uint64_t secret64(const unsigned char* s, int at) {
  std::uint64_t v = 0;
  for (int i = 7; i >= 0; --i) v = (v << 8) | s[at + i];
  return v;
}
// The input's 64-bit word at byte offset `at` (a multiple of 4), little-endian.
T3D_HD inline std::uint64_t input64(const std::uint32_t* w, std::int64_t at) {
  return static_cast<std::uint64_t>(w[at / 4]) | static_cast<std::uint64_t>(w[at / 4 + 1]) << 32;
}
T3D_HD inline std::uint64_t rotl64(std::uint64_t x, int r) { return (x << r) | (x >> (64 - r)); }
T3D_HD inline std::uint64_t bswap64(std::uint64_t x) {
  std::uint64_t r = 0;
  for (int i = 0; i < 8; ++i) r = (r << 8) | ((x >> (8 * i)) & 0xFF);
  return r;
}
T3D_HD inline std::uint64_t mul128_fold64(std::uint64_t a, std::uint64_t b) {
#ifdef __CUDA_ARCH__
  return (a * b) ^ __umul64hi(a, b);
#else
  const unsigned __int128 p = static_cast<unsigned __int128>(a) * b;
  return static_cast<std::uint64_t>(p) ^ static_cast<std::uint64_t>(p >> 64);
#endif
}
T3D_HD inline std::uint64_t avalanche(std::uint64_t h) {
  h ^= h >> 37;
  h *= 0x165667919E3779F9ull;
  return h ^ (h >> 32);
}
T3D_HD inline std::uint64_t xxh64_avalanche(std::uint64_t h) {
  h ^= h >> 33;
  h *= kP64_2;
  h ^= h >> 29;
  h *= kP64_3;
  return h ^ (h >> 32);
}
T3D_HD inline std::uint64_t mix16(const std::uint32_t* w, std::int64_t at, const unsigned char* s,
                                  int sat) {
  return mul128_fold64(input64(w, at) ^ secret64(s, sat),
                       input64(w, at + 8) ^ secret64(s, sat + 8));
}

// 0 to 16 bytes (4, 8, 12 or 16 here).
T3D_HD inline std::uint64_t short_hash(const std::uint32_t* w, std::int64_t len,
                                       const unsigned char* s) {
  if (len > 8) {
    const std::uint64_t lo = input64(w, 0) ^ (secret64(s, 24) ^ secret64(s, 32));
    const std::uint64_t hi = input64(w, len - 8) ^ (secret64(s, 40) ^ secret64(s, 48));
    const std::uint64_t swapped = bswap64(lo);
    return avalanche(static_cast<std::uint64_t>(len) + swapped + hi + mul128_fold64(lo, hi));
  }
  if (len >= 4) {
    const std::uint64_t in1 = w[0], in2 = w[(len - 4) / 4];
    std::uint64_t h = (in2 + (in1 << 32)) ^ (secret64(s, 8) ^ secret64(s, 16));
    h ^= rotl64(h, 49) ^ rotl64(h, 24);
    h *= 0x9FB21C651E98DF25ull;
    h ^= (h >> 35) + static_cast<std::uint64_t>(len);
    h *= 0x9FB21C651E98DF25ull;
    return h ^ (h >> 28);
  }
  return xxh64_avalanche(secret64(s, 56) ^ secret64(s, 64));  // len == 0
}

// 17 to 240 bytes.
T3D_HD inline std::uint64_t mid_hash(const std::uint32_t* w, std::int64_t len,
                                     const unsigned char* s) {
  std::uint64_t acc = static_cast<std::uint64_t>(len) * kP64_1;
  if (len <= 128) {
    if (len > 32) {
      if (len > 64) {
        if (len > 96) acc += mix16(w, 48, s, 96) + mix16(w, len - 64, s, 112);
        acc += mix16(w, 32, s, 64) + mix16(w, len - 48, s, 80);
      }
      acc += mix16(w, 16, s, 32) + mix16(w, len - 32, s, 48);
    }
    acc += mix16(w, 0, s, 0) + mix16(w, len - 16, s, 16);
    return avalanche(acc);
  }
  const int rounds = static_cast<int>(len / 16);
  for (int i = 0; i < 8; ++i) acc += mix16(w, 16 * i, s, 16 * i);
  acc = avalanche(acc);
  for (int i = 8; i < rounds; ++i) acc += mix16(w, 16 * i, s, 16 * (i - 8) + 3);
  acc += mix16(w, len - 16, s, 136 - 17);
  return avalanche(acc);
}

// The long path's eight accumulators are independent of each other: accumulator `lane` takes,
// from each 64-byte stripe, its own word's key product and its neighbour's (lane ^ 1) raw word,
// and is scrambled alone after each block. So eight threads may each run one over the whole input
// and merge_lanes finishes the hash (the GPU's hash_floats: eight lanes a piece). `key`: the
// secret's word for this lane and stripe.
T3D_HD inline void accumulate_stripe_lane(std::uint64_t& acc, int lane, const std::uint32_t* w,
                                          std::int64_t at, std::uint64_t key) {
  const std::uint64_t mixed = input64(w, at + 8 * lane) ^ key;
  acc += input64(w, at + 8 * (lane ^ 1));
  acc += (mixed & 0xFFFFFFFFu) * (mixed >> 32);
}

// More than 240 bytes, accumulator `lane` (0..7): blocks of 16 stripes (1 KiB), each followed by
// a scramble, then the last partial block and the last stripe.
T3D_HD inline std::uint64_t long_hash_lane(const std::uint32_t* w, std::int64_t len,
                                           const unsigned char* s, int lane) {
  // The initial accumulators, selected without indexing an array (which a GPU keeps in memory).
  std::uint64_t acc = lane == 0   ? kP32_3
                      : lane == 1 ? kP64_1
                      : lane == 2 ? kP64_2
                      : lane == 3 ? kP64_3
                      : lane == 4 ? kP64_4
                      : lane == 5 ? kP32_2
                      : lane == 6 ? kP64_5
                                  : kP32_1;
  constexpr int kStripes = (kSecretBytes - 64) / 8;
  constexpr std::int64_t kBlock = 64 * kStripes;
  // The lane's secret words, read once (loops over a block's stripes unrolled on the GPU keep
  // them in registers). Stripe i's secret starts at byte 8 i.
  std::uint64_t keys[kStripes];
  T3D_UNROLL
  for (int i = 0; i < kStripes; ++i) keys[i] = secret64(s, 8 * i + 8 * lane);
  const std::uint64_t scramble_key = secret64(s, kSecretBytes - 64 + 8 * lane);
  const std::uint64_t last_key = secret64(s, kSecretBytes - 64 - 7 + 8 * lane);
  const std::int64_t blocks = (len - 1) / kBlock;
  for (std::int64_t b = 0; b < blocks; ++b) {
    T3D_UNROLL
    for (int i = 0; i < kStripes; ++i)
      accumulate_stripe_lane(acc, lane, w, b * kBlock + 64 * i, keys[i]);
    acc = (acc ^ (acc >> 47) ^ scramble_key) * kP32_1;
  }
  const int last = static_cast<int>(((len - 1) - kBlock * blocks) / 64);
  T3D_UNROLL
  for (int i = 0; i < kStripes; ++i)  // the first `last` stripes of the partial block
    if (i < last) accumulate_stripe_lane(acc, lane, w, blocks * kBlock + 64 * i, keys[i]);
  accumulate_stripe_lane(acc, lane, w, len - 64, last_key);
  return acc;
}

// The long path's hash from its eight accumulators.
T3D_HD inline std::uint64_t merge_lanes(const std::uint64_t* acc, std::int64_t len,
                                        const unsigned char* s) {
  std::uint64_t h = static_cast<std::uint64_t>(len) * kP64_1;
  for (int i = 0; i < 4; ++i)
    h += mul128_fold64(acc[2 * i] ^ secret64(s, 11 + 16 * i),
                       acc[2 * i + 1] ^ secret64(s, 19 + 16 * i));
  return avalanche(h);
}

// More than 240 bytes, the eight lanes in turn.
T3D_HD inline std::uint64_t long_hash(const std::uint32_t* w, std::int64_t len,
                                      const unsigned char* s) {
  std::uint64_t acc[8];
  for (int lane = 0; lane < 8; ++lane) acc[lane] = long_hash_lane(w, len, s, lane);
  return merge_lanes(acc, len, s);
}

// The number of bytes above which XXH3 takes the long path (long_hash).
inline constexpr std::int64_t kLongBytes = 240;

// XXH3_64bits of the 4·n bytes at `w` (seed 0, secret `s`: T3D_XXH3_SECRET).
T3D_HD inline std::uint64_t hash_words(const std::uint32_t* w, std::int64_t n,
                                       const unsigned char* s) {
  const std::int64_t len = 4 * n;
  if (len <= 16) return short_hash(w, len, s);
  if (len <= kLongBytes) return mid_hash(w, len, s);
  return long_hash(w, len, s);
}

}  // namespace t3d::kernels::xxh3
