// The memory tier's directories and manifests (memory_tier_files.h).
#include "checkpoint/memory_tier_files.h"

#include <sys/statvfs.h>

#include <algorithm>
#include <cstdlib>
#include <filesystem>
#include <fstream>
#include <random>
#include <sstream>

#include "checkpoint/hash.h"
#include "checkpoint/paths.h"
#include "kernels/check.h"

namespace t3d::checkpoint {

namespace fs = std::filesystem;

namespace {
constexpr const char* kManifestMagic = "titan3d memory snapshot manifest 1";
}  // namespace

std::string memory_tier_root() { return "/dev/shm"; }

std::string memory_tier_dir(const std::string& job_id, const std::string& host) {
  return memory_tier_root() + "/titan3d-" + job_id + "-" + host;
}

std::string memory_tier_run_key(const std::string& run_dir) {
  std::error_code ec;
  std::string path = fs::weakly_canonical(fs::absolute(run_dir, ec), ec).string();
  if (path.empty()) path = run_dir;
  const std::string hex = to_hex(hash64(path.data(), path.size()));
  return std::string(16 - std::min<size_t>(16, hex.size()), '0') + hex;
}

std::string new_memory_tier_job_id(const std::string& run_dir) {
  char nonce[16];
  std::snprintf(nonce, sizeof(nonce), "%08x", static_cast<unsigned>(std::random_device{}()));
  return memory_tier_run_key(run_dir) + "-" + nonce;
}

std::vector<std::string> remove_memory_tiers(const std::string& job_prefix, const std::string& host,
                                             const std::string& except) {
  std::vector<std::string> removed;
  const std::string prefix = "titan3d-" + job_prefix, keep = "titan3d-" + except;
  std::error_code ec;
  for (const auto& e : fs::directory_iterator(memory_tier_root(), ec)) {
    const std::string name = e.path().filename().string();
    if (name.compare(0, prefix.size(), prefix) != 0 || !e.is_directory(ec)) continue;
    if (!except.empty() && name.compare(0, keep.size(), keep) == 0) continue;
    const std::string suffix = "-" + host;
    if (!host.empty() && (name.size() < suffix.size() ||
                          name.compare(name.size() - suffix.size(), suffix.size(), suffix) != 0))
      continue;
    std::error_code rm;
    fs::remove_all(e.path(), rm);
    if (!rm) removed.push_back(e.path().string());
  }
  return removed;
}

uint64_t memory_tier_free_bytes() {
  if (const char* fake = std::getenv("T3D_TEST_SHM_AVAILABLE"))
    return std::strtoull(fake, nullptr, 10);
  struct statvfs s {};
  if (::statvfs(memory_tier_root().c_str(), &s) != 0) return 0;
  return static_cast<uint64_t>(s.f_bavail) * static_cast<uint64_t>(s.f_frsize);
}

std::string manifest_path(const std::string& dir, int64_t step) {
  return dir + "/" + snapshot_name(step) + ".manifest";
}

std::string manifest_text(const IndexInfo& info) {
  std::ostringstream out;
  out << kManifestMagic << "\nstep " << info.step << "\nid " << info.id << "\nlayout "
      << info.layout << "\ndevice " << info.device << "\n";
  for (const auto& [name, value] : info.counters) out << "counter " << name << " " << value << "\n";
  for (const auto& s : info.shards)
    out << "shard " << s.bytes << " " << s.hash << " " << s.file << "\n";
  if (!info.gemm_table.empty())
    out << "gemm_table " << info.gemm_table.size() << "\n" << info.gemm_table << "\n";
  out << "recipe " << info.recipe.size() << "\n" << info.recipe;
  std::string body = out.str();
  return body + "\nend " + to_hex(hash64(body.data(), body.size())) + "\n";
}

std::optional<IndexInfo> parse_manifest(const std::string& text) {
  const size_t end = text.rfind("\nend ");
  if (end == std::string::npos) return std::nullopt;
  const std::string body = text.substr(0, end);
  std::string tail = text.substr(end + 5);
  while (!tail.empty() && tail.back() == '\n') tail.pop_back();
  if (tail != to_hex(hash64(body.data(), body.size()))) return std::nullopt;
  std::istringstream in(body);
  std::string line;
  if (!std::getline(in, line) || line != kManifestMagic) return std::nullopt;
  IndexInfo info;
  while (std::getline(in, line)) {
    std::istringstream words(line);
    std::string key;
    words >> key;
    if (key == "step") {
      words >> info.step;
    } else if (key == "id") {
      words >> info.id;
    } else if (key == "layout") {
      info.layout = line.size() > 7 ? line.substr(7) : "";
    } else if (key == "device") {
      info.device = line.size() > 7 ? line.substr(7) : "";
    } else if (key == "counter") {
      std::string name;
      int64_t value = 0;
      words >> name >> value;
      info.counters[name] = value;
    } else if (key == "shard") {
      ShardEntry s;
      words >> s.bytes >> s.hash >> s.file;
      info.shards.push_back(s);
    } else if (key == "gemm_table" || key == "recipe") {  // "<key> N", then N bytes
      std::string& text = key == "recipe" ? info.recipe : info.gemm_table;
      size_t n = 0;
      words >> n;
      text.resize(n);
      in.read(text.data(), static_cast<std::streamsize>(n));
      if (static_cast<size_t>(in.gcount()) != n) return std::nullopt;
    } else if (!key.empty()) {
      return std::nullopt;
    }
  }
  if (info.shards.empty()) return std::nullopt;
  return info;
}

void write_manifest(const std::string& dir, const IndexInfo& info) {
  write_file_atomically(manifest_path(dir, info.step), manifest_text(info),
                        "the memory tier's manifest");
}

std::optional<IndexInfo> read_manifest(const std::string& dir, int64_t step) {
  std::ifstream f(manifest_path(dir, step), std::ios::binary);
  if (!f) return std::nullopt;
  std::stringstream text;
  text << f.rdbuf();
  auto info = parse_manifest(text.str());
  if (info && info->step != step) return std::nullopt;
  return info;
}

std::vector<int64_t> manifest_steps(const std::string& dir) {
  return steps_named(dir, ".manifest");
}

void retain_memory_snapshot(const std::string& dir, int64_t keep, int64_t writing) {
  const std::string kept = snapshot_name(keep), busy = writing >= 0 ? snapshot_name(writing) : "";
  std::error_code ec;
  std::vector<fs::path> doomed;
  for (const auto& e : fs::directory_iterator(dir, ec)) {
    const std::string name = e.path().filename().string();
    const std::string stem = name.substr(0, name.find('.'));
    if (stem == kept || (!busy.empty() && name == busy)) continue;
    doomed.push_back(e.path());
  }
  // The manifests first: from then on what remains of those steps is not a snapshot.
  std::stable_partition(doomed.begin(), doomed.end(),
                        [](const fs::path& p) { return p.extension() == ".manifest"; });
  for (const auto& p : doomed) fs::remove_all(p, ec);
}

}  // namespace t3d::checkpoint
