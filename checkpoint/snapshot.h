// HDF5 snapshots of training state: per-rank shard files of global logical tensors, joined by a
// small index file that is the commit record. The format is documented in docs/snapshot-format.md.
//
//   <dir>/step_00000010.h5              index: recipe, layout, counters, shard digests, and one
//                                       virtual dataset per global tensor mapping its pieces
//   <dir>/step_00000010/rank00003.h5    shard: the slices rank 3 wrote, with global offsets
//   <dir>/latest                        name of the newest committed index (a convenience)
//
// Incremental snapshots: every tensor box is cut into fixed-size chunks with a content hash each.
// An incremental snapshot names its parent (the previous snapshot of the same run) and stores
// only the chunks whose hash changed; a box missing some chunks sits under changed/... with a
// mask of those it holds. Restore starts from the newest level holding a box whole and copies the
// newer levels' chunks over it, checking every chunk's content hash on the way, so it is
// bit-exact or refused. The writer needs the parent's chunk hashes only, not its bytes.
//
// This layer knows tensors and files, not the trainer or MPI: runtime/train/snapshots.cpp decides
// who writes what and agrees across ranks before anything is published. Every function here calls
// HDF5 and so must run on the process's IoThread.
#pragma once

#include <cstdint>
#include <functional>
#include <map>
#include <memory>
#include <optional>
#include <string>
#include <vector>

#include "checkpoint/hash.h"
#include "kernels/exec.h"

namespace t3d::checkpoint {

// Version 2 stores an incremental shard's changed chunks as values (`changed/...`); version 1
// stored XOR masks (`xor/...`), which are still read.
inline constexpr int64_t kFormatVersion = 2;
inline constexpr int64_t kOldestFormatVersion = 1;
// An incremental shard's box that holds only some of its chunks (those listed in its
// `chunk_written` attribute) is stored under this prefix, so that no tool takes it for values.
inline constexpr const char* kChangedPrefix = "changed/";
// A shard's second and third box of one tensor are datasets `<path>~1`, `<path>~2` (a ZeRO rank's
// owned range cut into a partial row, whole rows and a partial row); `~` is in no tensor name.
inline constexpr const char* kBoxSuffix = "~";
// Elements per content hash (at most; see chunk_elems): 1 MiB of fp32, small enough that a
// damaged chunk is located and an unchanged one skipped, large enough for deflate.
inline constexpr int64_t kChunkElems = 1 << 18;

// A box of a global tensor (fp32, row-major, at most 2-D) and the memory holding it.
struct Slice {
  std::string path;  // dataset path, e.g. "model/model.norm.weight", "optim/exp_avg/lm_head.weight"
  std::vector<int64_t> global_shape;
  std::vector<int64_t> offset;  // of the box in the global tensor, per dimension
  std::vector<int64_t> shape;   // of the box; `data` holds prod(shape) floats
  float* data = nullptr;
};

// Elements per chunk of a box: whole rows of a 2-D box (about kChunkElems), so that a chunk of the
// flat box is also a rectangular HDF5 chunk of the dataset, which is what lets an incremental
// snapshot write, compress and skip exactly the chunks the hashes describe.
int64_t chunk_elems(const std::vector<int64_t>& shape);

// File names inside a snapshot directory.
std::string snapshot_name(int64_t step);  // "step_00000010"
std::string index_path(const std::string& dir, int64_t step);
std::string shard_path(const std::string& dir, int64_t step, int rank);
std::string temp_path(const std::string& path);  // where a file is written before its rename

// Test-only fault injection, read from T3D_SNAPSHOT_FAULT="kill|fail:STEP:RANK": that rank, in
// that step's shard write, SIGKILLs itself (a crash mid-write) or fails like a full disk.
struct Fault {
  bool kill = false, fail = false;
};
Fault fault_from_env(int64_t step, int rank);

// Fails (UserError) unless HDF5 can encode with the shuffle and deflate filters.
void require_deflate();

struct WriteOptions {
  int deflate = 0;  // zlib level 1-9 after the shuffle filter; 0: stored as is
  // The previous snapshot's chunk hashes of the same boxes (same order), or null. With them the
  // writer counts the chunks that did not change (ShardResult::chunks_unchanged); with
  // `skip_unchanged` it also leaves them out: an incremental shard, whose missing chunks are
  // read from the parent snapshot.
  const std::vector<std::vector<uint64_t>>* previous_hashes = nullptr;
  bool skip_unchanged = false;
  Fault fault;
};

struct ShardResult {
  FileDigest digest;                          // of the file written
  std::vector<std::vector<uint64_t>> hashes;  // content hash of every chunk, per box
  uint64_t raw_bytes = 0;                     // of the state the shard holds (4 per element)
  int64_t chunks = 0, chunks_written = 0;     // an incremental shard skips unchanged chunks
  int64_t chunks_unchanged = 0;               // hash equal to the previous snapshot's
  // How it was written (checkpoint/h5_direct_driver.h): bytes that went to the device with
  // O_DIRECT, and bytes read back for the digest (those the writes did not cover in whole blocks).
  uint64_t direct_bytes = 0, read_back_bytes = 0;
};

// Host staging of one rank's snapshot, bytes: all it writes (`snapshot_bytes`) when that fits
// the cap, else the cap: `staging_gib`, or half the rank's training state (params, grads and
// optimizer state) when 0. The trainer and the planner both size it here.
inline double staging_bytes(double staging_gib, double training_state_bytes,
                            double snapshot_bytes) {
  const double cap = staging_gib > 0 ? staging_gib * double(1 << 30) : 0.5 * training_state_bytes;
  return cap < snapshot_bytes ? cap : snapshot_bytes;
}

// One rank's shard, written in pieces: the caller may stage its state in waves smaller than the
// shard (snapshot.staging_gib) and hand each wave over as it comes. Every call runs on the I/O
// thread (HDF5). Destroyed unfinished, it leaves only its temporary, which the caller discards.
class ShardWriter {
 public:
  // Creates temp_path(path). `boxes`: the shard's boxes in write order (their data is not read).
  ShardWriter(const std::string& path, int rank, std::vector<Slice> boxes,
              const WriteOptions& options = {});
  ~ShardWriter();
  ShardWriter(const ShardWriter&) = delete;
  ShardWriter& operator=(const ShardWriter&) = delete;

