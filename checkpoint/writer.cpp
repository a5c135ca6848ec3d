// Writing side of snapshots: shards, publication, the index (commit record) and retention.
#include <fcntl.h>
#include <unistd.h>

#include <algorithm>
#include <csignal>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <filesystem>
#include <regex>
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

void write_slice(hid_t file, hid_t lcpl, const Slice& s, const std::string& where) {
  T3D_ASSERT(s.shape.size() == s.offset.size() && s.shape.size() == s.global_shape.size(), "slice ",
             s.path, " has inconsistent ranks");
  const h5::Handle space = h5::simple_space(s.shape);
  const h5::Handle dset(T3D_H5(H5Dcreate2(file, s.path.c_str(), H5T_IEEE_F32LE, space, lcpl,
                                          H5P_DEFAULT, H5P_DEFAULT),
                               where + ":" + s.path),
                        H5Dclose);
  T3D_H5(H5Dwrite(dset, H5T_NATIVE_FLOAT, H5S_ALL, H5S_ALL, H5P_DEFAULT, s.data),
         where + ":" + s.path);
  int64_t n = 1;
  for (int64_t d : s.shape) n *= d;
  std::vector<uint64_t> hashes;
  for (int64_t c = 0; c < std::max<int64_t>(1, (n + kChunkElems - 1) / kChunkElems); ++c) {
    const int64_t len = std::min(kChunkElems, n - c * kChunkElems);
    hashes.push_back(hash64(s.data + c * kChunkElems, static_cast<size_t>(len) * sizeof(float)));
  }
  h5::write_attr(dset, "global_shape", s.global_shape);
  h5::write_attr(dset, "offset", s.offset);
  h5::write_attr(dset, "chunk_elems", kChunkElems);
  h5::write_attr(dset, "chunk_hash", hashes);
}

}  // namespace

FileDigest write_shard(const std::string& path, int rank, const std::vector<Slice>& slices,
                       Fault fault) {
  const std::string tmp = temp_path(path);
  std::error_code ec;
  fs::create_directories(fs::path(path).parent_path(), ec);
  T3D_USER_CHECK(!ec && fs::is_directory(fs::path(path).parent_path()),
                 "cannot create snapshot directory `", fs::path(path).parent_path().string(),
                 "`: ", ec ? ec.message() : "a file of that name is in the way");
  h5::Handle file = h5::create_file(tmp);
  const h5::Handle lcpl = h5::intermediate_groups();
  std::string names;
  for (size_t i = 0; i < slices.size(); ++i) {
    if (i == slices.size() / 2 && fault.kill) std::raise(SIGKILL);
    T3D_USER_CHECK(!(i == slices.size() / 2 && fault.fail), "cannot write `", tmp,
                   "`: injected write failure (T3D_SNAPSHOT_FAULT)");
    write_slice(file, lcpl, slices[i], tmp);
    names += (i ? "\n" : "") + slices[i].path;
  }
  h5::write_attr(file, "format_version", kFormatVersion);
  h5::write_attr(file, "rank", static_cast<int64_t>(rank));
  h5::write_attr(file, "tensors", names);
  file.close(tmp);  // flushes: a full disk fails here at the latest
  fsync_path(tmp, false);
  return digest_file(tmp);
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
      tensors[path].push_back(std::move(p));
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

void write_index(const std::string& dir, const IndexInfo& info) {
  const std::string path = index_path(dir, info.step), tmp = temp_path(path);
  {
    h5::Handle f = h5::create_file(tmp);
    h5::write_attr(f, "format_version", kFormatVersion);
    h5::write_attr(f, "step", info.step);
    h5::write_attr(f, "recipe", info.recipe);
    h5::write_attr(f, "layout", info.layout);
    h5::write_attr(f, "parent", std::string());  // incremental snapshots: not yet
    std::string files;
    std::vector<int64_t> bytes;
    std::vector<uint64_t> hashes;
    for (const auto& s : info.shards) {
      files += (files.empty() ? "" : "\n") + s.file;
      bytes.push_back(static_cast<int64_t>(s.bytes));
      hashes.push_back(s.hash);
    }
    T3D_USER_CHECK(!info.shards.empty(), "snapshot ", path, " has no shards");
    h5::write_attr(f, "shard_files", files);
    h5::write_attr(f, "shard_bytes", bytes);
    h5::write_attr(f, "shard_hash", hashes);
    const h5::Handle state(
        T3D_H5(H5Gcreate2(f, "state", H5P_DEFAULT, H5P_DEFAULT, H5P_DEFAULT), tmp), H5Gclose);
    for (const auto& [key, value] : info.counters) h5::write_attr(state, key, value);
    write_virtual_datasets(f, dir, info, tmp);
    h5::write_attr(f, "complete", int64_t{1});  // last: the commit mark
    f.close(tmp);
  }
  fsync_path(tmp, false);
  rename_durably(tmp, path);
  // `latest` is a hint for people and scripts; readers list the directory instead.
  const std::string latest = dir + "/latest";
  {
    std::FILE* out = std::fopen(temp_path(latest).c_str(), "w");
    T3D_USER_CHECK(out, "cannot write `", temp_path(latest), "`: ", std::strerror(errno));
    std::fprintf(out, "%s\n", fs::path(path).filename().c_str());
    std::fclose(out);
  }
  rename_durably(temp_path(latest), latest);
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

std::vector<std::string> retain(const std::string& dir, int64_t keep) {
  std::vector<std::string> deleted;
  const auto steps = committed_steps(dir);
  std::error_code ec;
  const int64_t drop = std::max<int64_t>(0, static_cast<int64_t>(steps.size()) - keep);
  for (int64_t i = 0; i < drop; ++i) {
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
