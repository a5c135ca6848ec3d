// Restoring a snapshot at start-up (snapshot_restore.h).
#include "runtime/train/snapshot_restore.h"

#include <spdlog/spdlog.h>

#include <chrono>
#include <cstdio>
#include <cstdlib>
#include <ctime>
#include <filesystem>

#include "checkpoint/snapshot.h"
#include "kernels/check.h"
#include "parallel/trace.h"
#include "runtime/launch/logging.h"
#include "runtime/provenance/provenance.h"
#include "runtime/train/memory_tier_copies.h"
#include "runtime/train/sharded_state.h"
#include "runtime/train/snapshot_writer.h"

namespace t3d::runtime {

namespace fs = std::filesystem;
namespace ck = checkpoint;
using Clock = std::chrono::steady_clock;

SnapshotRestore::SnapshotRestore(const Job& job, const TrainingState& state, ck::IoThread& io,
                                 MemoryTier* tier)
    : job_(job),
      r_(job.recipe),
      mesh_(*job.mesh),
      state_(state),
      io_(io),
      tier_(tier),
      dir_(job.recipe.snapshot.dir) {}

SnapshotRestore::Choice SnapshotRestore::resolve(int64_t before, int64_t* seen) {
  const std::string& want = r_.snapshot.resume;
  Choice c;
  const auto accept = [&](ck::SnapshotReader& reader) {
    check_same_model(reader.info().recipe, r_, reader.path(), "resume from");
    check_same_tokenizer(reader.info().counters, r_, reader.path(), "resume from");
    warn_if_data_changed(reader.info().counters, reader.info().recipe, r_, reader.path());
    for (const auto& change : changed_model_function(reader.info().recipe, r_, reader.path()))
      spdlog::warn("resuming {} with another model function: {}", reader.path(), change);
    c.step = reader.info().step;
    c.id = reader.info().id;
  };
  if (want != "latest") {
    io_.run([&] {
      ck::SnapshotReader reader(want);  // shards are checked by each rank as it reads them
      accept(reader);
    });
    c.path = want;
    return c;
  }
  std::vector<std::string> skipped;
  io_.run([&] {
    const auto steps = ck::committed_steps(dir_);
    *seen = std::max<int64_t>(*seen, static_cast<int64_t>(steps.size()));
    // Test hook: this rank's listing misses the newest snapshot, as a stale attribute cache of
    // a shared file system (or a snapshot committed just after listing) would have it.
    if (const char* stale = std::getenv("T3D_TEST_STALE_LISTING");
        stale && std::atoi(stale) == mesh_.rank() && !steps.empty())
      before = before < 0 ? steps.back() : std::min(before, steps.back());
    c.path = ck::find_latest(dir_, &skipped, before, accept);
  });
  for (const auto& why : skipped) spdlog::warn("snapshot.resume = latest: skipping {}", why);
  if (c.path.empty() && *seen > 0)
    throw UserError(fmt::format(
        "snapshot.resume = latest: none of the {} snapshot(s) in {} can be restored (the "
        "reasons are above); refusing to start from scratch over them. Resume a named good "
        "snapshot (snapshot.resume = PATH), move the damaged ones away, or set snapshot.resume "
        "= \"\" to start fresh on purpose.",
        *seen, dir_));
  if (c.path.empty() && !(tier_ && tier_->restoring()))  // else the memory tier's turn
    spdlog::info("snapshot.resume = latest: no snapshot in {}; starting fresh", dir_);
  return c;
}

void SnapshotRestore::load(const Choice& c, std::string* layout, std::string* device) {
  const auto boxes = state_.boxes(false);
  io_.run([&] {
    ck::SnapshotReader reader(c.path);
    const auto& info = reader.info();
    T3D_USER_CHECK(info.step == c.step && info.id == c.id, "snapshot `", c.path,
                   "` changed while the job started: rank 0 resolved step ", c.step, " (id ",
                   ck::to_hex(c.id), "), this rank reads step ", info.step, " (id ",
                   ck::to_hex(info.id), "). Is another job writing into ", dir_, "?");
    check_same_model(info.recipe, r_, c.path, "resume from");
    T3D_USER_CHECK(info.counters.count("step") && info.counters.at("step") == c.step, "snapshot `",
                   c.path,
                   "` has no step counter, or one that differs from its "
                   "step attribute");
    for (const auto& s : boxes) reader.read(s, state_.exec());
    *layout = info.layout;
    *device = info.device;
  });
}

int64_t SnapshotRestore::run(std::string* last_good) {
  const int64_t step = restore_chosen();
  set_aside_other_runs(step);
  *last_good = last_good_;
  return step;
}

// Collective. Committed snapshots in snapshot.dir that this run does not continue are moved
// into <snapshot.dir>/set-aside-<UTC time>/, said on rank 0: all of them on a fresh start or a
// resume of a snapshot from elsewhere, those after the resumed step when an explicit path in
// this directory is resumed. `latest` and retention then only ever see this run's lineage (an
// older run's step 40 is never resumed, nor kept over this run's step 20). With
// `snapshot.resume = latest` the newest good one was resumed and nothing moves (newer ones
// that failed to restore stay where the warnings above name them).
void SnapshotRestore::set_aside_other_runs(int64_t resumed_step) {
  if (r_.snapshot.every <= 0 || r_.snapshot.resume == "latest") return;
  agree_on(mesh_.world(), [&] {
    if (mesh_.rank() != 0) return;
    std::error_code ec;
    const bool from_here =
        !last_good_.empty() && fs::equivalent(fs::path(last_good_).parent_path(), dir_, ec);
    std::vector<int64_t> others;
    for (const int64_t step : ck::committed_steps(dir_))
      if (!from_here || step > resumed_step) others.push_back(step);
    if (others.empty()) return;
    const std::time_t now = std::time(nullptr);
    char stamp[32];
    std::strftime(stamp, sizeof(stamp), "%Y%m%dT%H%M%SZ", std::gmtime(&now));
    const std::string into = dir_ + "/set-aside-" + stamp;
    io_.run([&] { ck::set_aside(dir_, others, into); });
    spdlog::warn(
        "snapshot.dir {} held {} snapshot(s) this run does not continue (steps {}{}); "
        "moved them to {} so that `latest` and snapshot.keep see only this run's",
        dir_, others.size(), fmt::join(others, ", "),
        last_good_.empty() ? ", and this run starts fresh" : ", after " + last_good_, into);
  });
}

int64_t SnapshotRestore::restore_chosen() {
  if (r_.snapshot.resume.empty()) return 0;
  const auto& world = mesh_.world();
  const bool latest = r_.snapshot.resume == "latest";
  int64_t before = -1, seen = 0;
  const auto t0 = Clock::now();
  // A restart after a failure tries the memory tier first, when it is newer than the disk's
  // newest good snapshot; `tier_why` says why it was not used.
  bool try_memory = tier_ && tier_->restoring();
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
      m.path = tier_->prepare_restore(disk_step, state_.boxes(false), &m.step, &m.id, &tier_why);
      memory_step =
          m.path.empty() && tier_why.find("no complete") != std::string::npos ? -1 : m.step;
      if (!m.path.empty()) c = m, memory = true;
    }
    if (c.path.empty()) {
      if (tier_ && tier_->restoring() && mesh_.rank() == 0)
        spdlog::info(
            "snapshot.resume = latest: no snapshot in {} nor in the memory tier ({}); "
            "starting fresh",
            dir_, tier_why);
      record_restore("disk", 0, disk_step, memory_step, tier_why);
      return 0;
    }
    std::string error, layout, device;
    bool internal = false;  // every rank must reach the agreement below, whatever it threw
    try {
      load(c, &layout, &device);
    } catch (const UserError& e) {
      error = e.what();
    } catch (const std::exception& e) {
      error = e.what(), internal = true;
    }
    const int first_failed = first_failing_rank(world, !error.empty());
    if (first_failed == world.size()) {
      // Every rank says what it restored (ranks > 0 into their own logs).
      spdlog::info("resumed from {} after step {}{}{} in {:.1f} s{}", c.path, c.step,
                   layout == snapshot_layout(r_)
                       ? ""
                       : fmt::format(" (resharded: {} -> {})", layout, snapshot_layout(r_)),
                   device.empty() ? "" : ", written on " + device, seconds_since(t0),
                   !tier_ ? ""
                   : memory
                       ? " (tier: memory)"
                       : fmt::format(" (tier: disk{})", tier_why.empty() ? "" : ": " + tier_why));
      if (!memory) last_good_ = c.path;
      record_restore(memory ? "memory" : "disk", c.step, disk_step, memory_step, tier_why);
      return c.step;
    }
    if (memory) {
      // The memory tier's snapshot cannot be read on some rank: the disk tier's newest it is.
      world.broadcast(error, first_failed);
      tier_why = fmt::format("restoring the memory tier's step {} failed on rank {}: {}", c.step,
                             first_failed, error);
      if (mesh_.rank() == 0) spdlog::warn("{}; falling back to the disk tier", tier_why);
      continue;
    }
    // An explicit snapshot that fails is an error (the failing rank's message, once).
    if (!latest)
      agree_on(world, [&] {
        if (internal) throw InternalError(error);
        if (!error.empty()) throw UserError(error);
      });
    world.broadcast(error, first_failed);
    if (mesh_.rank() == 0)
      spdlog::warn("snapshot.resume = latest: skipping {}: rank {} cannot restore it: {}", c.path,
                   first_failed, error);
    before = c.step;
  }
}

// Rank 0 of a restart after a failure with the memory tier on: which tier the job resumed from
// (step 0: none, a fresh start), and why not the memory tier, as a line of incidents.jsonl
// (docs/resilience.md) after the supervisor's incident.
void SnapshotRestore::record_restore(const char* used, int64_t step, int64_t disk_step,
                                     int64_t memory_step, const std::string& why) {
  if (!tier_ || !tier_->restoring() || mesh_.rank() != 0) return;
  append_incident(
      job_.run_dir,
      fmt::format("\"event\": \"restore\", \"tier\": \"{}\", \"snapshot_step\": {}, "
                  "\"disk_step\": {}, \"memory_step\": {}, \"why\": {}",
                  used, step, disk_step, memory_step,
                  parallel::trace::json_string(std::string(used) == "memory" ? "" : why)));
}

}  // namespace t3d::runtime
