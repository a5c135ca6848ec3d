// A run's snapshots: staging, the asynchronous write, the commit agreement, retention, restore and
// resharding, for the disk tier and the memory tier alike. One file on purpose: each phase reads
// the same Snapshotter::Impl state; the file format itself lives in checkpoint/, the memory
// tier's copies and inventory in memory_tier.cpp.
#include "runtime/train/snapshots.h"

#include <spdlog/spdlog.h>

#include <chrono>
#include <cstdlib>
#include <cstring>
#include <ctime>
#include <filesystem>
#include <future>
#include <optional>
#include <random>

#include "checkpoint/hash.h"
#include "checkpoint/io_thread.h"
#include "checkpoint/snapshot.h"
#include "kernels/arena.h"
#include "kernels/check.h"
#include "parallel/trace.h"
#include "runtime/launch/logging.h"
#include "runtime/machine/gemm_choice.h"
#include "runtime/model/model.h"
#include "runtime/provenance/provenance.h"
#include "runtime/train/memory_tier.h"
#include "runtime/train/metrics.h"
#include "runtime/train/sharded_state.h"

namespace t3d::runtime {

namespace fs = std::filesystem;
namespace ck = checkpoint;
using Clock = std::chrono::steady_clock;
using parallel::Dim;

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

// UserError naming snapshot.dir unless this rank can create `dir` and a file in it: a run whose
// snapshots can never be written must not train for hours first.
void check_writable_dir(const std::string& dir, const std::string& origin, int rank) {
  std::error_code ec;
  fs::create_directories(dir, ec);
  std::string why = ec ? ec.message() : !fs::is_directory(dir) ? "it is not a directory" : "";
  if (why.empty()) {
    const std::string probe = fmt::format("{}/.write_probe.rank{}", dir, rank);
    std::FILE* f = std::fopen(probe.c_str(), "w");
    if (!f) why = std::strerror(errno);
    if (f && (std::fputc('x', f) == EOF || std::fflush(f) != 0)) why = std::strerror(errno);
    if (f && std::fclose(f) != 0 && why.empty()) why = std::strerror(errno);
    std::remove(probe.c_str());
  }
  T3D_USER_CHECK(why.empty(), "recipe error: ", origin, ": `snapshot.dir`: cannot write into `",
                 dir, "` on rank ", rank, ": ", why,
                 ". Point snapshot.dir at a writable directory that every rank sees, or set "
                 "snapshot.every = 0 to train without snapshots.");
}

std::string layout_of(const Recipe& r) {
  const auto& p = r.parallel;
  return fmt::format("pp={} dp={} cp={} tp={} ep={} zero={} schedule={} virtual_stages={}", p.pp,
                     p.dp, p.cp, p.tp, p.ep, p.zero, choice_name(p.schedule), p.virtual_stages);
}

}  // namespace

struct Snapshotter::Impl {
  const Job& job;
  const Recipe& r;
  const parallel::Mesh& mesh;
  Model& model;
  const TrainingState& state;
  MetricsWriter* metrics;
  std::string dir;
  std::unique_ptr<ck::IoThread> io;
  // The memory tier (memory_tier.h): null when snapshot.memory_every = 0 or not self-launched.
  std::unique_ptr<MemoryTier> tier;
  // The boxes this rank writes (data in the arena) and the host staging they are copied into at
  // a snapshot, in waves of at most staging_floats: each wave is written before the next is
  // copied, and training goes on while the last one is written.
  std::vector<ck::Slice> mine;
  // An arena of its own (huge pages where offered, like the device arena): staging_floats.
  std::unique_ptr<kernels::Arena> staging_arena;
  float* staging = nullptr;
  struct Part {
    size_t box;
    int64_t first, last;  // chunks [first, last) of the box
    size_t at;            // where chunk `first` starts in staging
  };
  std::vector<std::vector<Part>> waves;

  // The last committed snapshot of this process, parent of the next incremental one. After a
  // start or resume there is none: the first snapshot is always a full base (it may go to
  // another directory, with another layout).
  struct Parent {
    std::string name;  // index file name
    uint64_t id = 0;
    std::vector<std::vector<uint64_t>> hashes;  // chunk hashes of each of `mine`
    int64_t deltas = 0;                         // incremental snapshots since its full base
    // Share of all ranks' chunks that had not changed since the snapshot before it; -1 when
    // there was none to compare with.
    double unchanged = -1;
  };
  std::optional<Parent> parent;

  struct Pending {
    int64_t step = 0;
    bool memory = false;  // a memory-tier snapshot (into tier->dir(), always full, no deflate)
    // A memory snapshot whose shards are written and whose buddy copies are moving (MemoryTier::
    // start_copies); its index info, for the manifest that commits it.
    bool copying = false;
    ck::IndexInfo info;
    uint64_t bytes = 0;  // of every rank's shard
    bool incremental = false;
    std::string why_full;                     // when a parent exists but the snapshot is full: why
    std::unique_ptr<ck::ShardWriter> writer;  // lives on the I/O thread between waves
    std::future<void> done;
    ck::ShardResult result;  // set by the write job
    double stall_s = 0, write_s = 0;
  };
  std::optional<Pending> pending;
  std::string last_good;  // index of the newest committed snapshot, for messages

  // The content hash of data.tokenizer's model file, hashed once at the start (0: bytes): a file
  // changed during the run does not change what the snapshots record.
  int64_t tokenizer_hash_ = 0;

