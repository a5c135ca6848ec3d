// Writing side of snapshots: shards, publication, the index (commit record) and retention.
#include <fcntl.h>
#include <unistd.h>

#include <algorithm>
#include <csignal>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <filesystem>
#include <fstream>
#include <map>
#include <optional>
#include <regex>
#include <set>
#include <sstream>

#include "checkpoint/h5.h"
#include "checkpoint/snapshot.h"
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

int64_t volume(const std::vector<int64_t>& shape) {
  int64_t n = 1;
  for (int64_t d : shape) n *= d;
  return n;
}

// Chunked layout (the chunks the hashes describe), shuffle + deflate when asked, fill value 0 so
// that a chunk an incremental snapshot skipped reads as an all-zero XOR mask.
h5::Handle create_plist(const Slice& s, int64_t chunk, int deflate, bool chunked,
                        const std::string& where) {
  h5::Handle dcpl(T3D_H5(H5Pcreate(H5P_DATASET_CREATE), where), H5Pclose);
  if (!chunked) return dcpl;
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

// Writes slice `i`: whole, or (incremental) only its changed chunks as XOR against the parent.
void write_slice(hid_t file, hid_t lcpl, const std::vector<Slice>& slices, size_t i,
                 const std::string& dataset, const WriteOptions& opt, ShardResult& result,
                 const std::string& where) {
  const Slice& s = slices[i];
  T3D_ASSERT(s.shape.size() == s.offset.size() && s.shape.size() == s.global_shape.size() &&
                 !s.shape.empty() && s.shape.size() <= 2,
             "slice ", s.path, " has inconsistent ranks");
  const int64_t n = volume(s.shape), chunk = chunk_elems(s.shape);
  const int64_t chunks = std::max<int64_t>(1, (n + chunk - 1) / chunk);
  std::vector<uint64_t> hashes(static_cast<size_t>(chunks));
  for (int64_t c = 0; c < chunks; ++c) {
    const int64_t len = std::min(chunk, n - c * chunk);
    hashes[c] = hash64(s.data + c * chunk, static_cast<size_t>(len) * sizeof(float));
  }
  const bool incremental = opt.parent != nullptr;
  const std::string name = (incremental ? "xor/" : "") + dataset;
  const std::string what = where + ":" + name;
  const h5::Handle space = h5::simple_space(s.shape);
  const h5::Handle dcpl = create_plist(s, chunk, opt.deflate, incremental || opt.deflate > 0, what);
  const h5::Handle dset(
      T3D_H5(H5Dcreate2(file, name.c_str(), H5T_IEEE_F32LE, space, lcpl, dcpl, H5P_DEFAULT), what),
      H5Dclose);
  int64_t written = chunks;
  if (!incremental) {
    T3D_H5(H5Dwrite(dset, H5T_NATIVE_FLOAT, H5S_ALL, H5S_ALL, H5P_DEFAULT, s.data), what);
  } else {
    const Slice& p = (*opt.parent)[i];
    const auto& old = (*opt.parent_hashes)[i];
    T3D_ASSERT(p.path == s.path && p.shape == s.shape && p.offset == s.offset &&
                   old.size() == hashes.size(),
               "incremental snapshot: parent box of ", s.path, " differs");
    std::vector<float> delta(static_cast<size_t>(std::min(chunk, n)));
    written = 0;
    for (int64_t c = 0; c < chunks; ++c) {
      const int64_t len = std::min(chunk, n - c * chunk);
      const float* now = s.data + c * chunk;
      const float* before = p.data + c * chunk;
      // The hash rules out most unchanged chunks cheaply; memcmp makes "unchanged" exact.
      if (hashes[c] == old[c] && std::memcmp(now, before, static_cast<size_t>(len) * 4) == 0)
        continue;
      xor_floats(now, before, delta.data(), len);
      std::vector<hsize_t> start(s.shape.size(), 0), count(s.shape.begin(), s.shape.end());
      if (s.shape.size() == 1) {
        start[0] = static_cast<hsize_t>(c * chunk), count[0] = static_cast<hsize_t>(len);
      } else {
        start[0] = static_cast<hsize_t>(c * chunk / s.shape[1]);
        count[0] = static_cast<hsize_t>(len / s.shape[1]);
      }
      const h5::Handle fspace(T3D_H5(H5Dget_space(dset), what), H5Sclose);
      T3D_H5(
          H5Sselect_hyperslab(fspace, H5S_SELECT_SET, start.data(), nullptr, count.data(), nullptr),
          what);
      const h5::Handle mspace = h5::simple_space({len});
      T3D_H5(H5Dwrite(dset, H5T_NATIVE_FLOAT, mspace, fspace, H5P_DEFAULT, delta.data()), what);
      ++written;
    }
  }
  h5::write_attr(dset, "global_shape", s.global_shape);
  h5::write_attr(dset, "offset", s.offset);
  h5::write_attr(dset, "chunk_elems", chunk);
  // Hashes of the content, not of the delta: restore checks each chunk after rebuilding it.
  h5::write_attr(dset, "chunk_hash", hashes);
  result.hashes.push_back(std::move(hashes));
  result.raw_bytes += static_cast<uint64_t>(n) * sizeof(float);
  result.chunks += chunks;
  result.chunks_written += written;
}

}  // namespace