  int64_t chunks(size_t box) const;          // chunks of box `box` (at least 1)
  int64_t chunk_elems_of(size_t box) const;  // elements per chunk of it (chunk_elems)
  // Writes chunks [first, last) of box `box`, whose values start at `data`. Boxes come in
  // order and each box's chunks in order, every chunk once.
  void write(size_t box, int64_t first, int64_t last, const float* data);
  // Closes, fsyncs and hashes the file; every box must be complete.
  ShardResult finish();

 private:
  struct Impl;
  std::unique_ptr<Impl> impl_;
};

// A whole shard in one call: writes the boxes' data to temp_path(path), closes and fsyncs it.
ShardResult write_shard(const std::string& path, int rank, const std::vector<Slice>& slices,
                        const WriteOptions& options = {});
// Renames temp_path(path) to `path` and fsyncs its directory. Removes the temporary on failure.
void publish(const std::string& path);
void discard(const std::string& path);  // removes temp_path(path) if it exists; never throws

struct ShardEntry {
  std::string file;  // relative to the snapshot directory
  uint64_t bytes = 0, hash = 0;
};

struct IndexInfo {
  int64_t step = 0;
  std::string recipe;  // effective recipe, TOML
  std::string layout;  // e.g. "pp=2 dp=2 cp=1 tp=2", informational
  // Rank 0's device (kernels::Device::description: "cpu" or the GPU), informational; "" in
  // snapshots written before it was recorded.
  std::string device;
  // The GEMM algorithms of a GPU run (kernels/cuda/gemm_table.h's text), so that resume runs the
  // same ones; "" on the CPU and in snapshots written before it was recorded.
  std::string gemm_table;
  std::map<std::string, int64_t> counters;  // step, sampler seed/position, AdamW step...
  std::vector<ShardEntry> shards;
  std::string parent;  // index file name in the same directory; "" for a full snapshot
  // Unique per snapshot; a child records its parent's, so that a parent replaced by another
  // snapshot of the same step (a later run in the same directory) is not taken for it.
  uint64_t id = 0, parent_id = 0;
};

// The index's own integrity record, kept outside its HDF5 structure so that it is checked before
// HDF5 parses a byte: the index file is the HDF5 image followed by a trailer of kIndexTrailer
// bytes, the magic kIndexMagic, the image's length and its hash64 (both u64 little-endian). HDF5
// ignores bytes past its end of file, so h5py and h5dump still read the index.
inline constexpr const char kIndexMagic[9] = "T3DIDXH1";
inline constexpr size_t kIndexTrailer = 24;

// The HDF5 image of index `path`, read whole and checked against its trailer; UserError naming
// the file and what is wrong (no trailer, truncated, a flipped byte) otherwise.
std::vector<char> read_verified_index(const std::string& path);
std::vector<char> read_verified_index(const ReadOnlyFile& index);

// A box of a global tensor as a shard file stores it: the index's catalog entry.
struct ShardPiece {
  std::string file;  // the shard, relative to the snapshot directory
  std::string path;  // its dataset (a second or third box of a tensor: `<tensor>~1`, `~2`)
  std::vector<int64_t> global_shape, offset, shape;
};
// The pieces of shard `file` of the snapshot directory `dir`, read from the file.
std::vector<ShardPiece> shard_pieces(const std::string& dir, const std::string& file);

// Builds the index in memory with `complete` set last, writes it with its trailer under a
// temporary name (every write, fsync and close checked), re-reads and verifies it, renames it into
// place and fsyncs the directory: when this returns the snapshot is committed and durable. Then
// points <dir>/latest at it (written aside and renamed, so it is never empty); a failure there is
// returned as a warning ("" when fine), since the commit stands. Shards must be published.
// `pieces`: the catalog of every shard, when some shard files are not in `dir` (the memory
// tier's hosts hold only the shards their ranks read); null: read from the shards.
std::string write_index(const std::string& dir, const IndexInfo& info,
                        const std::vector<ShardPiece>* pieces = nullptr);

// The step a name snapshot_name(step) + `suffix` stands for ("step_00000012.h5" with ".h5": 12);
// nullopt for any other name.
std::optional<int64_t> step_of(const std::string& name, const std::string& suffix);
// Steps of the entries of `dir` named snapshot_name(step) + `suffix`, ascending; none when `dir`
// cannot be listed.
std::vector<int64_t> steps_named(const std::string& dir, const std::string& suffix);
// Steps of the committed snapshots (an index file exists) in `dir`, ascending. Not verified.
std::vector<int64_t> committed_steps(const std::string& dir);

// Moves the snapshots of `steps` (index, shard directory, temporary files) from `dir` into the
// new directory `into` (its parent must be `dir`), so that listing, `latest` and retention in
// `dir` no longer see them; chains among the moved ones stay readable there. `latest` goes too
// when it names a moved one. UserError naming the file that cannot be moved.
void set_aside(const std::string& dir, const std::vector<int64_t>& steps, const std::string& into);

// Deletes all but the newest `keep` committed snapshots and the ancestors they need (index
// first, so a half-deleted one is never taken for complete), and shard directories without an
// index older than the newest committed one (left by crashes). Returns the names deleted.
std::vector<std::string> retain(const std::string& dir, int64_t keep);

// A committed snapshot, opened for reading. The constructor checks the index (complete mark,
// format version) and those of its ancestors (present, the very parent recorded); each shard
// file is checked against its index's size and hash the first time a read needs it, and every
// chunk, rebuilt along the chain, against its content hash. Any mismatch is a UserError naming
// the file and what is wrong: a snapshot is never loaded silently.
class SnapshotReader {
 public:
  explicit SnapshotReader(const std::string& index_path);
  ~SnapshotReader();
  SnapshotReader(const SnapshotReader&) = delete;
  SnapshotReader& operator=(const SnapshotReader&) = delete;