  Impl(const Job& j, Model& m, const TrainingState& st, MetricsWriter* w)
      : job(j), r(j.recipe), mesh(*j.mesh), model(m), state(st), metrics(w), dir(r.snapshot.dir) {
    if (mesh.rank() == 0) tokenizer_hash_ = tokenizer_hash(r);
    if (mesh.rank() == 0 && r.snapshot.every > 0) data_hash_ = data_hash(r);
  }
  int64_t data_hash_ = 0;  // the training file's content at the start (0: not recorded)

  // What rank 0 resolved snapshot.resume to; every rank restores exactly this.
  struct Choice {
    std::string path;
    int64_t step = 0;
    uint64_t id = 0;
  };

  // Rank 0: the snapshot to restore, verified (index, chain, every shard's hash for `latest`,
  // and the model's shape), older than step `before` when a newer one failed to restore. An
  // empty path: start fresh. UserError when there is nothing good to restore.
  Choice resolve(int64_t before, int64_t* seen) {
    const std::string& want = r.snapshot.resume;
    Choice c;
    const auto accept = [&](ck::SnapshotReader& reader) {
      check_same_model(reader.info().recipe, r, reader.path(), "resume from");
      check_same_tokenizer(reader.info().counters, r, reader.path(), "resume from");
      warn_if_data_changed(reader.info().counters, reader.info().recipe, r, reader.path());
      for (const auto& change : changed_model_function(reader.info().recipe, r, reader.path()))
        spdlog::warn("resuming {} with another model function: {}", reader.path(), change);
      c.step = reader.info().step;
      c.id = reader.info().id;
    };
    if (want != "latest") {
      io->run([&] {
        ck::SnapshotReader reader(want);  // shards are checked by each rank as it reads them
        accept(reader);
      });
      c.path = want;
      return c;
    }
    std::vector<std::string> skipped;
    io->run([&] {
      const auto steps = ck::committed_steps(dir);
      *seen = std::max<int64_t>(*seen, static_cast<int64_t>(steps.size()));
      // Test hook: this rank's listing misses the newest snapshot, as a stale attribute cache of
      // a shared file system (or a snapshot committed just after listing) would have it.
      if (const char* stale = std::getenv("T3D_TEST_STALE_LISTING");
          stale && std::atoi(stale) == mesh.rank() && !steps.empty())
        before = before < 0 ? steps.back() : std::min(before, steps.back());
      c.path = ck::find_latest(dir, &skipped, before, accept);
    });
    for (const auto& why : skipped) spdlog::warn("snapshot.resume = latest: skipping {}", why);
    if (c.path.empty() && *seen > 0)
      throw UserError(fmt::format(
          "snapshot.resume = latest: none of the {} snapshot(s) in {} can be restored (the "
          "reasons are above); refusing to start from scratch over them. Resume a named good "
          "snapshot (snapshot.resume = PATH), move the damaged ones away, or set snapshot.resume "
          "= \"\" to start fresh on purpose.",
          *seen, dir));
    if (c.path.empty() && !(tier && tier->restoring()))  // else the memory tier's turn
      spdlog::info("snapshot.resume = latest: no snapshot in {}; starting fresh", dir);
    return c;
  }

  // Reads this rank's state from `c`, refusing a snapshot that is not the one rank 0 resolved.
  void load(const Choice& c, std::string* layout) {
    const auto boxes = state.boxes(false);
    io->run([&] {
      ck::SnapshotReader reader(c.path);
      const auto& info = reader.info();
      T3D_USER_CHECK(info.step == c.step && info.id == c.id, "snapshot `", c.path,
                     "` changed while the job started: rank 0 resolved step ", c.step, " (id ",
                     ck::to_hex(c.id), "), this rank reads step ", info.step, " (id ",
                     ck::to_hex(info.id), "). Is another job writing into ", dir, "?");
      check_same_model(info.recipe, r, c.path, "resume from");
      T3D_USER_CHECK(info.counters.count("step") && info.counters.at("step") == c.step,
                     "snapshot `", c.path,
                     "` has no step counter, or one that differs from its "
                     "step attribute");
      for (const auto& s : boxes) reader.read(s);
      *layout = info.layout;
    });
  }

  // Collective. Rank 0 resolves snapshot.resume and verifies it; every rank restores exactly that
  // snapshot (path, step and id broadcast), so ranks never restore different steps even when the
  // directory changes under them. With `latest`, a snapshot that fails to restore on any rank is
  // skipped (rank 0 names it and the reason) for the next older one.
  int64_t restore() {
    const int64_t step = restore_chosen();
    set_aside_other_runs(step);
    return step;
  }

  // Collective. Committed snapshots in snapshot.dir that this run does not continue are moved
  // into <snapshot.dir>/set-aside-<UTC time>/, said on rank 0: all of them on a fresh start or a
  // resume of a snapshot from elsewhere, those after the resumed step when an explicit path in
  // this directory is resumed. `latest` and retention then only ever see this run's lineage (an
  // older run's step 40 is never resumed, nor kept over this run's step 20). With
  // `snapshot.resume = latest` the newest good one was resumed and nothing moves (newer ones
  // that failed to restore stay where the warnings above name them).
  void set_aside_other_runs(int64_t resumed_step) {
    if (r.snapshot.every <= 0 || r.snapshot.resume == "latest") return;
    agree_on(mesh.world(), [&] {
      if (mesh.rank() != 0) return;
      std::error_code ec;
      const bool from_here =
          !last_good.empty() && fs::equivalent(fs::path(last_good).parent_path(), dir, ec);
      std::vector<int64_t> others;
      for (const int64_t step : ck::committed_steps(dir))
        if (!from_here || step > resumed_step) others.push_back(step);
      if (others.empty()) return;
      const std::time_t now = std::time(nullptr);
      char stamp[32];
      std::strftime(stamp, sizeof(stamp), "%Y%m%dT%H%M%SZ", std::gmtime(&now));
      const std::string into = dir + "/set-aside-" + stamp;
      io->run([&] { ck::set_aside(dir, others, into); });
      spdlog::warn(
          "snapshot.dir {} held {} snapshot(s) this run does not continue (steps {}{}); "
          "moved them to {} so that `latest` and snapshot.keep see only this run's",
          dir, others.size(), fmt::join(others, ", "),
          last_good.empty() ? ", and this run starts fresh" : ", after " + last_good, into);
    });
  }

