// Writing snapshots (Snapshotter, snapshots.h): staging a snapshot in waves (snapshot_staging.h),
// the asynchronous write on the I/O thread, the agreement that every rank's write succeeded,
// publishing the shards, rank 0's index (the commit) and retention; incremental snapshots on the
// last committed one; the memory tier's snapshots, committed once their buddy copies arrived
// (memory_tier_copies.h). A failed snapshot is dropped and said; three in a row end the run.
#pragma once

#include <cstdint>
#include <future>
#include <memory>
#include <optional>
#include <string>
#include <vector>

#include "checkpoint/io_thread.h"
#include "checkpoint/snapshot.h"
#include "runtime/launch/job.h"
#include "runtime/train/snapshot_staging.h"

namespace t3d::runtime {

class MemoryTier;
class MetricsWriter;

// The writer layout an index records (`/@layout`), e.g. "pp=2 dp=2 ... virtual_stages=1".
std::string snapshot_layout(const Recipe& r);

class SnapshotWriter {
 public:
  // `tier`: null without the memory tier; `metrics`: rank 0's writer (null elsewhere). The
  // content hashes are rank 0's (0: not recorded), taken once at the start of the run; `device`
  // is the rank's, recorded by rank 0's index.
  SnapshotWriter(const Job& job, SnapshotStaging& staging, checkpoint::IoThread& io,
                 MemoryTier* tier, MetricsWriter* metrics, int64_t tokenizer_hash,
                 int64_t data_hash, std::string device);
  ~SnapshotWriter();
  SnapshotWriter(const SnapshotWriter&) = delete;
  SnapshotWriter& operator=(const SnapshotWriter&) = delete;

  // The disk snapshot restored ("" none), the last good one until this run commits its own.
  void resumed(const std::string& last_good) { last_good_ = last_good; }

  // Collective. Starts the snapshot of `step` (into the memory tier with `memory`: the same
  // shards, full and uncompressed, through the same staging and I/O thread), first committing
  // the one still pending; training waits while it is staged. Synchronous snapshots
  // (snapshot.async = false) are committed before it returns.
  void start(int64_t step, bool memory = false);
  // Whether a snapshot is being written or copied (then its step), alike on every rank.
  bool pending() const { return pending_.has_value(); }
  int64_t pending_step() const { return pending_->step; }
  // Collective, never waits: whether the pending snapshot is written (or copied) on every rank.
  bool all_ranks_done();
  // Collective: waits for the pending snapshot, agrees that every rank's write succeeded and
  // commits it (a memory snapshot: starts its buddy copies; after those, its manifest). A
  // failure drops it, said by rank 0.
  void commit();
  // Collective: AgreedFailure (exit 2) when the run's last snapshot failed.
  void finish() const;

 private:
  // The last committed snapshot of this process, parent of the next incremental one. After a
  // start or resume there is none: the first snapshot is always a full base (it may go to
  // another directory, with another layout).
  struct Parent {
    std::string name;  // index file name
    uint64_t id = 0;
    std::vector<std::vector<uint64_t>> hashes;  // chunk hashes of each of the staged boxes
    int64_t deltas = 0;                         // incremental snapshots since its full base
    // Share of all ranks' chunks that had not changed since the snapshot before it; -1 when
    // there was none to compare with.
    double unchanged = -1;
  };
  struct Pending {
    int64_t step = 0;
    bool memory = false;  // a memory-tier snapshot (into tier_->dir(), always full, no deflate)
    // A memory snapshot whose shards are written and whose buddy copies are moving (MemoryTier::
    // start_copies); its index info, for the manifest that commits it.
    bool copying = false;
    checkpoint::IndexInfo info;
    uint64_t bytes = 0;  // of every rank's shard
    bool incremental = false;
    std::string why_full;  // when a parent exists but the snapshot is full: why
    std::unique_ptr<checkpoint::ShardWriter> writer;  // lives on the I/O thread between waves
    std::future<void> done;
    checkpoint::ShardResult result;  // set by the write job
    double stall_s = 0, write_s = 0;
  };
  // Every rank's shard summed, from the reports all ranks gathered (so alike everywhere).
  struct Totals {
    uint64_t bytes = 0, raw = 0, chunks = 0, written = 0, unchanged = 0;
    double index_s = 0;
    std::vector<std::string> deleted;
  };
  // Per rank: writes, bytes, hash, raw bytes, chunks, chunks written, chunks unchanged.
  static constexpr size_t kReport = 7;
  static constexpr size_t kMaxFailedInARow = 3;

  bool incremental_next(std::string* why_full) const;
  const std::string& dir_of(const Pending& p) const;
  int publish_all(const std::string& shard, std::string& error);
  Totals totals_of(const std::vector<uint64_t>& reports) const;
  // The index of snapshot `p` from every rank's report (the world rank of each shard in
  // `writers`); rank 0's counters.
  checkpoint::IndexInfo index_info(const Pending& p, const std::vector<uint64_t>& reports,
                                   std::vector<int>* writers = nullptr) const;
  // Rank 0: the index of snapshot `p` written (the commit) and older snapshots retired. Returns
  // whether it committed; a failure drops this snapshot only.
  bool write_index(const Pending& p, const std::vector<uint64_t>& reports,
                   checkpoint::IndexInfo& info, Totals& t);
  void log_commit(const Pending& p, const checkpoint::IndexInfo& info, const Totals& t,
                  const double times[2]);
  void fail_memory(const Pending& p, int first_failed, const std::string& error,
                   const std::string& shard);
  void commit_memory(Pending& p, const std::vector<uint64_t>& reports, const double times[2]);
  void commit_copies(Pending& p);
  void fail(const Pending& p, int first_failed, const std::string& error, const std::string& shard);
  // Every rank: a snapshot failed; kMaxFailedInARow in a row give up.
  void failed(int64_t step);
  // Collective; throws AgreedFailure (exit 2) with one message from rank 0.
  void give_up(const std::string& what) const;

  const Job& job_;
  const Recipe& r_;
  const parallel::Mesh& mesh_;
  const std::string& dir_;
  SnapshotStaging& staging_;
  checkpoint::IoThread& io_;
  MemoryTier* tier_;
  MetricsWriter* metrics_;
  // The content hash of data.tokenizer's model file (0: bytes) and of the training file (0: not
  // recorded), hashed once at the start: a file changed during the run does not change what the
  // snapshots record. Rank 0's, broadcast at a memory snapshot's commit.
  int64_t tokenizer_hash_ = 0, data_hash_ = 0;
  std::string device_;  // this rank's device, for the index
  std::optional<Parent> parent_;
  std::optional<Pending> pending_;
  std::string last_good_;  // index of the newest committed snapshot, for messages
  // Snapshots that failed since the last commit (every rank agrees on them). A run whose
  // snapshots keep failing stops rather than train on with nothing saved.
  std::vector<int64_t> failed_steps_;
};

}  // namespace t3d::runtime
