// Writing side of snapshots: shards, publication and the index (commit record); what a snapshot
// directory keeps is retention.cpp.
#include <fcntl.h>
#include <unistd.h>

#include <algorithm>
#include <csignal>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <filesystem>
#include <map>
#include <sstream>

#include "checkpoint/h5.h"
#include "checkpoint/h5_direct_driver.h"
#include "checkpoint/snapshot.h"
#include "kernels/arena.h"
#include "kernels/check.h"

namespace t3d::checkpoint {

namespace fs = std::filesystem;

std::string snapshot_name(int64_t step) {
  char s[32];
  std::snprintf(s, sizeof(s), "step_%08lld", static_cast<long long>(step));
  return s;
}
std::string index_path(const std::string& dir, int64_t step) {
  return dir + "/" + snapshot_name(step) + ".h5";
}
std::string shard_path(const std::string& dir, int64_t step, int rank) {
  char s[32];
  std::snprintf(s, sizeof(s), "rank%05d.h5", rank);
  return dir + "/" + snapshot_name(step) + "/" + s;
}
std::string temp_path(const std::string& path) { return path + ".tmp"; }

int64_t chunk_elems(const std::vector<int64_t>& shape) {
  int64_t n = 1;
  for (int64_t d : shape) n *= d;
  if (shape.size() < 2) return std::clamp<int64_t>(n, 1, kChunkElems);
  const int64_t cols = std::max<int64_t>(1, shape[1]);
  return std::clamp<int64_t>(kChunkElems / cols, 1, std::max<int64_t>(1, shape[0])) * cols;
}

Fault fault_from_env(int64_t step, int rank) {
  const char* env = std::getenv("T3D_SNAPSHOT_FAULT");
  if (!env) return {};
  char kind[8] = {};
  long long s = -1;
  int r = -1;
  if (std::sscanf(env, "%7[a-z]:%lld:%d", kind, &s, &r) != 3 || s != step || r != rank) return {};
  return {std::strcmp(kind, "kill") == 0, std::strcmp(kind, "fail") == 0};
}

namespace {

void fsync_path(const std::string& path, bool directory) {
  const int fd = ::open(path.c_str(), directory ? O_RDONLY | O_DIRECTORY : O_RDONLY);
  T3D_USER_CHECK(fd >= 0, "cannot open `", path, "` to sync it: ", std::strerror(errno));
  const int rc = ::fsync(fd);
  const int err = errno;
  ::close(fd);
  T3D_USER_CHECK(rc == 0, "fsync of `", path, "` failed: ", std::strerror(err));
}

void rename_durably(const std::string& from, const std::string& to) {
  std::error_code ec;
  fs::rename(from, to, ec);
  T3D_USER_CHECK(!ec, "cannot rename `", from, "` to `", to, "`: ", ec.message());
  fsync_path(fs::path(to).parent_path().string(), true);
}

// Writes `bytes` to `path` (created or truncated), fsyncs and closes it, checking each step: a
// full disk is reported here, never left as a short or empty file. Removes `path` on failure.
void write_file_durably(const std::string& path, const char* bytes, size_t size) {
  const int fd = ::open(path.c_str(), O_WRONLY | O_CREAT | O_TRUNC | O_CLOEXEC, 0644);
  T3D_USER_CHECK(fd >= 0, "cannot create `", path, "`: ", std::strerror(errno));
  int err = 0;
  for (size_t done = 0; done < size && !err;) {
    const ssize_t n = ::write(fd, bytes + done, size - done);
    if (n < 0 && errno != EINTR) err = errno;
    if (n > 0) done += static_cast<size_t>(n);
  }
  if (!err && ::fsync(fd) != 0) err = errno;
  if (::close(fd) != 0 && !err) err = errno;
  if (err) {
    ::unlink(path.c_str());
    throw UserError(detail::concat("cannot write `", path, "`: ", std::strerror(err)));
  }
}

// Chunked layout (the chunks the hashes describe) for a box an incremental shard may leave
// partial, or that is deflated (shuffle + deflate); contiguous otherwise, which the writer streams
// in large pieces.
h5::Handle create_plist(const Slice& s, int64_t chunk, int deflate, bool chunked,
                        const std::string& where) {
  h5::Handle dcpl(T3D_H5(H5Pcreate(H5P_DATASET_CREATE), where), H5Pclose);
  if (!chunked) {
    T3D_H5(H5Pset_fill_time(dcpl, H5D_FILL_TIME_NEVER), where);  // every byte is written
    return dcpl;
  }
  std::vector<hsize_t> dims(s.shape.begin(), s.shape.end());
  if (dims.size() == 1)
    dims[0] = static_cast<hsize_t>(chunk);
  else
    dims[0] = static_cast<hsize_t>(chunk / s.shape[1]);
  T3D_H5(H5Pset_chunk(dcpl, static_cast<int>(dims.size()), dims.data()), where);
  const float zero = 0.0f;
  T3D_H5(H5Pset_fill_value(dcpl, H5T_NATIVE_FLOAT, &zero), where);
  if (deflate > 0) {
    T3D_H5(H5Pset_shuffle(dcpl), where);
    T3D_H5(H5Pset_deflate(dcpl, static_cast<unsigned>(deflate)), where);
  }
  return dcpl;
}

// File selection of elements [begin, end) of a box, which are whole rows of a 2-D box (chunk
// boundaries, or the box's end).
h5::Handle rows_space(hid_t dset, const std::vector<int64_t>& shape, int64_t begin, int64_t end,
                      const std::string& what) {
  std::vector<hsize_t> start(shape.size(), 0), count(shape.begin(), shape.end());
  const int64_t cols = shape.size() == 1 ? 1 : shape[1];
  start[0] = static_cast<hsize_t>(begin / cols),
  count[0] = static_cast<hsize_t>((end - begin) / cols);
  h5::Handle space(T3D_H5(H5Dget_space(dset), what), H5Sclose);
  T3D_H5(H5Sselect_hyperslab(space, H5S_SELECT_SET, start.data(), nullptr, count.data(), nullptr),
         what);
  return space;
}

}  // namespace

struct ShardWriter::Impl {
  std::string tmp;
  int rank = 0;
  std::vector<Slice> boxes;
  WriteOptions opt;
  ShardFileLog log;  // before `file`, which writes into it until it closes
  h5::Handle file, lcpl;
  ShardResult result;
  std::string names;
  std::map<std::string, int> seen;  // per tensor path: boxes of it begun so far
  // The box being written.
  size_t box = 0;
  int64_t next_chunk = 0;
  h5::Handle dset;
  std::vector<uint64_t> hashes;
  std::vector<int64_t> written;  // chunk indices stored in this shard
  std::vector<float> padded;     // a box's last, partial chunk for a direct chunk write
  bool finished = false;

