#include "runtime/use/hf_rope.h"

#include <fmt/format.h>

#include <set>

#include "kernels/check.h"

namespace t3d::runtime {

using nlohmann::json;
using Kind = kernels::RopeScaling::Kind;

namespace {

const char* kind_name(Kind kind) {
  return kind == Kind::kLlama3 ? "llama3" : kind == Kind::kLinear ? "linear" : "default";
}

// `rope_scaling.KEY` of `s`, a number (an integer with `integer`); UserError naming it otherwise.
double number_at(const json& s, const std::string& src, Kind kind, const char* key,
                 bool integer = false) {
  T3D_USER_CHECK(s.contains(key), src, ": `rope_scaling.", key, "` is missing; rope_type \"",
                 kind_name(kind), "\" needs it (transformers' rope_scaling)");
  const json& v = s.at(key);
  T3D_USER_CHECK(integer ? v.is_number_integer() : v.is_number(), src, ": `rope_scaling.", key,
                 "` is ", v.dump(), "; it must be ", integer ? "an integer" : "a number");
  return v.get<double>();
}

// The kind `rope_type` and `type` name (transformers reads either; both must agree).
Kind scaling_kind(const json& s, const std::string& src) {
  std::string name;
  for (const char* key : {"rope_type", "type"}) {
    if (!s.contains(key)) continue;
    T3D_USER_CHECK(s.at(key).is_string(), src, ": `rope_scaling.", key, "` is ", s.at(key).dump(),
                   "; it must be a string such as \"llama3\"");
    const std::string v = s.at(key).get<std::string>();
    T3D_USER_CHECK(name.empty() || v == name, src, ": `rope_scaling.type` is \"", v,
                   "\" but `rope_scaling.rope_type` is \"", name, "\"; give one kind");
    name = v;
  }
  T3D_USER_CHECK(!name.empty(), src,
                 ": `rope_scaling` has no `rope_type` (or `type`); give \"linear\" or \"llama3\"");
  if (name == "default") return Kind::kNone;
  if (name == "linear") return Kind::kLinear;
  if (name == "llama3") return Kind::kLlama3;
  throw UserError(fmt::format(
      "{}: `rope_scaling` is {}; titan3d's RoPE scales as rope_type \"linear\" or \"llama3\" "
      "(model.rope_scaling) and cannot represent \"{}\". Import a model without it, or "
      "convert the model first.",
      src, s.dump(), name));
}

// A double as JSON that reads back as the same double (8 → 8.0: transformers wants a float).
std::string json_number(double x) {
  std::string s = fmt::format("{}", x);
  if (s.find_first_of(".eE") == std::string::npos) s += ".0";
  return s;
}

}  // namespace

void rope_scaling_from_config(const json& c, const std::string& src, ModelConfig& m) {
  if (c.contains("partial_rotary_factor") && !c.at("partial_rotary_factor").is_null())
    T3D_USER_CHECK(c.at("partial_rotary_factor") == 1, src, ": `partial_rotary_factor` is ",
                   c.at("partial_rotary_factor").dump(),
                   "; titan3d's RoPE rotates every dimension of a head (1 only)");
  if (!c.contains("rope_scaling") || c.at("rope_scaling").is_null()) return;
  const json& s = c.at("rope_scaling");
  T3D_USER_CHECK(s.is_object(), src, ": `rope_scaling` is ", s.dump(),
                 "; it must be null or an object with `rope_type`");
  const Kind kind = scaling_kind(s, src);
  std::set<std::string> known = {"rope_type", "type"};
  if (kind != Kind::kNone) {
    known.insert("factor");
    m.rope_factor = number_at(s, src, kind, "factor");
    T3D_USER_CHECK(m.rope_factor > 0, src, ": `rope_scaling.factor` is ", m.rope_factor,
                   "; it must be positive");
  }
  if (kind == Kind::kLlama3) {
    known.insert({"low_freq_factor", "high_freq_factor", "original_max_position_embeddings"});
    m.rope_low_freq_factor = number_at(s, src, kind, "low_freq_factor");
    m.rope_high_freq_factor = number_at(s, src, kind, "high_freq_factor");
    const double original = number_at(s, src, kind, "original_max_position_embeddings", true);
    T3D_USER_CHECK(m.rope_low_freq_factor > 0 && m.rope_high_freq_factor > m.rope_low_freq_factor,
                   src, ": `rope_scaling.high_freq_factor` ", m.rope_high_freq_factor,
                   " and `rope_scaling.low_freq_factor` ", m.rope_low_freq_factor,
                   " must satisfy 0 < low_freq_factor < high_freq_factor");
    T3D_USER_CHECK(original >= 1 && original <= double(int64_t{1} << 24), src,
                   ": `rope_scaling.original_max_position_embeddings` is ", original,
                   "; it must lie in [1, 2^24]");
    m.rope_original_seq_len = static_cast<int64_t>(original);
  }
  for (const auto& [key, value] : s.items())
    T3D_USER_CHECK(known.count(key), src, ": `rope_scaling.", key, "` is ", value.dump(),
                   "; rope_type \"", kind_name(kind), "\" has no such parameter (it reads ",
                   kind == Kind::kLlama3   ? "factor, low_freq_factor, high_freq_factor and "
                                             "original_max_position_embeddings"
                   : kind == Kind::kLinear ? "factor"
                                           : "none",
                   "). Import a model without it, or convert the model first.");
  m.rope_scaling = kind;
}

std::string rope_scaling_json(const ModelConfig& m) {
  switch (m.rope_scaling) {
    case Kind::kNone:
      return "null";
    case Kind::kLinear:
      return fmt::format("{{\"rope_type\": \"linear\", \"factor\": {}}}",
                         json_number(m.rope_factor));
    case Kind::kLlama3:
      break;
  }
  return fmt::format(
      "{{\"rope_type\": \"llama3\", \"factor\": {}, \"low_freq_factor\": {}, "
      "\"high_freq_factor\": {}, \"original_max_position_embeddings\": {}}}",
      json_number(m.rope_factor), json_number(m.rope_low_freq_factor),
      json_number(m.rope_high_freq_factor), m.rope_original_seq_len);
}

}  // namespace t3d::runtime
