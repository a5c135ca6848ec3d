// The safetensors format (Hugging Face): the file other ecosystems load weights from.
//
//   u64 little-endian  N, the header's length in bytes
//   N bytes            JSON: {"__metadata__": {str: str}, "<name>": {"dtype": "F32",
//                       "shape": [..], "data_offsets": [begin, end]}, ...}, padded with spaces
//                       so the data starts 8-byte aligned
//   data               the tensors' raw little-endian bytes, back to back; offsets are relative
//                       to the start of this section
//
// Written as fp32 (titan3d's master weights, the default) or bf16 (rounded to nearest even, half
// the size). Read (for `titan3d import`): F32, BF16 and F16 tensors, converted to fp32 exactly
// (every bf16 and fp16 value is an fp32 value).
#pragma once

#include <cstdint>
#include <map>
#include <nlohmann/json.hpp>
#include <string>
#include <vector>

#include "checkpoint/paths.h"

namespace t3d::checkpoint {

struct TensorRef {
  std::string name;
  std::vector<int64_t> shape;
  const float* data = nullptr;  // prod(shape) floats, row-major
};

enum class StDtype { kF32, kBF16 };

// Writes `tensors` in the order given, whole or not at all (AtomicFile: a reader never sees half
// a file, a failure leaves none). Returns the bytes written. UserError when it cannot be written.
uint64_t write_safetensors(const std::string& path, const std::vector<TensorRef>& tensors,
                           const std::map<std::string, std::string>& metadata,
                           StDtype dtype = StDtype::kF32);

// One tensor of a safetensors file as its header describes it.
struct StEntry {
  std::string dtype;  // "F32", "BF16", "F16", ...
  std::vector<int64_t> shape;
  uint64_t begin = 0, end = 0;  // byte offsets in the data section
};

// A safetensors file opened for reading: the header parsed and checked as the format requires
// (each name once, integer shapes and offsets, sizes matching dtype × shape, the tensors' bytes
// covering the data section exactly: no overlap, no hole, nothing past the end); tensors are read
// one at a time. UserError naming the file and the tensor.
class SafetensorsFile {
 public:
  explicit SafetensorsFile(const std::string& path);
  // Reads through `file`'s descriptor only (see ReadOnlyFile::open_inside).
  explicit SafetensorsFile(ReadOnlyFile file);
  const std::string& path() const { return file_.path(); }
  const std::map<std::string, StEntry>& entries() const { return entries_; }
  // The tensor as fp32 (F32 copied, BF16 and F16 widened exactly); UserError for another dtype.
  std::vector<float> read_f32(const std::string& name) const;

 private:
  ReadOnlyFile file_;
  uint64_t data_start_ = 0;
  std::map<std::string, StEntry> entries_;
};

// JSON text read from a file (`source` names it in messages), parsed with the limits hostile input
// needs: nesting deeper than kMaxJsonDepth (a stack overflow in recursive code after the parse) and
// a key twice in one object (one value silently hiding the other) are UserErrors, as is text
// that is not JSON.
inline constexpr int kMaxJsonDepth = 64;
nlohmann::json parse_json_text(const std::string& text, const std::string& source);

// A JSON string literal of `s` (quotes included), escaped per RFC 8259.
std::string json_quote(const std::string& s);

}  // namespace t3d::checkpoint
