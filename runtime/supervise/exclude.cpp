#include "runtime/supervise/exclude.h"

#include <fstream>
#include <regex>

namespace t3d::runtime {

namespace {

// The value of `"key": ...` in one JSON line: a string's text (titan3d writes host names and
// accounts without escapes that matter here: `\"` and `\\` are undone), a number's digits, or
// nullopt when the key is absent or null.
std::optional<std::string> json_field(const std::string& line, const std::string& key) {
  const std::regex string_value("\"" + key + "\": \"((?:[^\"\\\\]|\\\\.)*)\"");
  const std::regex number_value("\"" + key + "\": (-?[0-9]+)");
  std::smatch m;
  if (std::regex_search(line, m, string_value)) {
    std::string out;
    const std::string raw = m[1];
    for (size_t i = 0; i < raw.size(); ++i)
      out += raw[i] == '\\' && i + 1 < raw.size() ? raw[++i] : raw[i];
    return out;
  }
  if (std::regex_search(line, m, number_value)) return m[1].str();
  return std::nullopt;
}

}  // namespace

std::optional<CorruptionAccount> last_corruption(const std::string& path) {
  std::ifstream in(path);
  std::string last;
  for (std::string line; std::getline(in, line);)
    if (line.find("\"event\": \"corruption\"") != std::string::npos) last = line;
  if (last.empty()) return std::nullopt;
  CorruptionAccount a;
  a.step = std::stol(json_field(last, "step").value_or("0"));
  a.verified_step = std::stol(json_field(last, "verified_step").value_or("0"));
  a.host = json_field(last, "exclude_host").value_or("");
  a.rank = std::stoi(json_field(last, "exclude_rank").value_or("-1"));
  a.what = json_field(last, "what").value_or("");
  return a;
}

int host_index(const std::vector<HostEntry>& hosts, const std::string& name, int rank) {
  for (size_t i = 0; i < hosts.size(); ++i)
    if (hosts[i].host == name) return static_cast<int>(i);
  if (rank < 0) return -1;
  int first = 0;  // the first rank on hosts[i]
  for (size_t i = 0; i < hosts.size(); ++i) {
    if (hosts[i].slots <= 0) return -1;
    if (rank < first + hosts[i].slots) return static_cast<int>(i);
    first += hosts[i].slots;
  }
  return -1;
}

}  // namespace t3d::runtime
