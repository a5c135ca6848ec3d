// A run's snapshots: the parts meet here (snapshots.h). Restoring is SnapshotRestore
// (snapshot_restore.h), writing and committing SnapshotWriter (snapshot_writer.h), the host
// memory they stage in SnapshotStaging (snapshot_staging.h); the file format lives in
// checkpoint/, the memory tier's copies and inventory in memory_tier_copies.h.
#include "runtime/train/snapshots.h"

#include <spdlog/spdlog.h>

#include <cerrno>
#include <cstdio>
#include <cstring>
#include <filesystem>

#include "checkpoint/io_thread.h"
#include "checkpoint/snapshot.h"
#include "kernels/check.h"
#include "runtime/provenance/provenance.h"
#include "runtime/train/memory_tier_copies.h"
#include "runtime/train/snapshot_restore.h"
#include "runtime/train/snapshot_staging.h"
#include "runtime/train/snapshot_writer.h"

namespace t3d::runtime {

namespace fs = std::filesystem;
namespace ck = checkpoint;

namespace {

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

}  // namespace

struct Snapshotter::Impl {
  const Job& job;
  const Recipe& r;
  Model& model;
  const TrainingState& state;
  std::unique_ptr<ck::IoThread> io;
  // The memory tier (memory_tier_copies.h): null when snapshot.memory_every = 0 or not
  // self-launched.
  std::unique_ptr<MemoryTier> tier;
  // Both null without snapshots (snapshot.every = 0 and no memory tier).
  std::unique_ptr<SnapshotStaging> staging;
  std::unique_ptr<SnapshotWriter> writer;

  Impl(const Job& j, Model& m, const TrainingState& st)
      : job(j), r(j.recipe), model(m), state(st) {}
};

Snapshotter::Snapshotter(const Job& job, Model& model, const TrainingState& state,
                         MetricsWriter* metrics, const std::string& device)
    : impl_(std::make_unique<Impl>(job, model, state)) {
  auto& m = *impl_;
  const int rank = job.mesh->rank();
  // The content hashes of the data and the tokenizer at the start (rank 0), for every snapshot.
  const int64_t tokenizer = rank == 0 ? tokenizer_hash(m.r) : 0;
  const int64_t data = rank == 0 && m.r.snapshot.every > 0 ? data_hash(m.r) : 0;
  m.io = std::make_unique<ck::IoThread>();
  if (m.r.snapshot.memory_every > 0) {
    m.tier = std::make_unique<MemoryTier>(job, *m.io);
    if (!m.tier->enabled()) {
      m.tier.reset();
      if (rank == 0)
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
      rank == 0)
    spdlog::warn(
        "snapshot.memory_every = {} is a multiple of snapshot.every = {}: every memory snapshot "
        "would fall on a disk snapshot's step, where none is taken, so the memory tier stays "
        "empty; set snapshot.memory_every below snapshot.every (e.g. snapshot.every / 10)",
        m.r.snapshot.memory_every, m.r.snapshot.every);
  if (m.r.snapshot.every <= 0) {
    if (rank == 0 && m.r.train.steps > 0)
      spdlog::warn(
          "snapshot.every = 0 ({}): this run writes no snapshot{}, so what it trains is "
          "lost when it ends; set snapshot.every = N to keep it",
          m.r.origin("snapshot.every"), m.tier ? " to disk (only to the memory tier)" : "");
    if (!m.tier) return;
  } else {
    check_writable_dir(m.r.snapshot.dir, m.r.origin("snapshot.dir"), rank);
    if (m.r.snapshot.deflate > 0) m.io->run(ck::require_deflate);
  }
  m.staging = std::make_unique<SnapshotStaging>(m.r, state);
  m.writer = std::make_unique<SnapshotWriter>(job, *m.staging, *m.io, m.tier.get(), metrics,
                                              tokenizer, data, device);
}

// The I/O thread goes first: a write still running uses the staging and the pending snapshot.
Snapshotter::~Snapshotter() { impl_->io.reset(); }

int64_t Snapshotter::restore() {
  auto& m = *impl_;
  if (m.staging) m.staging->reserve(m.job, m.model, m.state);
  if (m.tier) {
    uint64_t mine = 0;
    const auto& boxes = m.staging->boxes();
    for (const auto& b : boxes) mine += 4 * static_cast<uint64_t>(kernels::numel(b.shape));
    // A shard is its floats and HDF5's metadata (a few kB per box).
    m.tier->start(mine + (mine ? 16384 * (boxes.size() + 1) : 0));
  }
  std::string last_good;
  const int64_t step = SnapshotRestore(m.job, m.state, *m.io, m.tier.get()).run(&last_good);
  if (m.writer) m.writer->resumed(last_good);
  return step;
}

size_t Snapshotter::staging_bytes() const { return impl_->staging ? impl_->staging->bytes() : 0; }

void Snapshotter::after_step(int64_t steps_done, bool last) {
  auto& m = *impl_;
  const int64_t every = m.r.snapshot.every;
  if (every <= 0 && !m.tier) return;
  SnapshotWriter& w = *m.writer;
  const bool due = every > 0 && (steps_done % every == 0 || last);
  const bool memory_due = m.tier && !due && steps_done % m.r.snapshot.memory_every == 0;
  if (w.pending() && !due && w.all_ranks_done()) w.commit();
  if (due) {
    w.start(steps_done);
  } else if (memory_due) {
    // A disk snapshot still being written keeps the staging: rather than wait for it, this
    // memory snapshot is skipped (every rank alike: all_ranks_done agreed).
    if (!w.pending())
      w.start(steps_done, true);
    else if (m.job.mesh->rank() == 0)
      spdlog::info(
          "memory snapshot at step {} skipped: the snapshot of step {} is still being written",
          steps_done, w.pending_step());
  }
}

void Snapshotter::before_state_changes() const {
  if (impl_->staging) impl_->staging->before_state_changes();
}

void Snapshotter::finish() {
  auto& m = *impl_;
  while (m.writer && m.writer->pending()) m.writer->commit();
  // The job ends (done, or stopped by a signal with its disk snapshot committed): the memory
  // tier does not outlive it.
  if (m.tier) m.tier->remove();
  if (m.writer) m.writer->finish();
}

}  // namespace t3d::runtime
