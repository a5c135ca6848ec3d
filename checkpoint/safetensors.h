// The safetensors format (Hugging Face): the file other ecosystems load weights from.
//
//   u64 little-endian  N, the header's length in bytes
//   N bytes            JSON: {"__metadata__": {str: str}, "<name>": {"dtype": "F32",
//                       "shape": [..], "data_offsets": [begin, end]}, ...}, padded with spaces
//                       so the data starts 8-byte aligned
//   data               the tensors' raw little-endian bytes, back to back; offsets are relative
//                       to the start of this section
//
// Only fp32 is written: titan3d's master weights are fp32, and a consumer may cast.
#pragma once

#include <cstdint>
#include <map>
#include <string>
#include <vector>

namespace t3d::checkpoint {

struct TensorRef {
  std::string name;
  std::vector<int64_t> shape;
  const float* data = nullptr;  // prod(shape) floats, row-major
};

// Writes `tensors` in the order given to a temporary name, then renames it to `path` (a reader
// never sees half a file). Returns the bytes written. UserError when the file cannot be written.
uint64_t write_safetensors(const std::string& path, const std::vector<TensorRef>& tensors,
                           const std::map<std::string, std::string>& metadata);

// A JSON string literal of `s` (quotes included), escaped per RFC 8259.
std::string json_quote(const std::string& s);

}  // namespace t3d::checkpoint
