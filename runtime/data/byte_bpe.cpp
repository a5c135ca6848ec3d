#include "runtime/data/byte_bpe.h"

#define PCRE2_CODE_UNIT_WIDTH 8
#include <pcre2.h>
#include <utf8proc.h>

#include <algorithm>
#include <array>
#include <cstdlib>
#include <nlohmann/json.hpp>

#include "kernels/check.h"

namespace t3d::runtime {

using nlohmann::json;

namespace {

// GPT-2's pre-tokenizer pattern ("ByteLevel" with use_regex = true).
constexpr const char* kGpt2Pattern =
    R"('s|'t|'re|'ve|'m|'ll|'d| ?\p{L}+| ?\p{N}+| ?[^\s\p{L}\p{N}]+|\s+(?!\S)|\s+)";

void append_utf8(std::string& out, uint32_t cp) {
  if (cp < 0x80) {
    out += static_cast<char>(cp);
  } else if (cp < 0x800) {
    out += static_cast<char>(0xC0 | (cp >> 6));
    out += static_cast<char>(0x80 | (cp & 0x3F));
  } else {
    out += static_cast<char>(0xE0 | (cp >> 12));
    out += static_cast<char>(0x80 | ((cp >> 6) & 0x3F));
    out += static_cast<char>(0x80 | (cp & 0x3F));
  }
}

// GPT-2's bytes_to_unicode: the printable bytes stand for themselves, the others for U+0100 on.
struct ByteAlphabet {
  std::array<std::string, 256> char_of_byte;
  std::unordered_map<uint32_t, uint8_t> byte_of_char;
  ByteAlphabet() {
    const auto printable = [](int b) {
      return (b >= '!' && b <= '~') || (b >= 0xA1 && b <= 0xAC) || (b >= 0xAE && b <= 0xFF);
    };
    uint32_t next = 256;
    for (int b = 0; b < 256; ++b) {
      const uint32_t cp = printable(b) ? static_cast<uint32_t>(b) : next++;
      append_utf8(char_of_byte[b], cp);
      byte_of_char[cp] = static_cast<uint8_t>(b);
    }
  }
};
const ByteAlphabet& alphabet() {
  static const ByteAlphabet a;
  return a;
}

uint64_t pair_key(uint32_t left, uint32_t right) { return (uint64_t{left} << 32) | right; }

// The byte lengths of the maximal valid UTF-8 runs and single invalid bytes of `s`, in order,
// positive for a valid run, -1 for an invalid byte.
std::vector<int64_t> utf8_runs(std::string_view s) {
  std::vector<int64_t> runs;
  size_t i = 0;
  int64_t valid = 0;
  while (i < s.size()) {
    utf8proc_int32_t cp;
    const auto n = utf8proc_iterate(reinterpret_cast<const utf8proc_uint8_t*>(s.data() + i),
                                    static_cast<utf8proc_ssize_t>(s.size() - i), &cp);
    if (n > 0) {
      valid += n;
      i += static_cast<size_t>(n);
      continue;
    }
    if (valid) runs.push_back(valid), valid = 0;
    runs.push_back(-1);
    ++i;
  }
  if (valid) runs.push_back(valid);
  return runs;
}

std::string nfc(std::string_view s) {
  std::string out;
  size_t at = 0;
  for (const int64_t run : utf8_runs(s)) {
    if (run < 0) {  // an invalid byte passes through as is
      out += s[at++];
      continue;
    }
    utf8proc_uint8_t* composed = nullptr;
    const auto n =
        utf8proc_map(reinterpret_cast<const utf8proc_uint8_t*>(s.data() + at), run, &composed,
                     static_cast<utf8proc_option_t>(UTF8PROC_STABLE | UTF8PROC_COMPOSE));
    T3D_ASSERT(n >= 0, "NFC of a valid UTF-8 run failed: ", utf8proc_errmsg(n));
    out.append(reinterpret_cast<const char*>(composed), static_cast<size_t>(n));
    std::free(composed);
    at += static_cast<size_t>(run);
  }
  return out;
}

// Reading tokenizer.json: every refusal names the file and the key.
struct Reader {
  const std::string& source;
  [[noreturn]] void refuse(const std::string& key, const std::string& why) const {
    throw UserError("tokenizer `" + source + "`: " + key + " " + why +
                    "; titan3d reads byte-level BPE tokenizers (GPT-2, Llama 3, Qwen2)");
  }
  void require_null(const json& j, const char* key, const std::string& where) const {
    if (j.contains(key) && !j[key].is_null())
      refuse(where + key, "is " + j[key].dump() + ", which titan3d does not implement");
  }
  // Absent or null: `otherwise`; a value other than true or false is refused.
  bool flag(const json& j, const char* key, const std::string& where, bool otherwise) const {
    if (!j.contains(key) || j[key].is_null()) return otherwise;
    if (!j[key].is_boolean())
      refuse(where + key, "is " + j[key].dump() + "; it must be true or false");
    return j[key].get<bool>();
  }
  void require_false(const json& j, const char* key, const std::string& where) const {
    if (flag(j, key, where, false))
      refuse(where + key, "is true, which titan3d does not implement");
  }
  std::string string_at(const json& j, size_t i, const std::string& key) const {
    if (!j[i].is_string()) refuse(key, "is " + j.dump() + "; it must hold strings");
    return j[i].get<std::string>();
  }
  int64_t id_at(const json& id, const std::string& key) const {
    if (!id.is_number_integer()) refuse(key, "is " + id.dump() + "; an id is an integer");
    return id.get<int64_t>();
  }
  std::string type_of(const json& j, const std::string& key) const {
    if (!j.is_object() || !j.contains("type") || !j["type"].is_string())
      refuse(key, "has no \"type\"");
    return j["type"].get<std::string>();
  }
};

// The first special token of the post-processor's template for one text (TemplateProcessing,
// alone or in a Sequence), as `id_of` finds it; -1 when there is none.
template <typename IdOf>
int template_bos(const json& post, const IdOf& id_of) {
  if (!post.is_object()) return -1;
  if (post.value("type", std::string()) == "Sequence") {
    for (const json& p : post.value("processors", json::array()))
      if (const int id = template_bos(p, id_of); id >= 0) return id;
    return -1;
  }
  if (post.value("type", std::string()) != "TemplateProcessing") return -1;
  const json single = post.value("single", json::array());
  if (single.empty() || !single[0].contains("SpecialToken")) return -1;
  return id_of(single[0]["SpecialToken"].value("id", std::string()));
}

}  // namespace

struct ByteLevelBpe::Regex {
  pcre2_code* code = nullptr;
  ~Regex() { pcre2_code_free(code); }
};

ByteLevelBpe::~ByteLevelBpe() = default;
ByteLevelBpe::ByteLevelBpe(ByteLevelBpe&&) noexcept = default;
ByteLevelBpe& ByteLevelBpe::operator=(ByteLevelBpe&&) noexcept = default;

ByteLevelBpe ByteLevelBpe::parse(const std::string& json_text, const std::string& source) {
  const Reader in{source};
  json j;
  try {
    j = json::parse(json_text);
  } catch (const json::exception& e) {
    throw UserError("tokenizer `" + source + "` is not JSON: " + e.what());
  }
  if (!j.is_object() || !j.contains("model")) in.refuse("\"model\"", "is missing");
  in.require_null(j, "truncation", "");
  in.require_null(j, "padding", "");
  ByteLevelBpe t;
  try {
    t.read_parts(j, source);
  } catch (const json::exception& e) {  // a value of a type the readers do not check by key
    throw UserError("tokenizer `" + source + "` is malformed: " + e.what() +
                    "; titan3d reads byte-level BPE tokenizers (GPT-2, Llama 3, Qwen2)");
  }
  return t;
}

void ByteLevelBpe::read_parts(const json& j, const std::string& source) {
  const Reader in{source};
  read_model(j["model"], source);
  read_added(j, source);
  // The normalizer: none, or NFC.
  if (j.contains("normalizer") && !j["normalizer"].is_null()) {
    if (in.type_of(j["normalizer"], "normalizer") != "NFC")
      in.refuse("normalizer.type", "is " + j["normalizer"]["type"].dump() + " (none or NFC)");
    nfc_ = true;
  }
  read_pre_tokenizer(j, source);
  if (j.contains("decoder") && !j["decoder"].is_null() &&
      in.type_of(j["decoder"], "decoder") != "ByteLevel")
    in.refuse("decoder.type", "is " + j["decoder"]["type"].dump() + " (ByteLevel)");
  bos_id_ = template_bos(j.value("post_processor", json()),
                         [&](std::string_view token) { return id_of(token); });
}

void ByteLevelBpe::add_token(const std::string& token, int64_t id, const std::string& key,
                             const std::string& source) {
  if (id < 0 || id >= kMaxIds)  // beyond it no model could hold the id (model.vocab_size)
    Reader{source}.refuse(key, "has the id " + std::to_string(id) + "; ids run from 0 to " +
                                   std::to_string(kMaxIds - 1));
  const auto i = static_cast<size_t>(id);
  if (token_of_id_.size() <= i) token_of_id_.resize(i + 1), is_added_.resize(i + 1);
  token_of_id_[i] = token;
  id_of_token_.emplace(token, static_cast<uint32_t>(id));
}

// The model: BPE over the byte alphabet, its vocabulary and merges.
void ByteLevelBpe::read_model(const json& m, const std::string& source) {
  const Reader in{source};
  if (in.type_of(m, "model") != "BPE") in.refuse("model.type", "is " + m["type"].dump());
  in.require_null(m, "dropout", "model.");
  in.require_false(m, "byte_fallback", "model.");
  for (const char* key : {"continuing_subword_prefix", "end_of_word_suffix"})
    if (m.contains(key) && !m[key].is_null() && m[key] != "")
      in.refuse(std::string("model.") + key, "is " + m[key].dump() + " (not byte-level BPE)");
  ignore_merges_ = in.flag(m, "ignore_merges", "model.", false);
  if (!m.contains("vocab") || !m["vocab"].is_object()) in.refuse("model.vocab", "is missing");
  for (const auto& [token, id] : m["vocab"].items())
    add_token(token, in.id_at(id, "model.vocab[\"" + token + "\"]"),
              "model.vocab[\"" + token + "\"]", source);
  for (int b = 0; b < 256; ++b) {
    const auto it = id_of_token_.find(alphabet().char_of_byte[b]);
    if (it == id_of_token_.end())
      in.refuse("model.vocab", "lacks the token of byte " + std::to_string(b) +
                                   " (a byte-level vocabulary holds all 256)");
    byte_id_[b] = it->second;
  }
  const json merges = m.value("merges", json::array());
  if (!merges.is_array())
    in.refuse("model.merges", std::string("is a JSON ") + merges.type_name() + ", not a list");
  for (size_t rank = 0; rank < merges.size(); ++rank) {
    const std::string key = "model.merges[" + std::to_string(rank) + "]";
    std::string left, right;
    const json& entry = merges[rank];
    if (entry.is_string()) {  // "left right", the older spelling
      const std::string text = entry.get<std::string>();
      const size_t space = text.find(' ', 1);
      if (space == std::string::npos) in.refuse(key, "is " + entry.dump());
      left = text.substr(0, space), right = text.substr(space + 1);
    } else if (entry.is_array() && entry.size() == 2) {
      left = in.string_at(entry, 0, key), right = in.string_at(entry, 1, key);
    } else {
      in.refuse(key, "is " + entry.dump());
    }
    const auto l = id_of_token_.find(left), r = id_of_token_.find(right),
               both = id_of_token_.find(left + right);
    if (l == id_of_token_.end() || r == id_of_token_.end() || both == id_of_token_.end())
      in.refuse(key, "merges `" + left + "` and `" + right + "`, which the vocabulary lacks");
    merge_.emplace(pair_key(l->second, r->second),
                   std::pair{static_cast<uint32_t>(rank), both->second});
  }
}

// Added tokens: cut out of the text before anything else, the longest first at one place.
void ByteLevelBpe::read_added(const json& j, const std::string& source) {
  const Reader in{source};
  const json added = j.value("added_tokens", json::array());
  if (!added.is_array())
    in.refuse("added_tokens", std::string("is a JSON ") + added.type_name() + ", not a list");
  for (size_t i = 0; i < added.size(); ++i) {
    const json& a = added[i];
    // An empty content would match everywhere without consuming the text.
    const bool named = a.is_object() && a.contains("content") && a["content"].is_string() &&
                       !a["content"].get<std::string>().empty();
    const std::string key =
        "added_tokens[" + (named ? a["content"].get<std::string>() : std::to_string(i)) + "]";
    if (!named || !a.contains("id"))
      in.refuse(key, "is " + a.dump() + "; an added token has a non-empty `content` and an `id`");
    for (const char* flag : {"single_word", "lstrip", "rstrip"})
      in.require_false(a, flag, key + ".");
    const std::string content = a["content"].get<std::string>();
    add_token(content, in.id_at(a["id"], key + ".id"), key, source);
    const uint32_t id = a["id"].get<uint32_t>();
    is_added_[id] = true;
    added_.push_back({content, id});
    added_starts_[static_cast<uint8_t>(content[0])] = true;
    if (in.flag(a, "normalized", key + ".", false) && j.contains("normalizer") &&
        !j["normalizer"].is_null())
      in.refuse(key + ".normalized", "is true with a normalizer");
  }
  std::sort(added_.begin(), added_.end(),
            [](const Added& a, const Added& b) { return a.content.size() > b.content.size(); });
}

// The pre-tokenizer: ByteLevel with its own pattern, or a Split then ByteLevel without one.
void ByteLevelBpe::read_pre_tokenizer(const json& j, const std::string& source) {
  const Reader in{source};
  if (!j.contains("pre_tokenizer") || j["pre_tokenizer"].is_null())
    in.refuse("pre_tokenizer", "is missing (byte-level BPE needs ByteLevel)");
  const json& pre = j["pre_tokenizer"];
  std::string pattern = kGpt2Pattern;
  bool literal = false;
  json byte_level = pre;
  if (in.type_of(pre, "pre_tokenizer") == "Sequence" &&
      pre.value("pretokenizers", json::array()).size() == 2) {
    const json& split = pre["pretokenizers"][0];
    byte_level = pre["pretokenizers"][1];
    if (in.type_of(split, "pre_tokenizer.pretokenizers[0]") != "Split")
      in.refuse("pre_tokenizer.pretokenizers[0].type", "is " + split["type"].dump());
    if (split.value("behavior", std::string()) != "Isolated")
      in.refuse("pre_tokenizer.pretokenizers[0].behavior",
                "is " + split.value("behavior", json()).dump());
    in.require_false(split, "invert", "pre_tokenizer.pretokenizers[0].");
    const json& p = split.at("pattern");
    literal = p.contains("String");
    pattern = literal ? p["String"].get<std::string>() : p.at("Regex").get<std::string>();
    if (in.flag(byte_level, "use_regex", "pre_tokenizer.pretokenizers[1].", true))
      in.refuse("pre_tokenizer.pretokenizers[1].use_regex", "is true after a Split");
  } else if (pre["type"] != "ByteLevel") {
    in.refuse("pre_tokenizer", "is " + pre["type"].dump() + " (ByteLevel, or Split + ByteLevel)");
  } else if (!in.flag(pre, "use_regex", "pre_tokenizer.", true)) {  // the text in one piece
    in.refuse("pre_tokenizer.use_regex",
              "is false without a Split (the text one piece), which titan3d does not implement");
  }
  if (in.type_of(byte_level, "pre_tokenizer") != "ByteLevel")
    in.refuse("pre_tokenizer.pretokenizers[1].type", "is " + byte_level["type"].dump());
  in.require_false(byte_level, "add_prefix_space", "pre_tokenizer (ByteLevel).");
  int error = 0;
  PCRE2_SIZE at = 0;
  split_ = std::make_unique<Regex>();
  split_->code =
      pcre2_compile(reinterpret_cast<PCRE2_SPTR>(pattern.data()), pattern.size(),
                    PCRE2_UTF | PCRE2_UCP | PCRE2_MATCH_INVALID_UTF | (literal ? PCRE2_LITERAL : 0),
                    &error, &at, nullptr);
  if (!split_->code) {
    PCRE2_UCHAR text[256];
    pcre2_get_error_message(error, text, sizeof text);
    in.refuse("pre_tokenizer's pattern", "does not compile at offset " + std::to_string(at) + ": " +
                                             reinterpret_cast<const char*>(text));
  }
  pcre2_jit_compile(split_->code, PCRE2_JIT_COMPLETE);  // interpreted where JIT is unavailable
}

int ByteLevelBpe::id_of(std::string_view token) const {
  const auto it = id_of_token_.find(std::string(token));
  return it == id_of_token_.end() ? -1 : static_cast<int>(it->second);
}

std::vector<uint32_t> ByteLevelBpe::encode(std::string_view text) const {
  std::vector<uint32_t> out;
  size_t from = 0;  // start of the stretch not yet encoded
  for (size_t i = 0; i < text.size(); ++i) {
    if (!added_starts_[static_cast<uint8_t>(text[i])]) continue;
    for (const Added& a : added_) {
      if (text.compare(i, a.content.size(), a.content) != 0) continue;
      encode_stretch(text.substr(from, i - from), out);
      out.push_back(a.id);
      i += a.content.size() - 1;
      from = i + 1;
      break;
    }
  }
  encode_stretch(text.substr(from), out);
  return out;
}

void ByteLevelBpe::encode_stretch(std::string_view raw, std::vector<uint32_t>& out) const {
  if (raw.empty()) return;
  std::string normalized;
  if (nfc_) normalized = nfc(raw), raw = normalized;
  // Matches of the pattern and the text between them are the pieces (behaviour "Isolated").
  const auto* subject = reinterpret_cast<PCRE2_SPTR>(raw.data());
  pcre2_match_data* match = pcre2_match_data_create_from_pattern(split_->code, nullptr);
  size_t start = 0, gap = 0;
  while (start < raw.size()) {
    const int rc = pcre2_match(split_->code, subject, raw.size(), start, 0, match, nullptr);
    if (rc == PCRE2_ERROR_NOMATCH) break;
    T3D_ASSERT(rc > 0, "the tokenizer's pattern failed on a text (PCRE2 error ", rc, ")");
    const PCRE2_SIZE* span = pcre2_get_ovector_pointer(match);
    if (span[1] == span[0]) {  // an empty match ends no piece: look one byte further
      start = span[0] + 1;
      continue;
    }
    if (span[0] > gap) encode_piece(raw.substr(gap, span[0] - gap), out);
    encode_piece(raw.substr(span[0], span[1] - span[0]), out);
    start = gap = span[1];
  }
  pcre2_match_data_free(match);
  if (gap < raw.size()) encode_piece(raw.substr(gap), out);
}

void ByteLevelBpe::encode_piece(std::string_view bytes, std::vector<uint32_t>& out) const {
  if (ignore_merges_) {
    std::string whole;
    for (const char c : bytes) whole += alphabet().char_of_byte[static_cast<uint8_t>(c)];
    if (const auto it = id_of_token_.find(whole); it != id_of_token_.end()) {
      out.push_back(it->second);
      return;
    }
  }
  std::vector<uint32_t> symbols;
  symbols.reserve(bytes.size());
  for (const char c : bytes) symbols.push_back(byte_id_[static_cast<uint8_t>(c)]);
  // Merge the lowest-ranked adjacent pair (the leftmost of equals) until none is ranked.
  for (;;) {
    size_t best = symbols.size();
    uint32_t best_rank = UINT32_MAX, merged = 0;
    for (size_t i = 0; i + 1 < symbols.size(); ++i) {
      const auto it = merge_.find(pair_key(symbols[i], symbols[i + 1]));
      if (it != merge_.end() && it->second.first < best_rank)
        best = i, best_rank = it->second.first, merged = it->second.second;
    }
    if (best == symbols.size()) break;
    symbols[best] = merged;
    symbols.erase(symbols.begin() + static_cast<std::ptrdiff_t>(best) + 1);
  }
  out.insert(out.end(), symbols.begin(), symbols.end());
}

std::string ByteLevelBpe::decode(std::span<const uint32_t> ids) const {
  std::string out;
  for (const uint32_t id : ids) {
    T3D_USER_CHECK(id < token_of_id_.size() && !token_of_id_[id].empty(), "token id ", id,
                   " is not in the tokenizer's vocabulary of ", token_of_id_.size(), " ids");
    const std::string& token = token_of_id_[id];
    if (is_added_[id]) {
      out += token;
      continue;
    }
    for (size_t i = 0; i < token.size();) {  // byte-level characters back to bytes
      utf8proc_int32_t cp;
      const auto n = utf8proc_iterate(reinterpret_cast<const utf8proc_uint8_t*>(token.data() + i),
                                      static_cast<utf8proc_ssize_t>(token.size() - i), &cp);
      const auto it = n > 0 ? alphabet().byte_of_char.find(static_cast<uint32_t>(cp))
                            : alphabet().byte_of_char.end();
      T3D_USER_CHECK(it != alphabet().byte_of_char.end(), "token ", id, " (`", token,
                     "`) holds a character outside the byte-level alphabet");
      out += static_cast<char>(it->second);
      i += static_cast<size_t>(n);
    }
  }
  return out;
}

}  // namespace t3d::runtime
