#include "checkpoint/safetensors.h"

#include <bit>
#include <cstdio>
#include <cstring>
#include <filesystem>
#include <fstream>
#include <nlohmann/json.hpp>

#include "checkpoint/paths.h"
#include "kernels/check.h"
#include "kernels/precision.h"

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
                           const std::map<std::string, std::string>& metadata, StDtype dtype) {
  const bool bf16 = dtype == StDtype::kBF16;
  const uint64_t width = bf16 ? 2 : 4;
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
    header += bf16 ? ":{\"dtype\":\"BF16\",\"shape\":[" : ":{\"dtype\":\"F32\",\"shape\":[";
    header += shape;
    header += "],\"data_offsets\":[";
    header += std::to_string(offset);
    header += ',';
    header += std::to_string(offset + width * n);
    header += "]}";
    offset += width * n;
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
      if (!bf16) {
        out.write(reinterpret_cast<const char*>(t.data),
                  static_cast<std::streamsize>(count * sizeof(float)));
        continue;
      }
      std::vector<kernels::bf16> half(static_cast<size_t>(count));
      kernels::float_to_bf16(half.data(), t.data, count);
      out.write(reinterpret_cast<const char*>(half.data()),
                static_cast<std::streamsize>(count * sizeof(kernels::bf16)));
    }
    out.flush();
    T3D_USER_CHECK(out.good(), "writing `", tmp, "` failed (disk full?)");
  }
  std::error_code ec;
  std::filesystem::rename(tmp, path, ec);
  T3D_USER_CHECK(!ec, "cannot rename `", tmp, "` to `", path, "`: ", ec.message());
  return sizeof(uint64_t) + header.size() + offset;
}

namespace {

// IEEE binary16 to binary32, exact (subnormals normalised, infinities and NaNs kept).
float f16_to_float(uint16_t h) {
  const uint32_t sign = static_cast<uint32_t>(h & 0x8000u) << 16;
  uint32_t exp = (h >> 10) & 0x1Fu, mant = h & 0x3FFu, bits;
  if (exp == 0x1F) {
    bits = sign | 0x7F800000u | (mant << 13);
  } else if (exp != 0) {
    bits = sign | ((exp + 112) << 23) | (mant << 13);
  } else if (mant == 0) {
    bits = sign;
  } else {  // subnormal: shift the leading 1 into the implicit bit
    int e = -1;
    do {
      mant <<= 1;
      ++e;
    } while (!(mant & 0x400u));
    bits = sign | (static_cast<uint32_t>(112 - e) << 23) | ((mant & 0x3FFu) << 13);
  }
  float f;
  std::memcpy(&f, &bits, sizeof f);
  return f;
}

uint64_t dtype_width(const std::string& dtype) {
  if (dtype == "F32") return 4;
  if (dtype == "BF16" || dtype == "F16") return 2;
  return 0;  // unsupported: read_f32 refuses it by name
}

}  // namespace

SafetensorsFile::SafetensorsFile(const std::string& path) : path_(path) {
  require_regular_file(path, "safetensors file");
  std::ifstream in(path, std::ios::binary);
  T3D_USER_CHECK(in.good(), "cannot open safetensors file `", path, "`");
  std::error_code ec;
  const uint64_t size = std::filesystem::file_size(path, ec);
  T3D_USER_CHECK(!ec, "cannot read safetensors file `", path, "`: ", ec.message());
  uint64_t n = 0;
  in.read(reinterpret_cast<char*>(&n), sizeof n);
  T3D_USER_CHECK(in.good() && n + 8 <= size && n < (uint64_t{1} << 30), "`", path,
                 "` is not a safetensors file (its header length ", n, " does not fit its ", size,
                 " bytes)");
  std::string text(n, '\0');
  in.read(text.data(), static_cast<std::streamsize>(n));
  data_start_ = 8 + n;
  nlohmann::json header;
  try {
    header = nlohmann::json::parse(text);
  } catch (const std::exception& e) {
    throw UserError(detail::concat("`", path, "`: the safetensors header is not JSON: ", e.what()));
  }
  T3D_USER_CHECK(header.is_object(), "`", path, "`: the safetensors header is not an object");
  for (const auto& [name, v] : header.items()) {
    if (name == "__metadata__") continue;
    try {
      StEntry e{v.at("dtype").get<std::string>(), v.at("shape").get<std::vector<int64_t>>(),
                v.at("data_offsets").at(0).get<uint64_t>(),
                v.at("data_offsets").at(1).get<uint64_t>()};
      uint64_t elems = 1;
      for (const int64_t d : e.shape) elems *= static_cast<uint64_t>(d);
      const uint64_t width = dtype_width(e.dtype);
      T3D_USER_CHECK(e.begin <= e.end && data_start_ + e.end <= size &&
                         (width == 0 || e.end - e.begin == width * elems),
                     "`", path, "`: tensor `", name, "` has data offsets [", e.begin, ", ", e.end,
                     ") that do not match its dtype and shape or the file's size (", size,
                     " bytes); the file is truncated or damaged");
      entries_.emplace(name, std::move(e));
    } catch (const nlohmann::json::exception& ex) {
      throw UserError(detail::concat("`", path, "`: tensor `", name,
                                     "` has a malformed header entry: ", ex.what()));
    }
  }
}

std::vector<float> SafetensorsFile::read_f32(const std::string& name) const {
  const auto it = entries_.find(name);
  T3D_USER_CHECK(it != entries_.end(), "`", path_, "` has no tensor `", name, "`");
  const StEntry& e = it->second;
  const uint64_t width = dtype_width(e.dtype);
  T3D_USER_CHECK(width != 0, "`", path_, "`: tensor `", name, "` is ", e.dtype,
                 "; titan3d imports F32, BF16 and F16 tensors");
  std::string raw(e.end - e.begin, '\0');
  std::ifstream in(path_, std::ios::binary);
  in.seekg(static_cast<std::streamoff>(data_start_ + e.begin));
  in.read(raw.data(), static_cast<std::streamsize>(raw.size()));
  T3D_USER_CHECK(in.good(), "short read of tensor `", name, "` from `", path_, "`");
  std::vector<float> out((e.end - e.begin) / width);
  if (e.dtype == "F32") {
    std::memcpy(out.data(), raw.data(), raw.size());
  } else {
    std::vector<uint16_t> half(out.size());
    std::memcpy(half.data(), raw.data(), raw.size());
    for (size_t i = 0; i < out.size(); ++i)
      out[i] = e.dtype == "BF16" ? kernels::bf16_to_float(half[i]) : f16_to_float(half[i]);
  }
  return out;
}

}  // namespace t3d::checkpoint
