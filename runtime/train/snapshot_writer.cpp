// Writing snapshots: the staged write, the commit agreement, the index, retention, and the
// memory tier's commit (snapshot_writer.h).
#include "runtime/train/snapshot_writer.h"

#include <spdlog/spdlog.h>

#include <chrono>
#include <filesystem>
#include <random>

#include "kernels/check.h"
#include "parallel/trace.h"
#include "runtime/launch/logging.h"
#include "runtime/machine/gemm_choice.h"
#include "runtime/provenance/provenance.h"
#include "runtime/train/memory_tier_copies.h"
#include "runtime/train/metrics.h"

namespace t3d::runtime {

namespace fs = std::filesystem;
namespace ck = checkpoint;
using Clock = std::chrono::steady_clock;

std::string snapshot_layout(const Recipe& r) {
  const auto& p = r.parallel;
  return fmt::format("pp={} dp={} cp={} tp={} ep={} zero={} schedule={} virtual_stages={}", p.pp,
                     p.dp, p.cp, p.tp, p.ep, p.zero, choice_name(p.schedule), p.virtual_stages);
}

SnapshotWriter::SnapshotWriter(const Job& job, SnapshotStaging& staging, ck::IoThread& io,
                               MemoryTier* tier, MetricsWriter* metrics, int64_t tokenizer_hash,
                               int64_t data_hash, std::string device)
    : job_(job),
      r_(job.recipe),
      mesh_(*job.mesh),
      dir_(job.recipe.snapshot.dir),
      staging_(staging),
      io_(io),
      tier_(tier),
      metrics_(metrics),
      tokenizer_hash_(tokenizer_hash),
      data_hash_(data_hash),
      device_(std::move(device)) {}

SnapshotWriter::~SnapshotWriter() = default;

void SnapshotWriter::finish() const {
  // The run's last snapshot failed: its final state is lost, which is not a success.
  if (!failed_steps_.empty()) give_up("the run ends without its final state");
}

// Whether the next snapshot is incremental, alike on every rank (`parent` changes only on
// commits, which all ranks agree on); otherwise why not, for the log ("" when no parent).
bool SnapshotWriter::incremental_next(std::string* why_full) const {
  if (!parent_) return false;
  if (parent_->deltas + 1 >= r_.snapshot.full_every) {
    *why_full =
        fmt::format("every {} snapshots one is full (snapshot.full_every)", r_.snapshot.full_every);
    return false;
  }
  const double pays = r_.snapshot.incremental_min_unchanged;
  if (pays > 0 && parent_->unchanged < pays) {
    *why_full = parent_->unchanged < 0 ? std::string("measuring what an incremental one would skip")
                                       : fmt::format(
                                             "only {:.1f}% of chunks were unchanged last time; an "
                                             "incremental snapshot pays from {:.0f}% "
                                             "(snapshot.incremental_min_unchanged)",
                                             100 * parent_->unchanged, 100 * pays);
    return false;
  }
  return true;
}

// The directory a snapshot goes to: snapshot.dir, or this host's memory tier.
const std::string& SnapshotWriter::dir_of(const Pending& p) const {
  return p.memory ? tier_->dir() : dir_;
}

// Starts the snapshot of `step` (into the memory tier with `memory`: the same shards, full and
// uncompressed, through the same staging and I/O thread).
void SnapshotWriter::start(int64_t step, bool memory) {
  const auto t0 = Clock::now();
  parallel::trace::Span span("snapshot staging", "io");
  // Training waits for the previous snapshot (a memory one may take two commits: its shards,
  // then its buddy copies): part of the stall.
  while (pending_) commit();
  pending_.emplace();
  Pending* p = &*pending_;
  p->step = step;
  p->memory = memory;
  p->incremental = !memory && incremental_next(&p->why_full);
  const std::string shard = ck::shard_path(dir_of(*p), step, mesh_.rank());
  ck::WriteOptions opt;
  opt.deflate = memory ? 0 : static_cast<int>(r_.snapshot.deflate);
  if (!memory) opt.fault = ck::fault_from_env(step, mesh_.rank());
  if (parent_ && !memory)
    opt.previous_hashes = &parent_->hashes, opt.skip_unchanged = p->incremental;
  // The jobs read the parent's hashes, which change only in commit(), after they end.
  const auto wave_job = [this, p, shard, opt](size_t w) {
    return [this, p, shard, opt, w] {
      const auto w0 = Clock::now();
      parallel::trace::Span write_span("snapshot write", "io");
      try {
        if (w == 0)
          p->writer = std::make_unique<ck::ShardWriter>(shard, mesh_.rank(), staging_.boxes(), opt);
        for (const SnapshotStaging::Part& part : staging_.waves()[w])
          p->writer->write(part.box, part.first, part.last, staging_.data() + part.at);
        if (w + 1 == staging_.waves().size()) p->result = p->writer->finish(), p->writer.reset();
      } catch (...) {
        p->writer.reset();  // abandons the temporary, which commit() discards
        throw;
      }
      p->write_s += seconds_since(w0);
    };
  };
  if (staging_.boxes().empty()) {
    p->done = io_.submit([] {});
  } else {
    // Every wave but the last is written before the next one overwrites the staging; a
    // failed one ends the snapshot, which commit() reports like any failed write.
    std::exception_ptr failed;
    for (size_t w = 0; w + 1 < staging_.waves().size() && !failed; ++w) {
      staging_.stage(w);
      staging_.wait_staged();
      try {
        io_.run(wave_job(w));
      } catch (...) {
        failed = std::current_exception();
      }
    }
    if (failed) {
      std::promise<void> broken;
      broken.set_exception(failed);
      p->done = broken.get_future();
    } else {
      // The last wave's copies run beside the next step's compute (on a GPU); the I/O thread
      // waits for them, the optimizer too (before_state_changes).
      staging_.stage(staging_.waves().size() - 1);
      p->done = io_.submit([this, job = wave_job(staging_.waves().size() - 1)] {
        staging_.wait_staged();
        job();
      });
    }
  }
  p->stall_s = seconds_since(t0);
  if (!r_.snapshot.async) commit();
}

bool SnapshotWriter::all_ranks_done() {
  int done = pending_->copying
                 ? tier_->copies_done()
                 : pending_->done.wait_for(std::chrono::seconds(0)) == std::future_status::ready;
  mesh_.world().all_reduce(&done, 1, parallel::ReduceOp::min);
  return done == 1;
}

// Agrees that every rank's write succeeded, then publishes the shards (collective). Returns the
// lowest failing world rank, or the world size when all succeeded; `error` holds this rank's.
int SnapshotWriter::publish_all(const std::string& shard, std::string& error) {
  const auto& world = mesh_.world();
  const int first_failed = first_failing_rank(world, !error.empty());
  if (first_failed != world.size()) return first_failed;
  if (!staging_.boxes().empty()) {
    try {
      ck::publish(shard);
    } catch (const std::exception& e) {
      error = e.what();
    }
  }
  // Every rank joins, writers or not (a rank may hold no box of its own).
  return first_failing_rank(world, !error.empty());
}

SnapshotWriter::Totals SnapshotWriter::totals_of(const std::vector<uint64_t>& reports) const {
  Totals t;
  for (int k = 0; k < mesh_.world().size(); ++k) {
    const uint64_t* rep = &reports[kReport * static_cast<size_t>(k)];
    t.bytes += rep[1], t.raw += rep[3], t.chunks += rep[4], t.written += rep[5];
    t.unchanged += rep[6];
  }
  return t;
}

ck::IndexInfo SnapshotWriter::index_info(const Pending& p, const std::vector<uint64_t>& reports,
                                         std::vector<int>* writers) const {
  ck::IndexInfo info;
  info.step = p.step;
  info.id = std::random_device{}() ^ (uint64_t(std::random_device{}()) << 32) ^ uint64_t(p.step);
  if (p.incremental) info.parent = parent_->name, info.parent_id = parent_->id;
  info.recipe = recipe_as_run(job_).to_toml();  // the job's precision, for resume and eval
  info.layout = snapshot_layout(r_);
  info.device = device_;
  info.gemm_table = job_.precision().gpu_gemm_table;  // a GPU's algorithms: resume runs them again
  info.counters = {{"step", p.step},
                   {"adamw_step", p.step},
                   {"sampler_seed", r_.train.seed},
                   {"sampler_step", p.step}};
  if (tokenizer_hash_ != 0) info.counters[kTokenizerHashCounter] = tokenizer_hash_;
  if (data_hash_ != 0) info.counters[kDataHashCounter] = data_hash_;
  for (int k = 0; k < mesh_.world().size(); ++k) {
    const uint64_t* rep = &reports[kReport * static_cast<size_t>(k)];
    if (!rep[0]) continue;
    const auto rel = fs::path(ck::shard_path(dir_, p.step, k)).lexically_relative(dir_);
    info.shards.push_back({rel.string(), rep[1], rep[2]});
    if (writers) writers->push_back(k);
  }
  return info;
}

bool SnapshotWriter::write_index(const Pending& p, const std::vector<uint64_t>& reports,
                                 ck::IndexInfo& info, Totals& t) {
  info = index_info(p, reports);
  const auto i0 = Clock::now();
  bool committed = false;
  try {
    std::string warning;
    io_.run([&] { warning = ck::write_index(dir_, info); });
    committed = true;  // durable and re-read
    if (!warning.empty()) spdlog::warn("snapshot at step {}: {}", p.step, warning);
  } catch (const std::exception& e) {
    // Its shards are referenced by nothing: free their space now (a full disk) rather than at
    // the next commit.
    std::error_code ec;
    fs::remove_all(fs::path(dir_) / ck::snapshot_name(p.step), ec);
    spdlog::error(
        "snapshot at step {}: writing the index failed: {}; it is not committed, {} "
        "stays the last good one",
        p.step, e.what(), last_good_.empty() ? "none" : last_good_);
    if (metrics_) metrics_->write({{"snapshot_step", double(p.step)}, {"snapshot_ok", 0}});
  }
  t.index_s = seconds_since(i0);
  if (committed) {
    try {  // a failing retention leaves old snapshots behind; it does not undo the commit
      io_.run([&] { t.deleted = ck::retain(dir_, r_.snapshot.keep); });
    } catch (const std::exception& e) {
      spdlog::warn("snapshot at step {}: removing older snapshots failed: {}", p.step, e.what());
    }
  }
  return committed;
}

// Rank 0: the committed snapshot's log line and metrics.
void SnapshotWriter::log_commit(const Pending& p, const ck::IndexInfo& info, const Totals& t,
                                const double times[2]) {
  // Synchronous snapshots: training also waited for the whole write.
  const double stall = r_.snapshot.async ? times[0] : times[0] + times[1];
  const double share = t.raw ? double(t.bytes) / double(t.raw) : 0.0;
  std::string kind = "full";
  if (p.incremental)
    kind = fmt::format("incremental on {}, {}/{} chunks changed", info.parent, t.written, t.chunks);
  else if (!p.why_full.empty())
    kind = "full: " + p.why_full;
  // Waves: training waited while all but the last were written (snapshot.staging_gib).
  const std::string staged =
      staging_.waves().size() > 1
          ? fmt::format(" (staged in {} waves of at most {}: training waited for {})",
                        staging_.waves().size(), kernels::format_bytes(staging_.bytes()),
                        staging_.waves().size() - 1)
          : "";
  spdlog::info(
      "snapshot step {} ({}): {} in {} shard(s), {:.1f}% of the {} a full uncompressed one "
      "takes; stall {:.1f} ms{}, write {:.1f} ms (slowest rank, {:.0f} MB/s), index {:.1f} ms "
      "-> {}{}",
      p.step, kind, kernels::format_bytes(t.bytes), info.shards.size(), 100 * share,
      kernels::format_bytes(t.raw), 1e3 * stall, staged, 1e3 * times[1],
      times[1] > 0 ? double(t.bytes) / times[1] / 1e6 : 0.0, 1e3 * t.index_s, last_good_,
      t.deleted.empty() ? "" : "; removed " + fmt::format("{}", fmt::join(t.deleted, ", ")));
  if (metrics_)
    metrics_->write({{"snapshot_step", double(p.step)},
                     {"snapshot_ok", 1},
                     {"snapshot_incremental", p.incremental ? 1.0 : 0.0},
                     {"snapshot_waves", double(staging_.waves().size())},
                     {"snapshot_stall_s", stall},
                     {"snapshot_write_s", times[1]},
                     {"snapshot_bytes", double(t.bytes)},
                     {"snapshot_raw_bytes", double(t.raw)},
                     {"snapshot_share", share}});
}

void SnapshotWriter::commit() {
  if (pending_->copying) {
    Pending p = std::move(*pending_);
    pending_.reset();
    return commit_copies(p);
  }
  // The job writes into *pending: finish before moving it. Its last wave waits for its copies;
  // waited for here too, on the thread that started them (with the device memory guarded, what
  // makes them: kernels::wait_for_copies).
  staging_.wait_staged();
  pending_->done.wait();
  Pending p = std::move(*pending_);
  pending_.reset();
  std::string error;
  try {
    p.done.get();
  } catch (const std::exception& e) {
    error = e.what();
  }
  const auto& world = mesh_.world();
  const std::string shard = ck::shard_path(dir_of(p), p.step, mesh_.rank());
  // Agree that every write succeeded before anything becomes visible.
  const int first_failed = publish_all(shard, error);
  if (first_failed != world.size()) {
    if (p.memory) return fail_memory(p, first_failed, error, shard);
    return fail(p, first_failed, error, shard);
  }

  const ck::ShardResult& res = p.result;
  const uint64_t report[kReport] = {staging_.boxes().empty() ? 0u : 1u,
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
  failed_steps_.clear();

  last_good_ = ck::index_path(dir_, p.step);
  if (r_.snapshot.full_every > 1) {
    // This snapshot becomes the parent: its chunk hashes are all the next one needs.
    const int64_t deltas = p.incremental ? parent_->deltas + 1 : 0;
    const double unchanged =
        parent_ && totals.chunks ? double(totals.unchanged) / double(totals.chunks) : -1.0;
    parent_ = Parent{fs::path(last_good_).filename().string(), id, std::move(p.result.hashes),
                     deltas, unchanged};
  }
  if (world.rank() == 0) log_commit(p, info, totals, times);
}

// A memory snapshot whose shard failed: dropped and said; neither the disk tier nor the run's
// give-up count is touched (the previous memory snapshot stays the restart's).
void SnapshotWriter::fail_memory(const Pending& p, int first_failed, const std::string& error,
                                 const std::string& shard) {
  ck::discard(shard);
  std::string message = error;
  mesh_.world().broadcast(message, first_failed);
  if (mesh_.rank() == 0)
    spdlog::error("memory snapshot at step {} failed on rank {}: {}; training continues", p.step,
                  first_failed, message);
}

// Collective, after every rank's shard of `p` is in its host's memory tier: starts the buddy
// copies; the snapshot stays pending (copying) until a later step boundary finds them all
// arrived, or the next snapshot or the end waits for them. With one host there are none.
void SnapshotWriter::commit_memory(Pending& p, const std::vector<uint64_t>& reports,
                                   const double times[2]) {
  // Every host's first rank writes the manifest: rank 0's content hashes go into each.
  int64_t hashes[2] = {tokenizer_hash_, data_hash_};
  mesh_.world().broadcast(hashes, 2, 0);
  tokenizer_hash_ = hashes[0], data_hash_ = hashes[1];
  std::vector<int> writers;
  p.info = index_info(p, reports, &writers);
  mesh_.world().broadcast(&p.info.id, 1, 0);
  tier_->start_copies(p.info, writers);
  p.copying = true;
  p.stall_s = times[0], p.write_s = times[1];
  p.bytes = totals_of(reports).bytes;
  pending_.emplace(std::move(p));
  if (!tier_->ring().copies()) commit();
}

// Collective: the buddy copies of memory snapshot `p` arrived; commits it. Rank 0 says how it
// went.
void SnapshotWriter::commit_copies(Pending& p) {
  double copy_s = 0;
  uint64_t copied = 0;
  const std::string error = tier_->finish_commit(p.info, &copy_s, &copied);
  if (mesh_.rank() != 0) return;
  if (!error.empty()) {
    spdlog::error("memory snapshot at step {} not committed: {}; training continues", p.step,
                  error);
    if (metrics_)
      metrics_->write({{"memory_snapshot_step", double(p.step)}, {"memory_snapshot_ok", 0}});
    return;
  }
  const uint64_t bytes = p.bytes;
  spdlog::info(
      "memory snapshot step {}: {} in {} shard(s) in /dev/shm; stall {:.1f} ms, write {:.1f} ms "
      "(slowest rank), buddy copies {}",
      p.step, kernels::format_bytes(bytes), p.info.shards.size(), 1e3 * p.stall_s, 1e3 * p.write_s,
      copied ? fmt::format("{} to the next host, committed {:.1f} ms after they started",
                           kernels::format_bytes(copied), 1e3 * copy_s)
             : std::string("none (one host)"));
  if (metrics_)
    metrics_->write({{"memory_snapshot_step", double(p.step)},
                     {"memory_snapshot_ok", 1},
                     {"memory_snapshot_stall_s", p.stall_s},
                     {"memory_snapshot_write_s", p.write_s},
                     {"memory_snapshot_copy_s", copy_s},
                     {"memory_snapshot_bytes", double(bytes)}});
}

void SnapshotWriter::fail(const Pending& p, int first_failed, const std::string& error,
                          const std::string& shard) {
  ck::discard(shard);
  std::string message = error;
  mesh_.world().broadcast(message, first_failed);
  if (mesh_.rank() == 0) {
    spdlog::error(
        "snapshot at step {} failed on rank {}: {}. It was not committed; the last "
        "good snapshot is {}. Training continues.",
        p.step, first_failed, message, last_good_.empty() ? "none" : last_good_);
    if (metrics_) metrics_->write({{"snapshot_step", double(p.step)}, {"snapshot_ok", 0}});
  }
  failed(p.step);  // every rank: the give-up it may lead to is collective
}

void SnapshotWriter::failed(int64_t step) {
  failed_steps_.push_back(step);
  if (failed_steps_.size() >= kMaxFailedInARow) give_up("stopping the run");
}

// Collective; throws AgreedFailure (exit 2) with one message from rank 0.
void SnapshotWriter::give_up(const std::string& what) const {
  agree_on(mesh_.world(), [&] {
    if (mesh_.rank() != 0) return;
    throw UserError(fmt::format(
        "snapshots failed at step(s) {} with none committed since (snapshot.dir = {}; the "
        "errors are above); {}: the training state since {} is not saved. Free space or fix "
        "snapshot.dir, then resume from the last good snapshot.",
        fmt::join(failed_steps_, ", "), dir_, what, last_good_.empty() ? "the start" : last_good_));
  });
}

}  // namespace t3d::runtime