  const IndexInfo& info() const;
  const std::string& path() const;
  // Fills slice.data, memory of `into` (the arena's Exec, or kernels::kCpu for a host buffer),
  // with the box slice.offset/shape of the global tensor slice.path, gathered from whichever
  // pieces cover it (any writer layout: this is resharding). Pieces are rebuilt and their hashes
  // checked in host memory; each row of the box then crosses once (kernels::copy_from_host).
  void read(const Slice& slice, const kernels::Exec& into);
  // Checks every shard file of the snapshot and its ancestors now, rather than when first read.
  void verify();
  // Index paths of the chain, full base first, this snapshot last.
  std::vector<std::string> chain() const;

 private:
  struct Impl;
  std::unique_ptr<Impl> impl_;
};

// Reads only the recipe text of a snapshot (cheap; for `titan3d resume` before ranks start).
std::string read_recipe(const std::string& index_path);
// Reads only IndexInfo::gemm_table of a snapshot ("" when it has none).
std::string read_gemm_table(const std::string& index_path);

// The newest snapshot in `dir` older than step `before` (-1: any) whose index and shards verify
// and that `accept` (if given) does not throw on, or "" when there is none. Broken ones are
// skipped, each with its reason appended to `skipped`.
std::string find_latest(const std::string& dir, std::vector<std::string>* skipped,
                        int64_t before = -1,
                        const std::function<void(SnapshotReader&)>& accept = nullptr);

}  // namespace t3d::checkpoint