  int64_t restore_chosen() {
    if (r.snapshot.resume.empty()) return 0;
    const auto& world = mesh.world();
    const bool latest = r.snapshot.resume == "latest";
    int64_t before = -1, seen = 0;
    const auto t0 = Clock::now();
    // A restart after a failure tries the memory tier first, when it is newer than the disk's
    // newest good snapshot; `tier_why` says why it was not used.
    bool try_memory = tier && tier->restoring();
    std::string tier_why;
    int64_t disk_step = 0, memory_step = -1;
    for (;;) {
      Choice c;
      agree_on(world, [&] {
        if (world.rank() == 0) c = resolve(before, &seen);
      });
      world.broadcast(c.path, 0);
      world.broadcast(&c.step, 1, 0);
      world.broadcast(&c.id, 1, 0);
      bool memory = false;
      if (try_memory) {
        try_memory = false;
        disk_step = c.path.empty() ? 0 : c.step;
        Choice m;
        m.path = tier->prepare_restore(disk_step, state.boxes(false), &m.step, &m.id, &tier_why);
        memory_step =
            m.path.empty() && tier_why.find("no complete") != std::string::npos ? -1 : m.step;
        if (!m.path.empty()) c = m, memory = true;
      }
      if (c.path.empty()) {
        if (tier && tier->restoring() && mesh.rank() == 0)
          spdlog::info(
              "snapshot.resume = latest: no snapshot in {} nor in the memory tier ({}); "
              "starting fresh",
              dir, tier_why);
        record_restore("disk", 0, disk_step, memory_step, tier_why);
        return 0;
      }
      std::string error, layout;
      bool internal = false;  // every rank must reach the agreement below, whatever it threw
      try {
        load(c, &layout);
      } catch (const UserError& e) {
        error = e.what();
      } catch (const std::exception& e) {
        error = e.what(), internal = true;
      }
      int first_failed = error.empty() ? world.size() : world.rank();
      world.all_reduce(&first_failed, 1, parallel::ReduceOp::min);
      if (first_failed == world.size()) {
        // Every rank says what it restored (ranks > 0 into their own logs).
        spdlog::info(
            "resumed from {} after step {}{} in {:.1f} s{}", c.path, c.step,
            layout == layout_of(r) ? ""
                                   : fmt::format(" (resharded: {} -> {})", layout, layout_of(r)),
            seconds_since(t0),
            !tier    ? ""
            : memory ? " (tier: memory)"
                     : fmt::format(" (tier: disk{})", tier_why.empty() ? "" : ": " + tier_why));
        if (!memory) last_good = c.path;
        record_restore(memory ? "memory" : "disk", c.step, disk_step, memory_step, tier_why);
        return c.step;
      }
      if (memory) {
        // The memory tier's snapshot cannot be read on some rank: the disk tier's newest it is.
        world.broadcast(error, first_failed);
        tier_why = fmt::format("restoring the memory tier's step {} failed on rank {}: {}", c.step,
                               first_failed, error);
        if (mesh.rank() == 0) spdlog::warn("{}; falling back to the disk tier", tier_why);
        continue;
      }
      // An explicit snapshot that fails is an error (the failing rank's message, once).
      if (!latest)
        agree_on(world, [&] {
          if (internal) throw InternalError(error);
          if (!error.empty()) throw UserError(error);
        });
      world.broadcast(error, first_failed);
      if (mesh.rank() == 0)
        spdlog::warn("snapshot.resume = latest: skipping {}: rank {} cannot restore it: {}", c.path,
                     first_failed, error);
      before = c.step;
    }
  }

  // Rank 0 of a restart after a failure with the memory tier on: which tier the job resumed from
  // (step 0: none, a fresh start), and why not the memory tier, as a line of incidents.jsonl
  // (docs/resilience.md) after the supervisor's incident.
  void record_restore(const char* used, int64_t step, int64_t disk_step, int64_t memory_step,
                      const std::string& why) {
    if (!tier || !tier->restoring() || mesh.rank() != 0) return;
    const std::time_t now = std::time(nullptr);
    char stamp[32];
    std::strftime(stamp, sizeof(stamp), "%Y-%m-%dT%H:%M:%SZ", std::gmtime(&now));
    std::FILE* f = std::fopen((job.run_dir + "/incidents.jsonl").c_str(), "a");
    if (!f) return;
    std::fprintf(f,
                 "{\"time\": %s, \"event\": \"restore\", \"tier\": \"%s\", \"snapshot_step\": "
                 "%lld, \"disk_step\": %lld, \"memory_step\": %lld, \"why\": %s}\n",
                 parallel::trace::json_string(stamp).c_str(), used, static_cast<long long>(step),
                 static_cast<long long>(disk_step), static_cast<long long>(memory_step),
                 parallel::trace::json_string(std::string(used) == "memory" ? "" : why).c_str());
    std::fclose(f);
  }