  int64_t chunk_of(size_t i) const { return chunk_elems(boxes[i].shape); }
  int64_t chunks_of(size_t i) const {
    const int64_t n = kernels::numel(boxes[i].shape), chunk = chunk_of(i);
    return std::max<int64_t>(1, (n + chunk - 1) / chunk);
  }
  bool chunked() const { return opt.skip_unchanged || opt.deflate > 0; }

  void begin_box(size_t i) {
    const Slice& s = boxes[i];
    T3D_ASSERT(s.shape.size() == s.offset.size() && s.shape.size() == s.global_shape.size() &&
                   !s.shape.empty() && s.shape.size() <= 2,
               "slice ", s.path, " has inconsistent ranks");
    T3D_ASSERT(!opt.previous_hashes ||
                   (*opt.previous_hashes)[i].size() == static_cast<size_t>(chunks_of(i)),
               "previous snapshot's box of ", s.path, " differs");
    if (i == boxes.size() / 2 && opt.fault.kill) std::raise(SIGKILL);
    T3D_USER_CHECK(!(i == boxes.size() / 2 && opt.fault.fail), "cannot write `", tmp,
                   "`: injected write failure (T3D_SNAPSHOT_FAULT)");
    const std::string what = tmp + ":" + s.path;
    const h5::Handle space = h5::simple_space(s.shape);
    const h5::Handle dcpl = create_plist(s, chunk_of(i), opt.deflate, chunked(), what);
    // Anonymous until the box is complete: its name says whether it holds every chunk.
    dset = h5::Handle(T3D_H5(H5Dcreate_anon(file, H5T_IEEE_F32LE, space, dcpl, H5P_DEFAULT), what),
                      H5Dclose);
    box = i, next_chunk = 0;
    hashes.clear(), written.clear();
  }

