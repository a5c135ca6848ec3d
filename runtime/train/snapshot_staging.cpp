// Snapshot staging: the cap, the waves, and the host-memory check (snapshot_staging.h).
#include "runtime/train/snapshot_staging.h"

#include <algorithm>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <functional>
#include <string>

#include "kernels/check.h"
#include "runtime/model/model.h"
#include "runtime/train/sharded_state.h"

namespace t3d::runtime {

namespace ck = checkpoint;

namespace {

// The "<key>: N kB" line of a /proc file, in bytes; 0 when unknown.
uint64_t proc_bytes(const char* path, const char* key) {
  std::FILE* f = std::fopen(path, "r");
  if (!f) return 0;
  char line[256];
  unsigned long long kib = 0;
  const size_t n = std::strlen(key);
  while (std::fgets(line, sizeof(line), f))
    if (std::strncmp(line, key, n) == 0 && line[n] == ':' &&
        std::sscanf(line + n + 1, " %llu kB", &kib) == 1)
      break;
  std::fclose(f);
  return static_cast<uint64_t>(kib) * 1024;
}

// MemAvailable, bytes; 0 when unknown (the check is then skipped). Test hook:
// T3D_TEST_MEM_AVAILABLE (bytes) stands in for it, as a host short of memory would have it.
uint64_t available_memory_bytes() {
  if (const char* fake = std::getenv("T3D_TEST_MEM_AVAILABLE"))
    return std::strtoull(fake, nullptr, 10);
  return proc_bytes("/proc/meminfo", "MemAvailable");
}

// What this process already holds (VmRSS), bytes.
uint64_t resident_bytes() { return proc_bytes("/proc/self/status", "VmRSS"); }

}  // namespace

SnapshotStaging::SnapshotStaging(const Recipe& r, const TrainingState& state)
    : r_(r), exec_(state.exec()) {
  mine_ = state.boxes(true);
  int64_t total = 0, largest_chunk = 1;
  for (const auto& b : mine_) {
    total += kernels::numel(b.shape);
    largest_chunk =
        std::max(largest_chunk, std::min(kernels::numel(b.shape), ck::chunk_elems(b.shape)));
  }
  // The default cap is half the training state where that state is in host memory too (the
  // CPU); on a GPU, whose state is in device memory, the whole snapshot, so that it is staged in
  // one wave copied beside the next step's compute (reserve() still fits it to the host).
  const double cap = exec_.on_gpu() && r.snapshot.staging_gib == 0
                         ? 4.0 * static_cast<double>(total)
                         : ck::staging_bytes(r.snapshot.staging_gib, state.footprint().total(),
                                             4.0 * static_cast<double>(total));
  T3D_USER_CHECK(cap >= 4.0 * static_cast<double>(largest_chunk) || r.snapshot.staging_gib == 0,
                 "recipe error: ", r.origin("snapshot.staging_gib"),
                 ": `snapshot.staging_gib` = ", r.snapshot.staging_gib,
                 " cannot hold one snapshot chunk of this rank (",
                 kernels::format_bytes(static_cast<size_t>(4 * largest_chunk)),
                 "); set it to at least that, or 0 for half the training state");
  largest_chunk_floats_ = largest_chunk;
  staging_floats_ = static_cast<size_t>(
      std::min<int64_t>(total, std::max<int64_t>(largest_chunk, static_cast<int64_t>(cap / 4))));
  plan_waves();
}

void SnapshotStaging::plan_waves() {
  struct Chunk {
    size_t box;
    int64_t index;
    size_t len;
  };
  std::vector<Chunk> chunks;
  for (size_t b = 0; b < mine_.size(); ++b) {
    const int64_t n = kernels::numel(mine_[b].shape), chunk = ck::chunk_elems(mine_[b].shape);
    for (int64_t c = 0; c * chunk < std::max<int64_t>(n, 1); ++c)
      chunks.push_back({b, c, static_cast<size_t>(std::min(chunk, n - c * chunk))});
  }
  std::vector<size_t> wave_of(chunks.size());
  size_t wave = 0, used = 0;
  for (size_t i = chunks.size(); i-- > 0;) {
    if (used + chunks[i].len > staging_floats_) ++wave, used = 0;
    wave_of[i] = wave;
    used += chunks[i].len;
  }
  waves_.assign(chunks.empty() ? 1 : wave + 1, {});
  std::vector<size_t> at(waves_.size(), 0);
  for (size_t i = 0; i < chunks.size(); ++i) {
    const size_t w = waves_.size() - 1 - wave_of[i];
    auto& parts = waves_[w];
    const Chunk& c = chunks[i];
    if (!parts.empty() && parts.back().box == c.box && parts.back().last == c.index)
      ++parts.back().last;
    else
      parts.push_back({c.box, c.index, c.index + 1, at[w]});
    at[w] += c.len;
  }
}

void SnapshotStaging::reserve(const Job& job, const Model& model, const TrainingState& state) {
  const auto& world = job.mesh->world();
  const auto& fp = model.footprint();
  const uint64_t arena =
      static_cast<uint64_t>(state.footprint().total()) + fp.activations + fp.scratch;
  // Per rank: host, staging, MemAvailable, what it will hold without snapshots, what it holds.
  const uint64_t rss = resident_bytes();
  const uint64_t mine_host[5] = {std::hash<std::string>{}(job.hostname),
                                 staging_floats_ * sizeof(float), available_memory_bytes(),
                                 std::max(arena, rss), rss};
  std::vector<uint64_t> all(5 * static_cast<size_t>(world.size()));
  world.all_gather(mine_host, all.data(), 5);
  uint64_t need = 0, held = 0, rss_host = 0;
  int ranks = 0;
  for (size_t k = 0; k < static_cast<size_t>(world.size()); ++k)
    if (all[5 * k] == mine_host[0])
      need += all[5 * k + 1], held += all[5 * k + 3], rss_host += all[5 * k + 4], ++ranks;
  const uint64_t avail = mine_host[2];
  const uint64_t room = avail + rss_host > held ? avail + rss_host - held : 0;
  uint64_t budget = room;
  if (r_.snapshot.staging_gib == 0 && avail > 0 && need > room / 4 * 3) {
    budget = room / 4 * 3;
    const auto share = static_cast<size_t>(budget / static_cast<uint64_t>(ranks) / sizeof(float));
    staging_floats_ =
        std::min(staging_floats_, std::max(share, static_cast<size_t>(largest_chunk_floats_)));
    plan_waves();
    need = static_cast<uint64_t>(ranks) * staging_floats_ * sizeof(float);  // at most this
  }
  agree_on(world, [&] {
    T3D_USER_CHECK(
        avail == 0 || need <= budget, "snapshot staging does not fit on host ", job.hostname,
        ": its ", ranks, " rank(s) need ", kernels::format_bytes(need),
        " of host memory for snapshots and ", kernels::format_bytes(budget),
        r_.snapshot.staging_gib == 0 ? " (3/4 of what their training leaves)" : "",
        " is left beside their training (", kernels::format_bytes(held), "; ",
        kernels::format_bytes(avail),
        " available now). Set snapshot.staging_gib lower (staged in waves: training waits "
        "longer per snapshot), run fewer ranks per host, or snapshot.every = 0.");
  });
  staging_arena_ = std::make_unique<kernels::Arena>(staging_floats_ * sizeof(float));
  staging_ = staging_arena_->alloc_floats("snapshot staging", staging_floats_);
  std::memset(staging_, 0, staging_floats_ * sizeof(float));
  pinned_ =
      std::make_unique<kernels::PinnedHostRegion>(exec_, staging_, staging_floats_ * sizeof(float));
}

void SnapshotStaging::stage(size_t w) {
  for (const Part& p : waves_[w]) {
    const ck::Slice& box = mine_[p.box];
    const int64_t chunk = ck::chunk_elems(box.shape), n = kernels::numel(box.shape);
    const int64_t begin = p.first * chunk, end = std::min(n, p.last * chunk);
    kernels::copy_to_host_started(exec_, staging_ + p.at, box.data + begin,
                                  static_cast<size_t>(end - begin) * sizeof(float));
  }
}

void SnapshotStaging::wait_staged() const { kernels::wait_for_copies(exec_); }

void SnapshotStaging::before_state_changes() const { kernels::compute_after_copies(exec_); }

}  // namespace t3d::runtime
