// Content hashes for snapshot integrity: per chunk of every tensor, and per whole file.
#pragma once

#include <cstddef>
#include <cstdint>
#include <string>
#include <vector>

#include "kernels/hash.h"

namespace t3d::checkpoint {

// hash64 and Hash64Stream: kernels/hash.h (the replay hashes device memory through kernels ops).
using kernels::hash64;
using kernels::Hash64Stream;

// Size and hash64 of a whole file, streamed. UserError naming the file if it cannot be read.
struct FileDigest {
  uint64_t bytes = 0;
  uint64_t hash = 0;
};
FileDigest digest_file(const std::string& path);
class ReadOnlyFile;
FileDigest digest_file(const ReadOnlyFile& file);  // the descriptor's file, from its start

// digest_file's value for a file being written, from the bytes as they are written instead of
// reading the file again. written() hands over bytes going to the file at `offset` (in any
// order); overwritten() reports any other write. finish() then reads from the file only the
// digest blocks (4 MiB) that written() bytes did not cover whole and in order, or that a later
// write touched, and returns exactly what digest_file(path) would.
class FileDigestBuilder {
 public:
  void written(uint64_t offset, const void* data, size_t bytes);
  void overwritten(uint64_t offset, size_t bytes);
  // `read_back`: bytes read from the file for it (for measurements).
  FileDigest finish(const std::string& path, uint64_t* read_back = nullptr) const;

 private:
  enum class Block : unsigned char { kNone, kHashed, kStale };
  Block& block(uint64_t k);
  std::vector<Block> state_;
  std::vector<uint64_t> hash_;  // of the kHashed blocks
  uint64_t current_ = ~0ull;    // the block being hashed, if any
  uint64_t next_ = 0;           // its next offset
  Hash64Stream stream_;
};

// out = a XOR b on the fp32 bit patterns: the incremental snapshot's delta, lossless whatever the
// floats are (NaN, -0, denormals), and its own inverse. `out` may alias `a`.
void xor_floats(const float* a, const float* b, float* out, int64_t n);

// Lower-case hex, for messages and the index ("0x…" is not valid in every tool).
std::string to_hex(uint64_t v);

}  // namespace t3d::checkpoint
