// The recipe as text: TOML (nesting bounded), `--set` overrides, unknown keys with a did-you-mean,
// derived defaults, and writing a recipe back, all driven by the schema (recipe_schema.cpp);
// parse_recipe then validates (recipe_check.cpp).
#include "runtime/recipe/recipe.h"

#include <sys/stat.h>

#include <algorithm>
#include <cerrno>
#include <cstdio>
#include <cstring>
#include <fstream>
#include <map>
#include <set>
#include <sstream>

#include "kernels/check.h"
#include "runtime/data/data_sampler.h"
#include "runtime/recipe/recipe_detail.h"

namespace t3d::runtime {
namespace {

using recipe_detail::fail;
using recipe_detail::schema;
using recipe_detail::where;

// Where each key's value came from ("recipe.toml:12" or "--set parallel.tp=3"), for messages
// raised after parsing (combinations, world size).
using Origins = std::map<std::string, std::string>;

// toml11 parses nested arrays and inline tables by recursion (and frees them so too): a few
// thousand levels exhaust the stack. Recipes need two, so the text is scanned first and more than
// kMaxNesting levels of [ or { (outside strings and comments) are refused, naming the line. Dotted
// keys (a.b.c) nest tables the same way and are bounded alike.
constexpr int kMaxNesting = 32;

void check_nesting(const std::string& text, const std::string& name) {
  int depth = 0;
  size_t line = 1;
  const auto refuse = [&](const char* what) {
    throw UserError("recipe error: " + name +
                    (name.rfind("--set", 0) == 0 ? "" : ":" + std::to_string(line)) + ": " + what +
                    " nested more than " + std::to_string(kMaxNesting) +
                    " levels deep; a recipe needs at most 2");
  };
  int dots = 0;  // dots in the key being read on this line (before '=' or ']')
  bool in_key = true;
  std::string open;  // the brackets open here, innermost last
  for (size_t i = 0; i < text.size(); ++i) {
    const char c = text[i];
    if (c == '\n') {
      ++line, dots = 0, in_key = depth == 0;
      continue;
    }
    if (c == '#') {  // comment to the end of the line
      while (i + 1 < text.size() && text[i + 1] != '\n') ++i;
      continue;
    }
    if (c == '"' || c == '\'') {
      const bool multi = text.compare(i, 3, std::string(3, c)) == 0;
      const std::string close = multi ? std::string(3, c) : std::string(1, c);
      size_t j = i + close.size();
      for (; j < text.size(); ++j) {
        if (c == '"' && text[j] == '\\') {
          ++j;
          continue;
        }
        if (text[j] == '\n') {
          if (!multi) break;  // an unterminated string: toml11 reports it
          ++line;
        }
        if (text.compare(j, close.size(), close) == 0) break;
      }
      i = std::min(j + close.size() - 1, text.size());
      continue;
    }
    if (c == '[' || c == '{') {
      if (++depth > kMaxNesting) refuse("arrays or inline tables");
      open.push_back(c);
      if (c == '{') in_key = true;
    } else if (c == ']' || c == '}') {
      depth = std::max(0, depth - 1);
      if (!open.empty()) open.pop_back();
    } else if (c == '=' || c == ',') {
      in_key =
          c == ',' && !open.empty() && open.back() == '{';  // a key follows in { a = 1, b = 2 }
      dots = 0;
    } else if (c == '.' && in_key) {
      if (++dots > kMaxNesting) refuse("dotted keys");
    }
  }
}

toml::value parse_toml(std::istream& in, const std::string& name) {
  try {
    return toml::parse(in, name);
  } catch (const toml::syntax_error& e) {
    throw UserError(std::string("recipe error: not valid TOML:\n") + e.what());
  }
}

void apply_override(toml::value& root, const Override& o) {
  const auto dot = o.key.find('.');
  const std::string label = "--set " + o.key + "=" + o.value;
  T3D_USER_CHECK(dot != std::string::npos && dot > 0 && dot + 1 < o.key.size(),
                 "recipe error: ", label, ": the key must be section.key, e.g. parallel.tp");
  const std::string section = o.key.substr(0, dot), key = o.key.substr(dot + 1);
  // One line only: a value with a line break would smuggle in more TOML (or be cut at it).
  T3D_USER_CHECK(o.value.find_first_of("\n\r") == std::string::npos, "recipe error: --set ", o.key,
                 ": the value spans several lines; give it on one line");
  check_nesting(o.value, label);
  toml::value value;
  try {
    std::istringstream in("v = " + o.value);
    value = toml::parse(in, label).as_table().at("v");
  } catch (const std::exception&) {
    // Not a TOML literal: take it as a bare string (`--set run.dir=/tmp/x`).
    std::istringstream in("v = " + toml_string(o.value));
    value = toml::parse(in, label).as_table().at("v");
  }
  auto& table = root.as_table();
  if (!table.count(section)) table[section] = toml::table{};
  T3D_USER_CHECK(table[section].is_table(), "recipe error: ", label, ": `", section,
                 "` is not a table in the recipe");
  table[section].as_table()[key] = value;
}

}  // namespace

std::string toml_string(const std::string& s) {
  std::string out = "\"";
  for (const char ch : s) {
    const auto c = static_cast<unsigned char>(ch);
    switch (c) {
      case '"':
        out += "\\\"";
        break;
      case '\\':
        out += "\\\\";
        break;
      case '\b':
        out += "\\b";
        break;
      case '\t':
        out += "\\t";
        break;
      case '\n':
        out += "\\n";
        break;
      case '\f':
        out += "\\f";
        break;
      case '\r':
        out += "\\r";
        break;
      default:
        // TOML forbids raw control characters (and DEL) in a basic string.
        if (c < 0x20 || c == 0x7f) {
          char esc[8];
          std::snprintf(esc, sizeof(esc), "\\u%04X", c);
          out += esc;
        } else {
          out += ch;
        }
    }
  }
  return out + "\"";
}

Override parse_override(const std::string& text) {
  const auto eq = text.find('=');
  T3D_USER_CHECK(eq != std::string::npos && eq > 0, "--set ", text,
                 ": expected section.key=value, e.g. --set parallel.tp=2");
  return {text.substr(0, eq), text.substr(eq + 1)};
}

size_t edit_distance(const std::string& a, const std::string& b) {
  std::vector<size_t> prev(b.size() + 1), cur(b.size() + 1);
  for (size_t j = 0; j <= b.size(); ++j) prev[j] = j;
  for (size_t i = 1; i <= a.size(); ++i) {
    cur[0] = i;
    for (size_t j = 1; j <= b.size(); ++j)
      cur[j] = std::min({prev[j] + 1, cur[j - 1] + 1, prev[j - 1] + (a[i - 1] != b[j - 1])});
    std::swap(prev, cur);
  }
  return prev[b.size()];
}

std::string closest_key(const std::string& unknown) {
  std::string best;
  size_t best_d = std::string::npos;
  for (const auto& f : schema()) {
    const size_t d = edit_distance(unknown, f.full());
    if (d < best_d) best_d = d, best = f.full();
  }
  return best_d <= std::max<size_t>(2, unknown.size() / 3) ? best : "";
}

Recipe parse_recipe(const std::string& toml_text, const std::string& source_name,
                    const std::vector<Override>& overrides) {
  check_nesting(toml_text, source_name);
  std::istringstream in(toml_text);
  toml::value root = parse_toml(in, source_name);
  for (const auto& o : overrides) apply_override(root, o);

  Recipe r;
  r.source = source_name;
  Origins origins;
  std::set<std::string> known;
  for (const auto& f : schema()) known.insert(f.full());

  // Unknown sections and keys first: a typo must not silently leave a default in place.
  for (const auto& [section, body] : root.as_table()) {
    if (!body.is_table()) {
      const std::string hint = closest_key(section);
      fail(where(body), section,
           "top-level keys are not allowed; put it in a section such as [run]" +
               (hint.empty() ? "" : ". Did you mean `" + hint + "`?"));
    }
    for (const auto& [key, value] : body.as_table()) {
      const std::string full = section + "." + key;
      if (known.count(full)) continue;
      const std::string hint = closest_key(full);
      fail(where(value), full,
           "unknown key" + (hint.empty() ? std::string(". See docs/recipe.md for every key")
                                         : ". Did you mean `" + hint + "`?"));
    }
  }
  for (const auto& f : schema()) {
    const auto& table = root.as_table();
    auto s = table.find(f.section);
    if (s == table.end()) continue;
    auto k = s->second.as_table().find(f.key);
    if (k == s->second.as_table().end()) continue;
    f.read(r, k->second);
    origins[f.full()] = where(k->second);
  }
  // Derived defaults.
  if (r.model.n_kv_heads == 0) r.model.n_kv_heads = r.model.n_heads;
  if (r.model.ffn_dim == 0) r.model.ffn_dim = (8 * r.model.dim / 3 + 63) / 64 * 64;
  if (r.model.moe_ffn_dim == 0) r.model.moe_ffn_dim = r.model.ffn_dim;
  // zb_v runs two chunks per stage; an explicit value that says otherwise is refused below.
  if (r.parallel.schedule == parallel::ScheduleKind::kZBV &&
      !origins.count("parallel.virtual_stages"))
    r.parallel.virtual_stages = 2;
  if (r.run.dir.empty()) r.run.dir = "runs/" + r.run.name;
  if (r.snapshot.dir.empty()) r.snapshot.dir = r.run.dir + "/snapshots";
  r.key_origins = std::move(origins);
  recipe_detail::validate(r);
  return r;
}

Recipe load_recipe(const std::string& path, const std::vector<Override>& overrides) {
  // A directory opens as an empty stream on Linux: it must not read as an empty recipe.
  struct stat st {};
  T3D_USER_CHECK(stat(path.c_str(), &st) == 0, "recipe error: cannot open recipe file `", path,
                 "`: ", std::strerror(errno),
                 " (check the path; it is relative to the current directory)");
  T3D_USER_CHECK(!S_ISDIR(st.st_mode), "recipe error: `", path,
                 "` is a directory, not a recipe file; give a .toml file such as ", path,
                 "/default.toml");
  std::ifstream in(path);
  T3D_USER_CHECK(in.good(), "recipe error: cannot read recipe file `", path,
                 "`: ", std::strerror(errno), " (check its permissions)");
  std::stringstream text;
  text << in.rdbuf();
  T3D_USER_CHECK(!in.bad(), "recipe error: cannot read recipe file `", path,
                 "`: ", std::strerror(errno));
  return parse_recipe(text.str(), path, overrides);
}

std::string Recipe::origin(const std::string& key) const {
  auto it = key_origins.find(key);
  return it != key_origins.end() ? it->second : source + " (default value)";
}

int64_t Recipe::micro_batch_rows() const {
  return rows_per_micro(train.global_batch, static_cast<int>(std::max<int64_t>(parallel.dp, 1)),
                        static_cast<int>(train.micro_batches));
}

int64_t Recipe::world_size() const {
  return parallel.pp * std::max<int64_t>(parallel.dp, 1) * parallel.cp * parallel.tp;
}

std::string Recipe::to_toml() const {
  // A value the parser derives from other keys is written as left out when it equals what they
  // derive, so a recipe read back (a snapshot's, restart.toml) derives it again from what an
  // override changes: `--set run.dir=B` on a resume moves the snapshots to B/snapshots too.
  Recipe stored = *this;
  if (stored.snapshot.dir == stored.run.dir + "/snapshots") stored.snapshot.dir.clear();
  if (stored.run.dir == "runs/" + stored.run.name) stored.run.dir.clear();
  const int64_t derived_virtual_stages = parallel.schedule == parallel::ScheduleKind::kZBV ? 2 : 1;
  std::string out, section;
  for (const auto& f : schema()) {
    if (f.section != section) {
      out += (section.empty() ? "[" : "\n[") + f.section + "]\n";
      section = f.section;
    }
    if (f.full() == "parallel.virtual_stages" && parallel.virtual_stages == derived_virtual_stages)
      continue;
    out += f.key + " = " + f.write(stored) + "\n";
  }
  return out;
}

std::vector<KeyDoc> recipe_key_docs() {
  const Recipe defaults;
  std::vector<KeyDoc> docs;
  for (const auto& f : schema()) docs.push_back({f.full(), f.type, f.write(defaults), f.meaning});
  return docs;
}

std::string ActivationCheckpoint::name() const {
  if (every == 0) return "none";
  if (every == 1) return "full";
  return "every:" + std::to_string(every);
}

std::string recipe_keys_table() {
  const auto cell = [](std::string s) {  // a '|' would end a Markdown table cell
    for (size_t i = 0; (i = s.find('|', i)) != std::string::npos; i += 2) s.insert(i, "\\");
    return s;
  };
  std::string out = "| key | type | default | meaning |\n|---|---|---|---|\n";
  for (const auto& k : recipe_key_docs())
    out += "| `" + k.key + "` | " + k.type + " | `" + k.default_value + "` | " + cell(k.meaning) +
           " |\n";
  return out;
}

}  // namespace t3d::runtime