ShardResult write_shard(const std::string& path, int rank, const std::vector<Slice>& slices,
                        const WriteOptions& opt) {
  T3D_ASSERT(!opt.parent || (opt.parent->size() == slices.size() && opt.parent_hashes &&
                             opt.parent_hashes->size() == slices.size()),
             "incremental snapshot without its parent's slices");
  const std::string tmp = temp_path(path);
  std::error_code ec;
  fs::create_directories(fs::path(path).parent_path(), ec);
  T3D_USER_CHECK(!ec && fs::is_directory(fs::path(path).parent_path()),
                 "cannot create snapshot directory `", fs::path(path).parent_path().string(),
                 "`: ", ec ? ec.message() : "a file of that name is in the way");
  h5::Handle file = h5::create_file(tmp);
  ShardResult result;
  try {
    const h5::Handle lcpl = h5::intermediate_groups();
    std::string names;
    std::map<std::string, int> boxes;  // per tensor path: boxes of it written so far
    for (size_t i = 0; i < slices.size(); ++i) {
      if (i == slices.size() / 2 && opt.fault.kill) std::raise(SIGKILL);
      T3D_USER_CHECK(!(i == slices.size() / 2 && opt.fault.fail), "cannot write `", tmp,
                     "`: injected write failure (T3D_SNAPSHOT_FAULT)");
      // A ZeRO rank may hold up to three boxes of one tensor (partial row, rows, partial row):
      // the second and third get a suffix, which the index strips (kBoxSuffix).
      const int k = boxes[slices[i].path]++;
      std::string dataset = slices[i].path;
      if (k) dataset.append(kBoxSuffix).append(std::to_string(k));
      write_slice(file, lcpl, slices, i, dataset, opt, result, tmp);
      if (i) names += '\n';
      if (opt.parent) names += "xor/";
      names += dataset;
    }
    h5::write_attr(file, "format_version", kFormatVersion);
    h5::write_attr(file, "rank", static_cast<int64_t>(rank));
    h5::write_attr(file, "tensors", names);
    // Every object is closed (scoped above): a full disk fails this flush, before the close.
    T3D_H5(H5Fflush(file, H5F_SCOPE_LOCAL), tmp);
  } catch (...) {
    file.abandon_file(tmp);  // the caller discards the temporary
    throw;
  }
  try {
    file.close(tmp);
  } catch (...) {
    if (::truncate(tmp.c_str(), 0) != 0) {
    }  // frees its space even if HDF5 still holds the file; the caller discards it
    throw;
  }
  fsync_path(tmp, false);
  result.digest = digest_file(tmp);
  return result;
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
void write_virtual_datasets(hid_t index, const std::string& dir, const IndexInfo& info,
                            const std::string& where) {
  struct Piece {
    std::string file, path;
    std::vector<int64_t> global_shape, offset, shape;
  };
  std::map<std::string, std::vector<Piece>> tensors;  // sorted by path: a stable index
  for (const auto& shard : info.shards) {
    const std::string shard_file = dir + "/" + shard.file;
    const h5::Handle f = h5::open_file(shard_file);
    std::istringstream names(h5::read_string_attr(f, "tensors", shard_file));
    for (std::string path; std::getline(names, path);) {
      const h5::Handle d = h5::open_dataset(f, path, shard_file);
      Piece p{shard.file,
              path,
              h5::read_ints_attr(d, "global_shape", shard_file + ":" + path),
              h5::read_ints_attr(d, "offset", shard_file + ":" + path),
              {}};
      const h5::Handle space(T3D_H5(H5Dget_space(d), shard_file), H5Sclose);
      std::vector<hsize_t> dims(p.offset.size());
      T3D_H5(H5Sget_simple_extent_dims(space, dims.data(), nullptr), shard_file);
      p.shape.assign(dims.begin(), dims.end());
      tensors[path.substr(0, path.find(kBoxSuffix))].push_back(std::move(p));
    }
  }
  const h5::Handle lcpl = h5::intermediate_groups();
  for (const auto& [path, pieces] : tensors) {
    const h5::Handle dcpl(T3D_H5(H5Pcreate(H5P_DATASET_CREATE), where), H5Pclose);
    const h5::Handle vspace = h5::simple_space(pieces.front().global_shape);
    for (const auto& p : pieces) {
      T3D_USER_CHECK(p.global_shape == pieces.front().global_shape,
                     "shards disagree on the "
                     "shape of ",
                     path, " (", p.file, ")");
      const std::vector<hsize_t> start(p.offset.begin(), p.offset.end());
      const std::vector<hsize_t> count(p.shape.begin(), p.shape.end());
      T3D_H5(
          H5Sselect_hyperslab(vspace, H5S_SELECT_SET, start.data(), nullptr, count.data(), nullptr),
          where);
      const h5::Handle src = h5::simple_space(p.shape);
      T3D_H5(H5Pset_virtual(dcpl, vspace, p.file.c_str(), p.path.c_str(), src), where);
    }
    T3D_H5(H5Sselect_all(vspace), where);
    const h5::Handle d(
        T3D_H5(H5Dcreate2(index, path.c_str(), H5T_IEEE_F32LE, vspace, lcpl, dcpl, H5P_DEFAULT),
               where + ":" + path),
        H5Dclose);
  }
}

}  // namespace