  // This rank's boxes and the waves they are staged in; the staging itself is allocated by
  // reserve_staging() once every host is known to have the memory.
  void plan_staging() {
    mine = state.boxes(true);
    int64_t total = 0, largest_chunk = 1;
    for (const auto& b : mine) {
      total += kernels::numel(b.shape);
      largest_chunk =
          std::max(largest_chunk, std::min(kernels::numel(b.shape), ck::chunk_elems(b.shape)));
    }
    const double cap = ck::staging_bytes(r.snapshot.staging_gib, state.footprint().total(),
                                         4.0 * static_cast<double>(total));
    T3D_USER_CHECK(cap >= 4.0 * static_cast<double>(largest_chunk) || r.snapshot.staging_gib == 0,
                   "recipe error: ", r.origin("snapshot.staging_gib"),
                   ": `snapshot.staging_gib` = ", r.snapshot.staging_gib,
                   " cannot hold one snapshot chunk of this rank (",
                   kernels::format_bytes(static_cast<size_t>(4 * largest_chunk)),
                   "); set it to at least that, or 0 for half the training state");
    largest_chunk_floats = largest_chunk;
    staging_floats = static_cast<size_t>(
        std::min<int64_t>(total, std::max<int64_t>(largest_chunk, static_cast<int64_t>(cap / 4))));
    plan_waves();
  }
  int64_t largest_chunk_floats = 1;
  size_t staging_floats = 0;

  // Cuts `mine` into waves of at most staging_floats, at chunk boundaries, filled from the end:
  // the last wave, written while training goes on, is a full one and the first takes the rest,
  // so training waits for as little writing as the cap allows.
  void plan_waves() {
    struct Chunk {
      size_t box;
      int64_t index;
      size_t len;
    };
    std::vector<Chunk> chunks;
    for (size_t b = 0; b < mine.size(); ++b) {
      const int64_t n = kernels::numel(mine[b].shape), chunk = ck::chunk_elems(mine[b].shape);
      for (int64_t c = 0; c * chunk < std::max<int64_t>(n, 1); ++c)
        chunks.push_back({b, c, static_cast<size_t>(std::min(chunk, n - c * chunk))});
    }
    std::vector<size_t> wave_of(chunks.size());
    size_t wave = 0, used = 0;
    for (size_t i = chunks.size(); i-- > 0;) {
      if (used + chunks[i].len > staging_floats) ++wave, used = 0;
      wave_of[i] = wave;
      used += chunks[i].len;
    }
    waves.assign(chunks.empty() ? 1 : wave + 1, {});
    std::vector<size_t> at(waves.size(), 0);
    for (size_t i = 0; i < chunks.size(); ++i) {
      const size_t w = waves.size() - 1 - wave_of[i];
      auto& parts = waves[w];
      const Chunk& c = chunks[i];
      if (!parts.empty() && parts.back().box == c.box && parts.back().last == c.index)
        ++parts.back().last;
      else
        parts.push_back({c.box, c.index, c.index + 1, at[w]});
      at[w] += c.len;
    }
  }

