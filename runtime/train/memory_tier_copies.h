// The memory tier's side that needs the job (docs/resilience.md, "The memory tier"): which host
// keeps whose copy, the buddy copies over MPI, the commit of a memory snapshot, and at a restart
// the inventory of what survived, which brings into each living host's directory the shards its
// ranks read and indexes the snapshot there, so that the ordinary reader (resharding included)
// restores it. The files themselves are checkpoint/memory_tier_files.h's business; SnapshotWriter
// (snapshot_writer.h) writes the shards with its staging and I/O thread, as it does the disk
// tier's.
//
// The buddy ring: hosts in the order of their first world rank; every rank of host h sends its
// shard to the first rank of host h + 1 (mod hosts), which writes it into its own host's
// directory. With one host the buddy is that host itself, and there is no copy.
#pragma once

#include <cstdint>
#include <memory>
#include <string>
#include <vector>

#include "checkpoint/io_thread.h"
#include "checkpoint/snapshot.h"
#include "runtime/launch/job.h"

namespace t3d::runtime {

// Hosts of the job and the buddy ring over them.
struct HostRing {
  std::vector<int> host_of;  // host index of every world rank
  std::vector<int> leader;   // first world rank of every host
  std::vector<std::string> names;
  int buddy(int rank) const {
    return leader[static_cast<size_t>(host_of[rank] + 1) % leader.size()];
  }
  bool copies() const { return leader.size() > 1; }
};
HostRing host_ring(const std::vector<std::string>& host_of_rank);

// A file that moves from world rank `src` to world rank `dst`; each side resolves `file`
// (relative) in its own host's tier directory.
struct FileMove {
  int src = 0, dst = 0;
  std::string file;
  uint64_t bytes = 0;
};

// Restore: which of `shards` hold an element of one of `boxes` (what a rank restores), by the
// snapshot's catalog `pieces`.
std::vector<char> shards_read(const std::vector<checkpoint::ShardEntry>& shards,
                              const std::vector<checkpoint::ShardPiece>& pieces,
                              const std::vector<checkpoint::Slice>& boxes);
// Restore: the moves that bring into each host's directory the shards its ranks read and it
// lacks, each from the first rank whose host holds it. `held` (whether the rank's host holds the
// shard) and `read` (whether the rank reads it) are per world rank, then shard.
std::vector<FileMove> restore_moves(const HostRing& ring,
                                    const std::vector<checkpoint::ShardEntry>& shards,
                                    const std::vector<char>& held, const std::vector<char>& read);

class MemoryTier {
 public:
  // From T3D_MEMORY_TIER_JOB (the supervisor's job id); enabled() is false without it.
  MemoryTier(const Job& job, checkpoint::IoThread& io);
  ~MemoryTier();  // copies still moving (the job ends by an error) keep their buffers mapped
  MemoryTier(const MemoryTier&) = delete;
  MemoryTier& operator=(const MemoryTier&) = delete;
  bool enabled() const { return !job_id_.empty(); }
  // Whether this launch is the supervisor's relaunch after a failure (T3D_MEMORY_TIER_RESTORE).
  bool restoring() const { return restoring_; }
  const std::string& dir() const { return dir_; }
  bool leader() const;
  const HostRing& ring() const { return ring_; }

  // Collective, at start: removes this host's tier directories of jobs of the run directory that
  // no longer run (and, on a fresh start, this job's own), said in the log; creates this host's
  // directory; refuses the run (UserError, exit 2 on every rank) when /dev/shm cannot hold two
  // memory snapshots of this host's ranks and their buddies' copies (`mine_bytes`: this rank's
  // shard, about).
  void start(uint64_t mine_bytes);

  // Collective, after every rank published its own shard of `info.step` into its host's
  // directory: starts the buddy copies (`writers`: the world rank of each of info.shards), as
  // non-blocking sends and receives between files mapped in /dev/shm, so that training goes on
  // while they move (MPI moves them inside the step's own communication calls).
  void start_copies(const checkpoint::IndexInfo& info, const std::vector<int>& writers);
  // Whether this rank's copies have all left and arrived (never blocks; not collective).
  bool copies_done();
  // Collective: waits for what is still moving, then commits (the hosts' leaders write the
  // manifest) and keeps only this snapshot. Returns "" or the error that dropped the snapshot
  // (alike on every rank); `copy_s` and `copied`: the copies' time from start to end and bytes.
  std::string finish_commit(const checkpoint::IndexInfo& info, double* copy_s, uint64_t* copied);

  // Collective, at a restart: the newest memory snapshot complete among the living hosts, if it
  // is newer than `disk_step`, with the shards holding any of the hosts' ranks' `boxes` (what
  // each rank restores) brought into their host's directory, and its index written there.
  // Returns that index path (on this host) and fills step and id; "" with `why` (alike on every
  // rank) when the memory tier cannot be used.
  std::string prepare_restore(int64_t disk_step, const std::vector<checkpoint::Slice>& boxes,
                              int64_t* step, uint64_t* id, std::string* why);

  // This host's directory removed (after the job ended gracefully; collective: no rank still
  // reads it).
  void remove();

 private:
  // Moves `moves` (collective; every rank passes the same list). Returns "" or the first error.
  std::string move_files(const std::vector<FileMove>& moves);
  // Collective, at a restore: the catalog of `info`'s shards (which box of which tensor each
  // holds), read by each shard's `source` rank and shared, in the order of the shard list.
  // Returns "" or the agreed error.
  std::string share_catalog(const checkpoint::IndexInfo& info, const std::vector<int>& source,
                            std::vector<checkpoint::ShardPiece>* pieces);
  struct Copies;
  std::unique_ptr<Copies> copies_;  // the buddy copies of the snapshot being committed
  const Job& job_;
  checkpoint::IoThread& io_;
  std::string job_id_, dir_;
  bool restoring_ = false;
  HostRing ring_;
};

}  // namespace t3d::runtime
