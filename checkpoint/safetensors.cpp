#include "checkpoint/safetensors.h"

#include <algorithm>
#include <bit>
#include <climits>
#include <cstdio>
#include <cstring>
#include <filesystem>
#include <fstream>
#include <set>

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

  AtomicFile out(path, "--out");
  const uint64_t n = header.size();
  out.write(&n, sizeof(n));
  out.write(header.data(), header.size());
  for (const auto& t : tensors) {
    int64_t count = 1;
    for (const int64_t d : t.shape) count *= d;
    if (!bf16) {
      out.write(t.data, static_cast<size_t>(count) * sizeof(float));
      continue;
    }
    std::vector<kernels::bf16> half(static_cast<size_t>(count));
    kernels::float_to_bf16(half.data(), t.data, count);
    out.write(half.data(), half.size() * sizeof(kernels::bf16));
  }
  out.commit();
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

// Bytes per element of the safetensors dtypes; 0 for a name the format does not define.
uint64_t dtype_width(const std::string& dtype) {
  static const std::map<std::string, uint64_t> widths = {
      {"BOOL", 1}, {"U8", 1},  {"I8", 1},  {"F8_E5M2", 1}, {"F8_E4M3", 1},
      {"I16", 2},  {"U16", 2}, {"F16", 2}, {"BF16", 2},    {"I32", 4},
      {"U32", 4},  {"F32", 4}, {"F64", 8}, {"I64", 8},     {"U64", 8}};
  const auto it = widths.find(dtype);
  return it == widths.end() ? 0 : it->second;
}

}  // namespace

nlohmann::json parse_json_text(const std::string& text, const std::string& source) {
  using json = nlohmann::json;
  std::vector<std::set<std::string>> keys;  // one per open object or array (whose stays empty)
  const json::parser_callback_t check = [&](int depth, json::parse_event_t event, json& parsed) {
    using E = json::parse_event_t;
    if (event == E::object_start || event == E::array_start) {
      T3D_USER_CHECK(depth < kMaxJsonDepth, source, ": JSON nested deeper than ", kMaxJsonDepth,
                     " levels; no file titan3d reads needs that. The file is damaged or hostile.");
      keys.emplace_back();
    } else if (event == E::object_end || event == E::array_end) {
      keys.pop_back();
    } else if (event == E::key) {
      T3D_USER_CHECK(keys.back().insert(parsed.get<std::string>()).second, source, ": key `",
                     parsed.get<std::string>(),
                     "` appears twice in one object; which value is meant is ambiguous. Keep one.");
    }
    return true;
  };
  try {
    return json::parse(text, check);
  } catch (const json::exception& e) {
    throw UserError(detail::concat(source, " is not JSON: ", e.what()));
  }
}

SafetensorsFile::SafetensorsFile(const std::string& path)
    : SafetensorsFile(ReadOnlyFile::open(path, "safetensors file")) {}