  // Collective. A host's memory for the job is what is available plus what its ranks already
  // hold; each rank will hold at least its arena's regions (most not yet touched when this runs)
  // or what it holds now, whichever is more, plus its staging. With the default cap
  // (snapshot.staging_gib = 0) a host's ranks stage in at most 3/4 of what that leaves (smaller
  // waves where half the training state would not fit); an explicit cap is taken as given. A run
  // whose staging cannot fit some host is refused (exit 2, on every rank) with the numbers. Then
  // the staging is allocated and touched, so that the first snapshot's stall is a plain copy.
  void reserve_staging() {
    const auto& world = mesh.world();
    const auto& fp = model.footprint();
    const uint64_t arena =
        static_cast<uint64_t>(state.footprint().total()) + fp.activations + fp.scratch;
    // Per rank: host, staging, MemAvailable, what it will hold without snapshots, what it holds.
    const uint64_t rss = resident_bytes();
    const uint64_t mine_host[5] = {std::hash<std::string>{}(job.hostname),
                                   staging_floats * sizeof(float), available_memory_bytes(),
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
    if (r.snapshot.staging_gib == 0 && avail > 0 && need > room / 4 * 3) {
      budget = room / 4 * 3;
      const auto share = static_cast<size_t>(budget / static_cast<uint64_t>(ranks) / sizeof(float));
      staging_floats =
          std::min(staging_floats, std::max(share, static_cast<size_t>(largest_chunk_floats)));
      plan_waves();
      need = static_cast<uint64_t>(ranks) * staging_floats * sizeof(float);  // at most this
    }
    agree_on(world, [&] {
      T3D_USER_CHECK(
          avail == 0 || need <= budget, "snapshot staging does not fit on host ", job.hostname,
          ": its ", ranks, " rank(s) need ", kernels::format_bytes(need),
          " of host memory for snapshots and ", kernels::format_bytes(budget),
          r.snapshot.staging_gib == 0 ? " (3/4 of what their training leaves)" : "",
          " is left beside their training (", kernels::format_bytes(held), "; ",
          kernels::format_bytes(avail),
          " available now). Set snapshot.staging_gib lower (staged in waves: training waits "
          "longer per snapshot), run fewer ranks per host, or snapshot.every = 0.");
    });
    staging_arena = std::make_unique<kernels::Arena>(staging_floats * sizeof(float));
    staging = staging_arena->alloc_floats("snapshot staging", staging_floats);
    std::memset(staging, 0, staging_floats * sizeof(float));
  }

  // Copies the parts of wave `w` from the arena into staging.
  void stage(size_t w) {
    for (const Part& p : waves[w]) {
      const ck::Slice& box = mine[p.box];
      const int64_t chunk = ck::chunk_elems(box.shape), n = kernels::numel(box.shape);
      const int64_t begin = p.first * chunk, end = std::min(n, p.last * chunk);
      std::memcpy(staging + p.at, box.data + begin,
                  static_cast<size_t>(end - begin) * sizeof(float));
    }
  }

  // Whether the next snapshot is incremental, alike on every rank (`parent` changes only on
  // commits, which all ranks agree on); otherwise why not, for the log ("" when no parent).
  bool incremental_next(std::string* why_full) const {
    if (!parent) return false;
    if (parent->deltas + 1 >= r.snapshot.full_every) {
      *why_full = fmt::format("every {} snapshots one is full (snapshot.full_every)",
                              r.snapshot.full_every);
      return false;
    }
    const double pays = r.snapshot.incremental_min_unchanged;
    if (pays > 0 && parent->unchanged < pays) {
      *why_full = parent->unchanged < 0
                      ? std::string("measuring what an incremental one would skip")
                      : fmt::format(
                            "only {:.1f}% of chunks were unchanged last time; an "
                            "incremental snapshot pays from {:.0f}% "
                            "(snapshot.incremental_min_unchanged)",
                            100 * parent->unchanged, 100 * pays);
      return false;
    }
    return true;
  }

  // The directory a snapshot goes to: snapshot.dir, or this host's memory tier.
  const std::string& dir_of(const Pending& p) const { return p.memory ? tier->dir() : dir; }

  // Starts the snapshot of `step` (into the memory tier with `memory`: the same shards, full and
  // uncompressed, through the same staging and I/O thread).
  void start(int64_t step, bool memory = false) {
    const auto t0 = Clock::now();
    parallel::trace::Span span("snapshot staging", "io");
    // Training waits for the previous snapshot (a memory one may take two commits: its shards,
    // then its buddy copies): part of the stall.
    while (pending) commit();
    pending.emplace();
    Pending* p = &*pending;
    p->step = step;
    p->memory = memory;
    p->incremental = !memory && incremental_next(&p->why_full);
    const std::string shard = ck::shard_path(dir_of(*p), step, mesh.rank());
    ck::WriteOptions opt;
    opt.deflate = memory ? 0 : static_cast<int>(r.snapshot.deflate);
    if (!memory) opt.fault = ck::fault_from_env(step, mesh.rank());
    if (parent && !memory)
      opt.previous_hashes = &parent->hashes, opt.skip_unchanged = p->incremental;
    // The jobs read the parent's hashes, which change only in commit(), after they end.
    const auto wave_job = [this, p, shard, opt](size_t w) {
      return [this, p, shard, opt, w] {
        const auto w0 = Clock::now();
        parallel::trace::Span write_span("snapshot write", "io");
        try {
          if (w == 0) p->writer = std::make_unique<ck::ShardWriter>(shard, mesh.rank(), mine, opt);
          for (const Part& part : waves[w])
            p->writer->write(part.box, part.first, part.last, staging + part.at);
          if (w + 1 == waves.size()) p->result = p->writer->finish(), p->writer.reset();
        } catch (...) {
          p->writer.reset();  // abandons the temporary, which commit() discards
          throw;
        }
        p->write_s += seconds_since(w0);
      };
    };
    if (mine.empty()) {
      p->done = io->submit([] {});
    } else {
      // Every wave but the last is written before the next one overwrites the staging; a
      // failed one ends the snapshot, which commit() reports like any failed write.
      std::exception_ptr failed;
      for (size_t w = 0; w + 1 < waves.size() && !failed; ++w) {
        stage(w);
        try {
          io->run(wave_job(w));
        } catch (...) {
          failed = std::current_exception();
        }
      }
      if (failed) {
        std::promise<void> broken;
        broken.set_exception(failed);
        p->done = broken.get_future();
      } else {
        stage(waves.size() - 1);
        p->done = io->submit(wave_job(waves.size() - 1));
      }
    }
    p->stall_s = seconds_since(t0);
    if (!r.snapshot.async) commit();
  }

  bool all_ranks_done() {
    int done = pending->copying
                   ? tier->copies_done()
                   : pending->done.wait_for(std::chrono::seconds(0)) == std::future_status::ready;
    mesh.world().all_reduce(&done, 1, parallel::ReduceOp::min);
    return done == 1;
  }

  // Agrees that every rank's write succeeded, then publishes the shards (collective). Returns the
  // lowest failing world rank, or the world size when all succeeded; `error` holds this rank's.
  int publish_all(const std::string& shard, std::string& error) {
    const auto& world = mesh.world();
    int first_failed = error.empty() ? world.size() : world.rank();
    world.all_reduce(&first_failed, 1, parallel::ReduceOp::min);
    if (first_failed != world.size()) return first_failed;
    if (!mine.empty()) {
      try {
        ck::publish(shard);
      } catch (const std::exception& e) {
        error = e.what();
        first_failed = world.rank();
      }
    }
    // Every rank joins, writers or not (a rank may hold no box of its own).
    world.all_reduce(&first_failed, 1, parallel::ReduceOp::min);
    return first_failed;
  }

  // Every rank's shard summed, from the reports all ranks gathered (so alike everywhere).
  struct Totals {
    uint64_t bytes = 0, raw = 0, chunks = 0, written = 0, unchanged = 0;
    double index_s = 0;
    std::vector<std::string> deleted;
  };
  // Per rank: writes, bytes, hash, raw bytes, chunks, chunks written, chunks unchanged.
  static constexpr size_t kReport = 7;
  Totals totals_of(const std::vector<uint64_t>& reports) const {
    Totals t;
    for (int k = 0; k < mesh.world().size(); ++k) {
      const uint64_t* rep = &reports[kReport * static_cast<size_t>(k)];
      t.bytes += rep[1], t.raw += rep[3], t.chunks += rep[4], t.written += rep[5];
      t.unchanged += rep[6];
    }
    return t;
  }

  // Rank 0: the index of snapshot `p` from every rank's report, written (the commit) and older
  // snapshots retired. Returns whether it committed; a failure drops this snapshot only.
  // The index of snapshot `p` from every rank's report (the world rank of each shard in
  // `writers`); rank 0's counters.
  ck::IndexInfo index_info(const Pending& p, const std::vector<uint64_t>& reports,
                           std::vector<int>* writers = nullptr) const {
    ck::IndexInfo info;
    info.step = p.step;
    info.id = std::random_device{}() ^ (uint64_t(std::random_device{}()) << 32) ^ uint64_t(p.step);
    if (p.incremental) info.parent = parent->name, info.parent_id = parent->id;
    info.recipe = recipe_as_run(job).to_toml();  // the job's precision, for resume and eval
    info.layout = layout_of(r);
    info.counters = {{"step", p.step},
                     {"adamw_step", p.step},
                     {"sampler_seed", r.train.seed},
                     {"sampler_step", p.step}};
    if (tokenizer_hash_ != 0) info.counters[kTokenizerHashCounter] = tokenizer_hash_;
    if (data_hash_ != 0) info.counters[kDataHashCounter] = data_hash_;
    for (int k = 0; k < mesh.world().size(); ++k) {
      const uint64_t* rep = &reports[kReport * static_cast<size_t>(k)];
      if (!rep[0]) continue;
      const auto rel = fs::path(ck::shard_path(dir, p.step, k)).lexically_relative(dir);
      info.shards.push_back({rel.string(), rep[1], rep[2]});
      if (writers) writers->push_back(k);
    }
    return info;
  }

  bool write_index(const Pending& p, const std::vector<uint64_t>& reports, ck::IndexInfo& info,
                   Totals& t) {
    info = index_info(p, reports);
    const auto i0 = Clock::now();
    bool committed = false;
    try {
      std::string warning;
      io->run([&] { warning = ck::write_index(dir, info); });
      committed = true;  // durable and re-read
      if (!warning.empty()) spdlog::warn("snapshot at step {}: {}", p.step, warning);
    } catch (const std::exception& e) {
      // Its shards are referenced by nothing: free their space now (a full disk) rather than at
      // the next commit.
      std::error_code ec;
      fs::remove_all(fs::path(dir) / ck::snapshot_name(p.step), ec);
      spdlog::error(
          "snapshot at step {}: writing the index failed: {}; it is not committed, {} "
          "stays the last good one",
          p.step, e.what(), last_good.empty() ? "none" : last_good);
      if (metrics) metrics->write({{"snapshot_step", double(p.step)}, {"snapshot_ok", 0}});
    }
    t.index_s = seconds_since(i0);
    if (committed) {
      try {  // a failing retention leaves old snapshots behind; it does not undo the commit
        io->run([&] { t.deleted = ck::retain(dir, r.snapshot.keep); });
      } catch (const std::exception& e) {
        spdlog::warn("snapshot at step {}: removing older snapshots failed: {}", p.step, e.what());
      }
    }
    return committed;
  }

  // Rank 0: the committed snapshot's log line and metrics.
  void log_commit(const Pending& p, const ck::IndexInfo& info, const Totals& t,
                  const double times[2]) {
    // Synchronous snapshots: training also waited for the whole write.
    const double stall = r.snapshot.async ? times[0] : times[0] + times[1];
    const double share = t.raw ? double(t.bytes) / double(t.raw) : 0.0;
    std::string kind = "full";
    if (p.incremental)
      kind =
          fmt::format("incremental on {}, {}/{} chunks changed", info.parent, t.written, t.chunks);
    else if (!p.why_full.empty())
      kind = "full: " + p.why_full;
    // Waves: training waited while all but the last were written (snapshot.staging_gib).
    const std::string staged =
        waves.size() > 1
            ? fmt::format(" (staged in {} waves of at most {}: training waited for {})",
                          waves.size(), kernels::format_bytes(staging_floats * sizeof(float)),
                          waves.size() - 1)
            : "";
    spdlog::info(
        "snapshot step {} ({}): {} in {} shard(s), {:.1f}% of the {} a full uncompressed one "
        "takes; stall {:.1f} ms{}, write {:.1f} ms (slowest rank, {:.0f} MB/s), index {:.1f} ms "
        "-> {}{}",
        p.step, kind, kernels::format_bytes(t.bytes), info.shards.size(), 100 * share,
        kernels::format_bytes(t.raw), 1e3 * stall, staged, 1e3 * times[1],
        times[1] > 0 ? double(t.bytes) / times[1] / 1e6 : 0.0, 1e3 * t.index_s, last_good,
        t.deleted.empty() ? "" : "; removed " + fmt::format("{}", fmt::join(t.deleted, ", ")));
    if (metrics)
      metrics->write({{"snapshot_step", double(p.step)},
                      {"snapshot_ok", 1},
                      {"snapshot_incremental", p.incremental ? 1.0 : 0.0},
                      {"snapshot_waves", double(waves.size())},
                      {"snapshot_stall_s", stall},
                      {"snapshot_write_s", times[1]},
                      {"snapshot_bytes", double(t.bytes)},
                      {"snapshot_raw_bytes", double(t.raw)},
                      {"snapshot_share", share}});
  }

  void commit() {
    if (pending->copying) {
      Pending p = std::move(*pending);
      pending.reset();
      return commit_copies(p);
    }
    pending->done.wait();  // the job writes into *pending: finish before moving it
    Pending p = std::move(*pending);
    pending.reset();
    std::string error;
    try {
      p.done.get();
    } catch (const std::exception& e) {
      error = e.what();
    }
    const auto& world = mesh.world();
    const std::string shard = ck::shard_path(dir_of(p), p.step, mesh.rank());
    // Agree that every write succeeded before anything becomes visible.
    const int first_failed = publish_all(shard, error);
    if (first_failed != world.size()) {
      if (p.memory) return fail_memory(p, first_failed, error, shard);
      return fail(p, first_failed, error, shard);
    }

    const ck::ShardResult& res = p.result;
    const uint64_t report[kReport] = {mine.empty() ? 0u : 1u,
                                      res.digest.bytes,
                                      res.digest.hash,
                                      res.raw_bytes,
                                      uint64_t(res.chunks),
                                      uint64_t(res.chunks_written),
                                      uint64_t(res.chunks_unchanged)};
    std::vector<uint64_t> reports(kReport * static_cast<size_t>(world.size()));
    world.all_gather(report, reports.data(), kReport);
    double times[2] = {p.stall_s, p.write_s};
    world.all_reduce(times, 2, parallel::ReduceOp::max);
    if (p.memory) return commit_memory(p, reports, times);

    // Rank 0 writes the index; all ranks learn whether it committed, because the next
    // snapshot's parent (and whether it may be incremental) depends on it.
    ck::IndexInfo info;
    Totals totals = totals_of(reports);
    int committed = world.rank() == 0 ? write_index(p, reports, info, totals) : 0;
    world.broadcast(&committed, 1, 0);
    uint64_t id = info.id;
    world.broadcast(&id, 1, 0);
    if (!committed) return failed(p.step);
    failed_steps.clear();

    last_good = ck::index_path(dir, p.step);
    if (r.snapshot.full_every > 1) {
      // This snapshot becomes the parent: its chunk hashes are all the next one needs.
      const int64_t deltas = p.incremental ? parent->deltas + 1 : 0;
      const double unchanged =
          parent && totals.chunks ? double(totals.unchanged) / double(totals.chunks) : -1.0;
      parent = Parent{fs::path(last_good).filename().string(), id, std::move(p.result.hashes),
                      deltas, unchanged};
    }
    if (world.rank() == 0) log_commit(p, info, totals, times);
  }

  // A memory snapshot whose shard failed: dropped and said; neither the disk tier nor the run's
  // give-up count is touched (the previous memory snapshot stays the restart's).
  void fail_memory(const Pending& p, int first_failed, const std::string& error,
                   const std::string& shard) {
    ck::discard(shard);
    std::string message = error;
    mesh.world().broadcast(message, first_failed);
    if (mesh.rank() == 0)
      spdlog::error("memory snapshot at step {} failed on rank {}: {}; training continues", p.step,
                    first_failed, message);
  }

  // Collective, after every rank's shard of `p` is in its host's memory tier: starts the buddy
  // copies; the snapshot stays pending (copying) until a later step boundary finds them all
  // arrived, or the next snapshot or the end waits for them. With one host there are none.
  void commit_memory(Pending& p, const std::vector<uint64_t>& reports, const double times[2]) {
    // Every host's first rank writes the manifest: rank 0's content hashes go into each.
    int64_t hashes[2] = {tokenizer_hash_, data_hash_};
    mesh.world().broadcast(hashes, 2, 0);
    tokenizer_hash_ = hashes[0], data_hash_ = hashes[1];
    std::vector<int> writers;
    p.info = index_info(p, reports, &writers);
    mesh.world().broadcast(&p.info.id, 1, 0);
    tier->start_copies(p.info, writers);
    p.copying = true;
    p.stall_s = times[0], p.write_s = times[1];
    p.bytes = totals_of(reports).bytes;
    pending.emplace(std::move(p));
    if (!tier->ring().copies()) commit();
  }

  // Collective: the buddy copies of memory snapshot `p` arrived; commits it. Rank 0 says how it
  // went.
  void commit_copies(Pending& p) {
    double copy_s = 0;
    uint64_t copied = 0;
    const std::string error = tier->finish_commit(p.info, &copy_s, &copied);
    if (mesh.rank() != 0) return;
    if (!error.empty()) {
      spdlog::error("memory snapshot at step {} not committed: {}; training continues", p.step,
                    error);
      if (metrics)
        metrics->write({{"memory_snapshot_step", double(p.step)}, {"memory_snapshot_ok", 0}});
      return;
    }
    const uint64_t bytes = p.bytes;
    spdlog::info(
        "memory snapshot step {}: {} in {} shard(s) in /dev/shm; stall {:.1f} ms, write {:.1f} ms "
        "(slowest rank), buddy copies {}",
        p.step, kernels::format_bytes(bytes), p.info.shards.size(), 1e3 * p.stall_s,
        1e3 * p.write_s,
        copied ? fmt::format("{} to the next host, committed {:.1f} ms after they started",
                             kernels::format_bytes(copied), 1e3 * copy_s)
               : std::string("none (one host)"));
    if (metrics)
      metrics->write({{"memory_snapshot_step", double(p.step)},
                      {"memory_snapshot_ok", 1},
                      {"memory_snapshot_stall_s", p.stall_s},
                      {"memory_snapshot_write_s", p.write_s},
                      {"memory_snapshot_copy_s", copy_s},
                      {"memory_snapshot_bytes", double(bytes)}});
  }

  void fail(const Pending& p, int first_failed, const std::string& error,
            const std::string& shard) {
    ck::discard(shard);
    std::string message = error;
    mesh.world().broadcast(message, first_failed);
    if (mesh.rank() == 0) {
      spdlog::error(
          "snapshot at step {} failed on rank {}: {}. It was not committed; the last "
          "good snapshot is {}. Training continues.",
          p.step, first_failed, message, last_good.empty() ? "none" : last_good);
      if (metrics) metrics->write({{"snapshot_step", double(p.step)}, {"snapshot_ok", 0}});
    }
    failed(p.step);  // every rank: the give-up it may lead to is collective
  }

  // Snapshots that failed since the last commit (every rank agrees on them). A run whose
  // snapshots keep failing stops rather than train on with nothing saved.
  std::vector<int64_t> failed_steps;
  static constexpr size_t kMaxFailedInARow = 3;

  void failed(int64_t step) {
    failed_steps.push_back(step);
    if (failed_steps.size() >= kMaxFailedInARow) give_up("stopping the run");
  }

  // Collective; throws AgreedFailure (exit 2) with one message from rank 0.
  void give_up(const std::string& what) {
    agree_on(mesh.world(), [&] {
      if (mesh.rank() != 0) return;
      throw UserError(fmt::format(
          "snapshots failed at step(s) {} with none committed since (snapshot.dir = {}; the "
          "errors are above); {}: the training state since {} is not saved. Free space or fix "
          "snapshot.dir, then resume from the last good snapshot.",
          fmt::join(failed_steps, ", "), dir, what, last_good.empty() ? "the start" : last_good));
    });
  }
};

Snapshotter::Snapshotter(const Job& job, Model& model, const TrainingState& state,
                         MetricsWriter* metrics)
    : impl_(std::make_unique<Impl>(job, model, state, metrics)) {
  auto& m = *impl_;
  m.io = std::make_unique<ck::IoThread>();
  if (m.r.snapshot.memory_every > 0) {
    m.tier = std::make_unique<MemoryTier>(job, *m.io);
    if (!m.tier->enabled()) {
      m.tier.reset();
      if (m.mesh.rank() == 0)
        spdlog::warn(
            "snapshot.memory_every = {} ({}) is ignored: the memory tier serves the restarts of "
            "a self-launched job (titan3d train without mpirun or srun around it), and under "
            "an external launcher nothing restarts from it",
            m.r.snapshot.memory_every, m.r.origin("snapshot.memory_every"));
    }
  }
  // A memory snapshot is not taken where a disk one is: on multiples of snapshot.every alone
  // there would be none.
  if (m.tier && m.r.snapshot.every > 0 && m.r.snapshot.memory_every % m.r.snapshot.every == 0 &&
      m.mesh.rank() == 0)
    spdlog::warn(
        "snapshot.memory_every = {} is a multiple of snapshot.every = {}: every memory snapshot "
        "would fall on a disk snapshot's step, where none is taken, so the memory tier stays "
        "empty; set snapshot.memory_every below snapshot.every (e.g. snapshot.every / 10)",
        m.r.snapshot.memory_every, m.r.snapshot.every);
  if (m.r.snapshot.every <= 0) {
    if (m.mesh.rank() == 0 && m.r.train.steps > 0)
      spdlog::warn(
          "snapshot.every = 0 ({}): this run writes no snapshot{}, so what it trains is "
          "lost when it ends; set snapshot.every = N to keep it",
          m.r.origin("snapshot.every"), m.tier ? " to disk (only to the memory tier)" : "");
    if (!m.tier) return;
  } else {
    check_writable_dir(m.dir, m.r.origin("snapshot.dir"), m.mesh.rank());
    if (m.r.snapshot.deflate > 0) m.io->run(ck::require_deflate);
  }
  m.plan_staging();
}

// The I/O thread goes first: a write still running uses `staging`, `mine` and `pending`.
Snapshotter::~Snapshotter() { impl_->io.reset(); }

int64_t Snapshotter::restore() {
  auto& m = *impl_;
  if (m.r.snapshot.every > 0 || m.tier) m.reserve_staging();
  if (m.tier) {
    uint64_t mine = 0;
    for (const auto& b : m.mine) mine += 4 * static_cast<uint64_t>(kernels::numel(b.shape));
    // A shard is its floats and HDF5's metadata (a few kB per box).
    m.tier->start(mine + (mine ? 16384 * (m.mine.size() + 1) : 0));
  }
  return m.restore();
}

size_t Snapshotter::staging_bytes() const { return impl_->staging_floats * sizeof(float); }

void Snapshotter::after_step(int64_t steps_done, bool last) {
  auto& m = *impl_;
  const int64_t every = m.r.snapshot.every;
  if (every <= 0 && !m.tier) return;
  const bool due = every > 0 && (steps_done % every == 0 || last);
  const bool memory_due = m.tier && !due && steps_done % m.r.snapshot.memory_every == 0;
  if (m.pending && !due && m.all_ranks_done()) m.commit();
  if (due) {
    m.start(steps_done);
  } else if (memory_due) {
    // A disk snapshot still being written keeps the staging: rather than wait for it, this
    // memory snapshot is skipped (every rank alike: all_ranks_done agreed).
    if (!m.pending)
      m.start(steps_done, true);
    else if (m.mesh.rank() == 0)
      spdlog::info(
          "memory snapshot at step {} skipped: the snapshot of step {} is still being written",
          steps_done, m.pending->step);
  }
}

void Snapshotter::finish() {
  while (impl_->pending) impl_->commit();
  // The job ends (done, or stopped by a signal with its disk snapshot committed): the memory
  // tier does not outlive it.
  if (impl_->tier) impl_->tier->remove();
  // The run's last snapshot failed: its final state is lost, which is not a success.
  if (!impl_->failed_steps.empty()) impl_->give_up("the run ends without its final state");
}

}  // namespace t3d::runtime
