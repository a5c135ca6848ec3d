#include "checkpoint/safetensors.h"

#include <bit>
#include <cstdio>
#include <filesystem>
#include <fstream>

#include "kernels/check.h"

namespace t3d::checkpoint {

static_assert(std::endian::native == std::endian::little,
              "safetensors data is little-endian; this writer copies memory as is");

std::string json_quote(const std::string& s) {
  std::string out = "\"";
  for (const unsigned char c : s) {
    if (c == '"' || c == '\\') {
      out += '\\';
      out += static_cast<char>(c);
    } else if (c < 0x20) {
      char buf[8];
      std::snprintf(buf, sizeof(buf), "\\u%04x", c);
      out += buf;
    } else {
      out += static_cast<char>(c);
    }
  }
  return out + "\"";
}

uint64_t write_safetensors(const std::string& path, const std::vector<TensorRef>& tensors,
                           const std::map<std::string, std::string>& metadata) {
  std::string header = "{\"__metadata__\":{";
  bool first = true;
  for (const auto& [key, value] : metadata) {
    if (!first) header += ',';
    header += json_quote(key);
    header += ':';
    header += json_quote(value);
    first = false;
  }
  header += "}";
  uint64_t offset = 0;
  for (const auto& t : tensors) {
    T3D_ASSERT(t.data, "tensor ", t.name, " has no data");
    uint64_t n = 1;
    std::string shape;
    for (const int64_t d : t.shape) {
      n *= static_cast<uint64_t>(d);
      if (!shape.empty()) shape += ',';
      shape += std::to_string(d);
    }
    header += ',';
    header += json_quote(t.name);
    header += ":{\"dtype\":\"F32\",\"shape\":[";
    header += shape;
    header += "],\"data_offsets\":[";
    header += std::to_string(offset);
    header += ',';
    header += std::to_string(offset + 4 * n);
    header += "]}";
    offset += 4 * n;
  }
  header += "}";
  // Spaces are JSON whitespace: padding keeps every tensor 8-byte aligned for memory mapping.
  header.append((8 - header.size() % 8) % 8, ' ');

  const std::string tmp = path + ".tmp";
  {
    std::ofstream out(tmp, std::ios::binary | std::ios::trunc);
    T3D_USER_CHECK(out.good(), "cannot create `", tmp,
                   "`; check that the directory is writable (--out)");
    const uint64_t n = header.size();
    out.write(reinterpret_cast<const char*>(&n), sizeof(n));
    out.write(header.data(), static_cast<std::streamsize>(header.size()));
    for (const auto& t : tensors) {
      int64_t count = 1;
      for (const int64_t d : t.shape) count *= d;
      out.write(reinterpret_cast<const char*>(t.data),
                static_cast<std::streamsize>(count * sizeof(float)));
    }
    out.flush();
    T3D_USER_CHECK(out.good(), "writing `", tmp, "` failed (disk full?)");
  }
  std::error_code ec;
  std::filesystem::rename(tmp, path, ec);
  T3D_USER_CHECK(!ec, "cannot rename `", tmp, "` to `", path, "`: ", ec.message());
  return sizeof(uint64_t) + header.size() + offset;
}

}  // namespace t3d::checkpoint