SafetensorsFile::SafetensorsFile(ReadOnlyFile file) : file_(std::move(file)) {
  const std::string& path = file_.path();
  const uint64_t size = file_.size();
  uint64_t n = 0;
  if (size >= sizeof n) file_.read_at(0, &n, sizeof n);
  T3D_USER_CHECK(size >= sizeof n && n + 8 <= size && n < (uint64_t{1} << 30), "`", path,
                 "` is not a safetensors file (its header length ", n, " does not fit its ", size,
                 " bytes)");
  std::string text(n, '\0');
  file_.read_at(8, text.data(), n);
  data_start_ = 8 + n;
  const nlohmann::json header = parse_json_text(text, "`" + path + "`: the safetensors header");
  T3D_USER_CHECK(header.is_object(), "`", path, "`: the safetensors header is not an object");
  const auto bad = [&](const std::string& name, const std::string& what) {
    return UserError(detail::concat("`", path, "`: tensor `", name, "` ", what,
                                    "; the file is truncated or damaged (or not written by a "
                                    "safetensors writer)"));
  };
  // Every tensor's bytes [begin, end), sorted below to check they tile the data section.
  std::vector<std::pair<std::pair<uint64_t, uint64_t>, std::string>> spans;
  for (const auto& [name, v] : header.items()) {
    if (name == "__metadata__") continue;
    const auto is_uints = [](const nlohmann::json& a) {
      return a.is_array() && std::all_of(a.begin(), a.end(), [](const nlohmann::json& x) {
               return x.is_number_unsigned();
             });
    };
    if (!v.is_object() || !v.contains("dtype") || !v.at("dtype").is_string() ||
        !v.contains("shape") || !is_uints(v.at("shape")) || !v.contains("data_offsets") ||
        !is_uints(v.at("data_offsets")) || v.at("data_offsets").size() != 2)
      throw bad(name, "has a malformed header entry " + v.dump() +
                          " (it needs a dtype string, a shape and two data_offsets, all "
                          "non-negative integers)");
    StEntry e{v.at("dtype").get<std::string>(),
              {},
              v.at("data_offsets").at(0).get<uint64_t>(),
              v.at("data_offsets").at(1).get<uint64_t>()};
    const uint64_t width = dtype_width(e.dtype);
    if (width == 0)
      throw bad(name, "has dtype `" + e.dtype + "`, which safetensors does not define");
    uint64_t bytes = width;
    for (const auto& d : v.at("shape")) {
      const uint64_t extent = d.get<uint64_t>();
      if (extent > static_cast<uint64_t>(INT64_MAX) ||
          __builtin_mul_overflow(bytes, extent, &bytes))
        throw bad(name, "has a shape of more than 2^64 bytes, " + v.at("shape").dump());
      e.shape.push_back(static_cast<int64_t>(extent));
    }
    if (e.begin > e.end || e.end > size - data_start_ || e.end - e.begin != bytes)
      throw bad(name, detail::concat("has data offsets [", e.begin, ", ", e.end,
                                     ") that do not match its dtype and shape (", bytes,
                                     " bytes) or the file's size (", size, " bytes)"));
    spans.push_back({{e.begin, e.end}, name});
    entries_.emplace(name, std::move(e));
  }
  // The format: the tensors' bytes cover the data section exactly, each byte once.
  std::sort(spans.begin(), spans.end());
  uint64_t covered = 0;
  for (size_t i = 0; i < spans.size(); ++i) {
    const auto& [span, name] = spans[i];
    if (span.first < covered)
      throw bad(name, detail::concat("has bytes [", span.first, ", ", span.second,
                                     ") that overlap those of tensor `", spans[i - 1].second, "`"));
    if (span.first > covered)
      throw bad(name,
                detail::concat("starts at byte ", span.first, " but the tensors before it end at ",
                               covered, ": a hole in the data section"));
    covered = span.second;
  }
  T3D_USER_CHECK(covered == size - data_start_, "`", path, "`: the tensors cover ", covered,
                 " bytes of its ", size - data_start_,
                 "-byte data section; the rest is indexed by no tensor (the format allows no "
                 "hole). The file is damaged or not written by a safetensors writer.");
}

std::vector<float> SafetensorsFile::read_f32(const std::string& name) const {
  const auto it = entries_.find(name);
  T3D_USER_CHECK(it != entries_.end(), "`", path(), "` has no tensor `", name, "`");
  const StEntry& e = it->second;
  T3D_USER_CHECK(e.dtype == "F32" || e.dtype == "BF16" || e.dtype == "F16", "`", path(),
                 "`: tensor `", name, "` is ", e.dtype,
                 "; titan3d imports F32, BF16 and F16 tensors");
  const uint64_t width = dtype_width(e.dtype);
  std::string raw(e.end - e.begin, '\0');
  file_.read_at(data_start_ + e.begin, raw.data(), raw.size());
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
