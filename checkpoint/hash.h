// Content hashes for snapshot integrity: per chunk of every tensor, and per whole file.
#pragma once

#include <cstddef>
#include <cstdint>
#include <string>

namespace t3d::checkpoint {

// 64-bit hash, four independent multiply-rotate lanes over 32-byte blocks (the xxHash64 round
// structure), several GB/s per core: hashing never dominates a snapshot. Not cryptographic: it
// detects damage, not tampering.
uint64_t hash64(const void* data, size_t bytes, uint64_t seed = 0);

// Size and hash64 of a whole file, streamed. UserError naming the file if it cannot be read.
struct FileDigest {
  uint64_t bytes = 0;
  uint64_t hash = 0;
};
FileDigest digest_file(const std::string& path);
class ReadOnlyFile;
FileDigest digest_file(const ReadOnlyFile& file);  // the descriptor's file, from its start

// out = a XOR b on the fp32 bit patterns: the incremental snapshot's delta, lossless whatever the
// floats are (NaN, -0, denormals), and its own inverse. `out` may alias `a`.
void xor_floats(const float* a, const float* b, float* out, int64_t n);

// Lower-case hex, for messages and the index ("0x…" is not valid in every tool).
std::string to_hex(uint64_t v);

}  // namespace t3d::checkpoint