  // Stores chunks [first, last) of the current box, all of which are to be written.
  void store(int64_t first, int64_t last, const float* data) {
    const Slice& s = boxes[box];
    const std::string what = tmp + ":" + s.path;
    const int64_t n = kernels::numel(s.shape), chunk = chunk_of(box);
    const int64_t begin = first * chunk, end = std::min(n, last * chunk);
    if (!chunked() || opt.deflate > 0) {  // one write; HDF5 applies the filters per chunk
      const h5::Handle fspace = rows_space(dset, s.shape, begin, end, what);
      const h5::Handle mspace = h5::simple_space({end - begin});
      T3D_H5(H5Dwrite(dset, H5T_NATIVE_FLOAT, mspace, fspace, H5P_DEFAULT, data), what);
      return;
    }
    // Stored as is: the chunk's bytes go to the file without HDF5's chunk cache or a copy.
    const int64_t cols = s.shape.size() == 1 ? 1 : s.shape[1];
    for (int64_t c = first; c < last; ++c) {
      const int64_t len = std::min(chunk, n - c * chunk);
      const float* at = data + (c - first) * chunk;
      if (len < chunk) {  // the stored chunk has the full chunk shape
        padded.assign(static_cast<size_t>(chunk), 0.0f);
        std::memcpy(padded.data(), at, static_cast<size_t>(len) * sizeof(float));
        at = padded.data();
      }
      std::vector<hsize_t> origin(s.shape.size(), 0);
      origin[0] = static_cast<hsize_t>(c * chunk / cols);
      T3D_H5(H5Dwrite_chunk(dset, H5P_DEFAULT, 0, origin.data(),
                            static_cast<size_t>(chunk) * sizeof(float), at),
             what);
    }
  }

  void end_box() {
    const Slice& s = boxes[box];
    const std::string what = tmp + ":" + s.path;
    const int64_t chunks = chunks_of(box);
    const bool whole = static_cast<int64_t>(written.size()) == chunks;
    // A ZeRO rank may hold up to three boxes of one tensor (partial row, rows, partial row):
    // the second and third get a suffix, which the index strips (kBoxSuffix).
    const int k = seen[s.path]++;
    std::string name = (whole ? "" : kChangedPrefix) + s.path;
    if (k) name.append(kBoxSuffix).append(std::to_string(k));
    h5::write_attr(dset, "global_shape", s.global_shape);
    h5::write_attr(dset, "offset", s.offset);
    h5::write_attr(dset, "chunk_elems", chunk_of(box));
    h5::write_attr(dset, "chunk_hash", hashes);  // of the content, whatever is stored
    if (!whole) {  // 1 for a chunk stored here, 0 for one to take from the parent
      std::vector<int64_t> mask(static_cast<size_t>(chunks), 0);
      for (const int64_t c : written) mask[static_cast<size_t>(c)] = 1;
      h5::write_attr(dset, "chunk_written", mask);
    }
    T3D_H5(H5Olink(dset, file, name.c_str(), lcpl, H5P_DEFAULT), what);
    dset.close(what);
    names += (names.empty() ? "" : "\n") + name;
    result.hashes.push_back(std::move(hashes));
    hashes = {};
    result.raw_bytes += static_cast<uint64_t>(kernels::numel(s.shape)) * sizeof(float);
    result.chunks += chunks;
    result.chunks_written += static_cast<int64_t>(written.size());
    ++box, next_chunk = 0;
  }

