// A snapshot directory's committed steps and what it keeps: retention (the newest snapshots and
// every base they are rebuilt from) and setting snapshots aside.
#include <algorithm>
#include <filesystem>
#include <fstream>
#include <optional>
#include <set>

#include "checkpoint/h5.h"
#include "checkpoint/snapshot.h"
#include "kernels/check.h"

namespace t3d::checkpoint {

namespace fs = std::filesystem;

std::optional<int64_t> step_of(const std::string& name, const std::string& suffix) {
  constexpr size_t kPrefix = 5, kDigits = 8;  // "step_", then snapshot_name's %08lld
  if (name.size() != kPrefix + kDigits + suffix.size() || name.compare(0, kPrefix, "step_") != 0 ||
      name.compare(kPrefix + kDigits, std::string::npos, suffix) != 0)
    return std::nullopt;
  const std::string digits = name.substr(kPrefix, kDigits);
  if (!std::all_of(digits.begin(), digits.end(), [](char c) { return c >= '0' && c <= '9'; }))
    return std::nullopt;
  return std::stoll(digits);
}

std::vector<int64_t> steps_named(const std::string& dir, const std::string& suffix) {
  std::vector<int64_t> steps;
  std::error_code ec;
  for (const auto& e : fs::directory_iterator(dir, ec))
    if (const auto step = step_of(e.path().filename().string(), suffix)) steps.push_back(*step);
  std::sort(steps.begin(), steps.end());
  return steps;
}

std::vector<int64_t> committed_steps(const std::string& dir) { return steps_named(dir, ".h5"); }

void set_aside(const std::string& dir, const std::vector<int64_t>& steps, const std::string& into) {
  std::error_code ec;
  fs::create_directories(into, ec);
  T3D_USER_CHECK(!ec, "cannot create `", into, "` to set snapshots aside: ", ec.message());
  std::vector<std::string> names;
  for (const int64_t step : steps) names.push_back(snapshot_name(step));
  const auto moved = [&](const std::string& name) {
    return std::any_of(names.begin(), names.end(), [&](const std::string& n) {
      return name.compare(0, n.size(), n) == 0 &&
             (name.size() == n.size() || name[n.size()] == '.');
    });
  };
  std::vector<fs::path> entries;
  for (const auto& e : fs::directory_iterator(dir, ec)) entries.push_back(e.path());
  T3D_USER_CHECK(!ec, "cannot list `", dir, "`: ", ec.message());
  for (const auto& path : entries)
    if (moved(path.filename().string())) {
      fs::rename(path, fs::path(into) / path.filename(), ec);
      T3D_USER_CHECK(!ec, "cannot move `", path.string(), "` into `", into, "`: ", ec.message());
    }
  std::ifstream latest(dir + "/latest");
  std::string named;
  if (std::getline(latest, named) && moved(named)) fs::remove(dir + "/latest", ec);
}

namespace {

// Step of the parent of the committed snapshot at `step`; -1 for a full one; nullopt when its
// index cannot be read (then what it depends on is unknown).
std::optional<int64_t> parent_step(const std::string& dir, int64_t step) {
  try {
    const std::string path = index_path(dir, step);
    const h5::Handle f = h5::open_image(path, read_verified_index(path));
    const std::string parent = h5::read_string_attr(f, "parent", path);
    if (parent.empty()) return -1;
    if (const auto parent_step = step_of(parent, ".h5")) return parent_step;
  } catch (const UserError&) {
  }
  return std::nullopt;
}

}  // namespace

std::vector<std::string> retain(const std::string& dir, int64_t keep) {
  std::vector<std::string> deleted;
  const auto steps = committed_steps(dir);
  std::error_code ec;
  const int64_t drop = std::max<int64_t>(0, static_cast<int64_t>(steps.size()) - keep);
  // The kept snapshots and every ancestor they are rebuilt from. An index that cannot be read
  // protects everything older: deleting what it might need could lose the snapshot.
  std::set<int64_t> needed(steps.begin() + drop, steps.end());
  int64_t protect_below = -1;
  for (auto it = steps.begin() + drop; it != steps.end(); ++it) {
    for (std::optional<int64_t> s = *it; s && *s >= 0 && *s > protect_below;) {
      needed.insert(*s);
      const auto p = parent_step(dir, *s);
      if (!p) protect_below = std::max(protect_below, *s);
      s = p;
    }
  }
  for (int64_t i = 0; i < drop; ++i) {
    if (needed.count(steps[i]) || steps[i] < protect_below) continue;
    fs::remove(index_path(dir, steps[i]), ec);  // first: from here on it is not a snapshot
    fs::remove_all(dir + "/" + snapshot_name(steps[i]), ec);
    deleted.push_back(snapshot_name(steps[i]));
  }
  // Shard directories of snapshots that never committed (a crash or a failed write), older than
  // the newest committed one: no writer is still working on them.
  if (!steps.empty()) {
    for (const int64_t s : steps_named(dir, "")) {
      const std::string shards = dir + "/" + snapshot_name(s);
      if (fs::is_directory(shards, ec) && s < steps.back() && !fs::exists(index_path(dir, s))) {
        fs::remove_all(shards, ec);
        deleted.push_back(snapshot_name(s) + " (never committed)");
      }
    }
  }
  return deleted;
}

}  // namespace t3d::checkpoint