std::string write_index(const std::string& dir, const IndexInfo& info) {
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
    write_virtual_datasets(f, dir, info, tmp);
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

std::vector<int64_t> committed_steps(const std::string& dir) {
  static const std::regex kIndex(R"(step_(\d{8})\.h5)");
  std::vector<int64_t> steps;
  std::error_code ec;
  for (const auto& e : fs::directory_iterator(dir, ec)) {
    std::smatch m;
    const std::string name = e.path().filename().string();
    if (std::regex_match(name, m, kIndex)) steps.push_back(std::stoll(m[1]));
  }
  std::sort(steps.begin(), steps.end());
  return steps;
}

void set_aside(const std::string& dir, const std::vector<int64_t>& steps, const std::string& into) {
  std::error_code ec;
  fs::create_directories(into, ec);
  T3D_USER_CHECK(!ec, "cannot create `", into, "` to set snapshots aside: ", ec.message());
  std::vector<std::string> names;
  for (const int64_t step : steps) names.push_back(snapshot_name(step));
  const auto moved = [&](const std::string& name) {
    return std::any_of(names.begin(), names.end(), [&](const std::string& n) {
      return name.compare(0, n.size(), n) == 0 &&
             (name.size() == n.size() || name[n.size()] == '.');
    });
  };
  std::vector<fs::path> entries;
  for (const auto& e : fs::directory_iterator(dir, ec)) entries.push_back(e.path());
  T3D_USER_CHECK(!ec, "cannot list `", dir, "`: ", ec.message());
  for (const auto& path : entries)
    if (moved(path.filename().string())) {
      fs::rename(path, fs::path(into) / path.filename(), ec);
      T3D_USER_CHECK(!ec, "cannot move `", path.string(), "` into `", into, "`: ", ec.message());
    }
  std::ifstream latest(dir + "/latest");
  std::string named;
  if (std::getline(latest, named) && moved(named)) discard(dir + "/latest");
}

namespace {

// Step of the parent of the committed snapshot at `step`; -1 for a full one; nullopt when its
// index cannot be read (then what it depends on is unknown).
std::optional<int64_t> parent_step(const std::string& dir, int64_t step) {
  static const std::regex kIndex(R"(step_(\d{8})\.h5)");
  try {
    const std::string path = index_path(dir, step);
    const h5::Handle f = h5::open_image(path, read_verified_index(path));
    const std::string parent = h5::read_string_attr(f, "parent", path);
    std::smatch m;
    if (parent.empty()) return -1;
    if (std::regex_match(parent, m, kIndex)) return std::stoll(m[1]);
  } catch (const UserError&) {
  }
  return std::nullopt;
}

}  // namespace

std::vector<std::string> retain(const std::string& dir, int64_t keep) {
  std::vector<std::string> deleted;
  const auto steps = committed_steps(dir);
  std::error_code ec;
  const int64_t drop = std::max<int64_t>(0, static_cast<int64_t>(steps.size()) - keep);
  // The kept snapshots and every ancestor they are rebuilt from. An index that cannot be read
  // protects everything older: deleting what it might need could lose the snapshot.
  std::set<int64_t> needed(steps.begin() + drop, steps.end());
  int64_t protect_below = -1;
  for (auto it = steps.begin() + drop; it != steps.end(); ++it) {
    for (std::optional<int64_t> s = *it; s && *s >= 0 && *s > protect_below;) {
      needed.insert(*s);
      const auto p = parent_step(dir, *s);
      if (!p) protect_below = std::max(protect_below, *s);
      s = p;
    }
  }
  for (int64_t i = 0; i < drop; ++i) {
    if (needed.count(steps[i]) || steps[i] < protect_below) continue;
    fs::remove(index_path(dir, steps[i]), ec);  // first: from here on it is not a snapshot
    fs::remove_all(dir + "/" + snapshot_name(steps[i]), ec);
    deleted.push_back(snapshot_name(steps[i]));
  }
  // Shard directories of snapshots that never committed (a crash or a failed write), older than
  // the newest committed one: no writer is still working on them.
  static const std::regex kShardDir(R"(step_(\d{8}))");
  if (!steps.empty()) {
    for (const auto& e : fs::directory_iterator(dir, ec)) {
      std::smatch m;
      const std::string name = e.path().filename().string();
      if (!e.is_directory() || !std::regex_match(name, m, kShardDir)) continue;
      const int64_t s = std::stoll(m[1]);
      if (s < steps.back() && !fs::exists(index_path(dir, s))) {
        fs::remove_all(e.path(), ec);
        deleted.push_back(name + " (never committed)");
      }
    }
  }
  return deleted;
}

}  // namespace t3d::checkpoint