  void write(size_t i, int64_t first, int64_t last, const float* data) {
    T3D_ASSERT(!finished && i == box && i < boxes.size(), "shard boxes out of order");
    if (dset.get() < 0) begin_box(i);
    T3D_ASSERT(i == box && first == next_chunk && first < last && last <= chunks_of(i),
               "shard chunks out of order in ", boxes[i].path);
    const int64_t n = kernels::numel(boxes[i].shape), chunk = chunk_of(i);
    // Runs of chunks to store: an incremental shard leaves out the unchanged ones.
    int64_t run = first;
    for (int64_t c = first; c < last; ++c) {
      const int64_t len = std::min(chunk, n - c * chunk);
      const float* at = data + (c - first) * chunk;
      const uint64_t h = hash64(at, static_cast<size_t>(len) * sizeof(float));
      hashes.push_back(h);
      const bool unchanged = opt.previous_hashes && (*opt.previous_hashes)[i][c] == h;
      result.chunks_unchanged += unchanged;
      if (unchanged && opt.skip_unchanged) {
        if (run < c) store(run, c, data + (run - first) * chunk);
        run = c + 1;
        continue;
      }
      written.push_back(c);
    }
    if (run < last) store(run, last, data + (run - first) * chunk);
    next_chunk = last;
    if (last == chunks_of(i)) end_box();
  }
};

ShardWriter::ShardWriter(const std::string& path, int rank, std::vector<Slice> boxes,
                         const WriteOptions& options)
    : impl_(std::make_unique<Impl>()) {
  auto& m = *impl_;
  m.tmp = temp_path(path), m.rank = rank, m.boxes = std::move(boxes), m.opt = options;
  T3D_ASSERT(!m.opt.previous_hashes || m.opt.previous_hashes->size() == m.boxes.size(),
             "previous snapshot's hashes do not match the shard's boxes");
  T3D_ASSERT(!m.opt.skip_unchanged || m.opt.previous_hashes,
             "an incremental shard needs its parent's hashes");
  std::error_code ec;
  fs::create_directories(fs::path(path).parent_path(), ec);
  T3D_USER_CHECK(!ec && fs::is_directory(fs::path(path).parent_path()),
                 "cannot create snapshot directory `", fs::path(path).parent_path().string(),
                 "`: ", ec ? ec.message() : "a file of that name is in the way");
  // Stored as is, a box takes its elements (contiguous) or its whole chunks (the last padded);
  // deflated, about that or less (a hint: writes past it extend the file).
  for (size_t i = 0; i < m.boxes.size(); ++i)
    m.log.size_hint +=
        sizeof(float) * static_cast<uint64_t>(m.chunked() ? m.chunks_of(i) * m.chunk_of(i)
                                                          : kernels::numel(m.boxes[i].shape));
  m.file = h5::create_file(m.tmp, [&m](hid_t fapl) { use_shard_driver(fapl, &m.log); });
  m.lcpl = h5::intermediate_groups();
}

ShardWriter::~ShardWriter() {
  auto& m = *impl_;
  if (m.finished || m.file.get() < 0) return;
  m.dset = {};  // every object closed first: the file refuses to close with one open
  m.lcpl = {};
  m.file.abandon_file(m.tmp);  // the caller discards the temporary
}

int64_t ShardWriter::chunks(size_t i) const { return impl_->chunks_of(i); }
int64_t ShardWriter::chunk_elems_of(size_t i) const { return impl_->chunk_of(i); }

void ShardWriter::write(size_t i, int64_t first, int64_t last, const float* data) {
  impl_->write(i, first, last, data);
}

ShardResult ShardWriter::finish() {
  auto& m = *impl_;
  T3D_ASSERT(m.box == m.boxes.size() && m.dset.get() < 0, "shard `", m.tmp,
             "` finished with boxes missing");
  h5::write_attr(m.file, "format_version", kFormatVersion);
  h5::write_attr(m.file, "rank", static_cast<int64_t>(m.rank));
  h5::write_attr(m.file, "tensors", m.names);
  m.lcpl = {};
  try {
    // Every object is closed: a full disk fails this flush, before the close.
    T3D_H5(H5Fflush(m.file, H5F_SCOPE_LOCAL), m.tmp);
  } catch (...) {
    m.file.abandon_file(m.tmp);
    m.finished = true;
    throw;
  }
  m.finished = true;
  try {
    m.file.close(m.tmp);
  } catch (...) {
    if (::truncate(m.tmp.c_str(), 0) != 0) {
    }  // frees its space even if HDF5 still holds the file; the caller discards it
    throw;
  }
  fsync_path(m.tmp, false);
  m.result.digest = m.log.digest.finish(m.tmp, &m.result.read_back_bytes);
  m.result.direct_bytes = m.log.direct_bytes;
  return std::move(m.result);
}

ShardResult write_shard(const std::string& path, int rank, const std::vector<Slice>& slices,
                        const WriteOptions& opt) {
  ShardWriter w(path, rank, slices, opt);
  for (size_t i = 0; i < slices.size(); ++i) w.write(i, 0, w.chunks(i), slices[i].data);
  return w.finish();
}

void require_deflate() {
  const std::pair<H5Z_filter_t, const char*> filters[] = {{H5Z_FILTER_SHUFFLE, "shuffle"},
                                                          {H5Z_FILTER_DEFLATE, "deflate"}};
  for (const auto& [filter, name] : filters) {
    unsigned config = 0;
    const bool ok = H5Zfilter_avail(filter) > 0 && H5Zget_filter_info(filter, &config) >= 0 &&
                    (config & H5Z_FILTER_CONFIG_ENCODE_ENABLED);
    T3D_USER_CHECK(
        ok, "snapshot.deflate > 0 needs HDF5's ", name, " filter, which this HDF5 library (",
        H5_VERS_INFO,
        ") cannot encode with: use an HDF5 built with zlib, or set snapshot.deflate = 0");
  }
}

void publish(const std::string& path) {
  try {
    rename_durably(temp_path(path), path);
  } catch (...) {
    discard(path);
    throw;
  }
}

void discard(const std::string& path) {
  std::error_code ec;
  fs::remove(temp_path(path), ec);
}

namespace {

// One virtual dataset per global tensor, so h5py and h5dump see whole tensors; its mapping is
// also the catalog SnapshotReader uses (it reads the shards itself, never through the VDS,
// whose missing sources read as fill values without an error).
void write_virtual_datasets(hid_t index, const std::vector<ShardPiece>& pieces_of_shards,
                            const std::string& where) {
  std::map<std::string, std::vector<const ShardPiece*>> tensors;  // by path: a stable index
  for (const auto& p : pieces_of_shards)
    tensors[p.path.substr(0, p.path.find(kBoxSuffix))].push_back(&p);
  const h5::Handle lcpl = h5::intermediate_groups();
  for (const auto& [path, pieces] : tensors) {
    const h5::Handle dcpl(T3D_H5(H5Pcreate(H5P_DATASET_CREATE), where), H5Pclose);
    const h5::Handle vspace = h5::simple_space(pieces.front()->global_shape);
    for (const ShardPiece* p : pieces) {
      T3D_USER_CHECK(p->global_shape == pieces.front()->global_shape,
                     "shards disagree on the shape of ", path, " (", p->file, ")");
      const std::vector<hsize_t> start(p->offset.begin(), p->offset.end());
      const std::vector<hsize_t> count(p->shape.begin(), p->shape.end());
      T3D_H5(
          H5Sselect_hyperslab(vspace, H5S_SELECT_SET, start.data(), nullptr, count.data(), nullptr),
          where);
      const h5::Handle src = h5::simple_space(p->shape);
      T3D_H5(H5Pset_virtual(dcpl, vspace, p->file.c_str(), p->path.c_str(), src), where);
    }
    T3D_H5(H5Sselect_all(vspace), where);
    const h5::Handle d(
        T3D_H5(H5Dcreate2(index, path.c_str(), H5T_IEEE_F32LE, vspace, lcpl, dcpl, H5P_DEFAULT),
               where + ":" + path),
        H5Dclose);
  }
}

}  // namespace

std::vector<ShardPiece> shard_pieces(const std::string& dir, const std::string& file) {
  const std::string shard_file = dir + "/" + file;
  const h5::Handle f = h5::open_file(shard_file);
  std::vector<ShardPiece> pieces;
  std::istringstream names(h5::read_string_attr(f, "tensors", shard_file));
  for (std::string path; std::getline(names, path);) {
    const std::string what = shard_file + ":" + path;
    const h5::Handle d = h5::open_dataset(f, path, shard_file);
    ShardPiece p{file,
                 path,
                 h5::read_ints_attr(d, "global_shape", what),
                 h5::read_ints_attr(d, "offset", what),
                 {}};
    const h5::Handle space(T3D_H5(H5Dget_space(d), shard_file), H5Sclose);
    T3D_USER_CHECK(H5Sget_simple_extent_ndims(space) == static_cast<int>(p.offset.size()) &&
                       p.offset.size() == p.global_shape.size(),
                   "snapshot shard `", shard_file, "`: `", path, "` has inconsistent ranks");
    std::vector<hsize_t> dims(p.offset.size());
    T3D_H5(H5Sget_simple_extent_dims(space, dims.data(), nullptr), shard_file);
    p.shape.assign(dims.begin(), dims.end());
    pieces.push_back(std::move(p));
  }
  return pieces;
}

std::string write_index(const std::string& dir, const IndexInfo& info,
                        const std::vector<ShardPiece>* pieces) {
  const std::string path = index_path(dir, info.step), tmp = temp_path(path);
  T3D_USER_CHECK(!info.shards.empty(), "snapshot ", path, " has no shards");
  // Built in memory: HDF5 never writes to the disk, so a full disk is an error of our own checked
  // write below, and no half-flushed HDF5 file is left open in the library.
  std::vector<char> image;
  {
    h5::Handle f = h5::create_memory_file(tmp);
    h5::write_attr(f, "format_version", kFormatVersion);
    h5::write_attr(f, "step", info.step);
    h5::write_attr(f, "recipe", info.recipe);
    h5::write_attr(f, "layout", info.layout);
    if (!info.device.empty()) h5::write_attr(f, "device", info.device);
    if (!info.gemm_table.empty()) h5::write_attr(f, "gemm_table", info.gemm_table);
    h5::write_attr(f, "id", std::vector<uint64_t>{info.id});
    h5::write_attr(f, "parent", info.parent);
    if (!info.parent.empty()) h5::write_attr(f, "parent_id", std::vector<uint64_t>{info.parent_id});
    std::string files;
    std::vector<int64_t> bytes;
    std::vector<uint64_t> hashes;
    for (const auto& s : info.shards) {
      files += (files.empty() ? "" : "\n") + s.file;
      bytes.push_back(static_cast<int64_t>(s.bytes));
      hashes.push_back(s.hash);
    }
    h5::write_attr(f, "shard_files", files);
    h5::write_attr(f, "shard_bytes", bytes);
    h5::write_attr(f, "shard_hash", hashes);
    {
      h5::Handle state(T3D_H5(H5Gcreate2(f, "state", H5P_DEFAULT, H5P_DEFAULT, H5P_DEFAULT), tmp),
                       H5Gclose);
      for (const auto& [key, value] : info.counters) h5::write_attr(state, key, value);
      state.close(tmp + ":/state");
    }
    std::vector<ShardPiece> read;
    if (!pieces)
      for (const auto& shard : info.shards)
        for (auto& p : shard_pieces(dir, shard.file)) read.push_back(std::move(p));
    write_virtual_datasets(f, pieces ? *pieces : read, tmp);
    h5::write_attr(f, "complete", int64_t{1});  // last: the commit mark
    image = h5::file_image(f, tmp);
    f.close(tmp);
  }
  // The trailer: the index's own hash, checked before HDF5 parses it (read_verified_index).
  const uint64_t len = image.size(), hash = hash64(image.data(), image.size());
  image.insert(image.end(), kIndexMagic, kIndexMagic + 8);
  for (const uint64_t v : {len, hash})
    for (int i = 0; i < 8; ++i) image.push_back(static_cast<char>(v >> (8 * i) & 0xff));
  write_file_durably(tmp, image.data(), image.size());
  try {
    SnapshotReader check(tmp);  // re-read from the disk: the bytes and the structure
  } catch (...) {
    discard(path);
    throw;
  }
  std::error_code ec;
  fs::rename(tmp, path, ec);
  if (ec) discard(path);
  T3D_USER_CHECK(!ec, "cannot rename `", tmp, "` to `", path, "`: ", ec.message());
  try {
    fsync_path(dir, true);
  } catch (...) {
    fs::remove(path, ec);  // not durable, so not committed: the caller drops its shards
    throw;
  }
  // `latest` is a hint for people and scripts; readers list the directory instead.
  const std::string latest = dir + "/latest", name = fs::path(path).filename().string() + "\n";
  try {
    write_file_durably(temp_path(latest), name.data(), name.size());
    rename_durably(temp_path(latest), latest);
  } catch (const UserError& e) {
    discard(latest);
    return std::string("could not update `") + latest +
           "` (it still names an older snapshot): " + e.what();
  }
  return "";
}

}  // namespace t3d::checkpoint
