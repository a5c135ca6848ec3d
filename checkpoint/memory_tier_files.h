// The memory tier's files (docs/snapshot-format.md, "The memory tier"): snapshots in the disk
// format, kept in a per-job, per-host directory of /dev/shm, so that they outlive the job's
// processes (a failure ends every rank) but not the host, nor the job (the supervisor and the
// ranks remove them when the job ends).
//
//   /dev/shm/titan3d-<job id>-<host>/step_00000120/rank00003.h5   a shard, as on disk
//   /dev/shm/titan3d-<job id>-<host>/step_00000120.manifest       the commit record
//   /dev/shm/titan3d-<job id>-<host>/step_00000120.h5             the index, written at restore
//
// A host's directory holds its own ranks' shards and the buddy copies of another host's; the
// index of a memory snapshot is written only when a restart restores it, once every shard has
// been brought into that host's directory (write_index reads them all). Until then the manifest
// (step, id, recipe, layout, counters and every shard's size and hash: an index without its
// catalog of pieces) is what commits it. The job id is `<run key>-<nonce>`: the run key names the
// run directory, the nonce the job (chosen by the supervisor, kept across its restarts).
#pragma once

#include <cstdint>
#include <optional>
#include <string>
#include <vector>

#include "checkpoint/snapshot.h"

namespace t3d::checkpoint {

// /dev/shm.
std::string memory_tier_root();
// "<root>/titan3d-<job id>-<host>".
std::string memory_tier_dir(const std::string& job_id, const std::string& host);
// The part of every job id of one run directory (16 hex digits of its absolute path's hash).
std::string memory_tier_run_key(const std::string& run_dir);
// A fresh job id of run directory `run_dir`: "<run key>-<8 random hex digits>".
std::string new_memory_tier_job_id(const std::string& run_dir);
// Removes every directory of the root named titan3d-<job_prefix>*, of host `host` only (named
// ...-<host>; "" any host), except those named titan3d-<except>* (`except` empty: none); returns
// their paths. Never throws (what cannot be removed stays, and is not returned).
std::vector<std::string> remove_memory_tiers(const std::string& job_prefix,
                                             const std::string& host = "",
                                             const std::string& except = "");
// Free bytes of the file system holding the root (statvfs); test hook T3D_TEST_SHM_AVAILABLE
// (bytes) stands in for it.
uint64_t memory_tier_free_bytes();

std::string manifest_path(const std::string& dir, int64_t step);
// Writes `info` as step info.step's manifest, atomically (a temporary renamed into place).
void write_manifest(const std::string& dir, const IndexInfo& info);
// The manifest of `step` (nullopt when missing or unreadable).
std::optional<IndexInfo> read_manifest(const std::string& dir, int64_t step);
// The manifest's text and its parse, for sending a manifest to a host that lacks it.
std::string manifest_text(const IndexInfo& info);
std::optional<IndexInfo> parse_manifest(const std::string& text);
// Steps of the manifests in `dir`, ascending.
std::vector<int64_t> manifest_steps(const std::string& dir);
// Removes everything in `dir` but step `keep`'s manifest, index and shard directory, and the
// shard directory of step `writing` (-1: none). Never throws.
void retain_memory_snapshot(const std::string& dir, int64_t keep, int64_t writing = -1);

}  // namespace t3d::checkpoint
