// Reading side of snapshots: verification, the piece catalog and resharded reads.
#include <algorithm>
#include <cstdio>
#include <cstring>
#include <filesystem>
#include <set>
#include <sstream>

#include "checkpoint/h5.h"
#include "checkpoint/paths.h"
#include "checkpoint/snapshot.h"
#include "kernels/arena.h"
#include "kernels/check.h"
#include "kernels/ops.h"

namespace t3d::checkpoint {

namespace fs = std::filesystem;

namespace {

std::string shape_str(const std::vector<int64_t>& s) {
  std::string out = "[";
  for (size_t i = 0; i < s.size(); ++i) out += (i ? ", " : "") + std::to_string(s[i]);
  return out + "]";
}

// A box as (rows, cols): 1-D tensors are one row; copies below work on this view.
struct Box2 {
  int64_t r0, c0, rows, cols;
};
Box2 as_2d(const std::vector<int64_t>& offset, const std::vector<int64_t>& shape) {
  if (shape.size() == 1) return {0, offset[0], 1, shape[0]};
  return {offset[0], offset[1], shape[0], shape[1]};
}

// Checks an index file exists and is a committed titan3d snapshot; explains what is missing.
void check_index_file(const std::string& path) {
  if (fs::exists(path)) return;
  std::string hint = ".";
  const fs::path p(path);
  if (p.extension() == ".h5" && fs::is_directory(p.parent_path() / p.stem()))
    hint = ": its shard directory `" + (p.parent_path() / p.stem()).string() +
           "` exists but the index does not, so the snapshot was never committed (a crash or a "
           "failed write while it was taken). Resume from an older snapshot, or use "
           "snapshot.resume = \"latest\".";
  throw UserError("snapshot `" + path + "` does not exist" + hint);
}

// The index file, verified as bytes and opened only if its commit record (`complete`, written
// last) is there.
h5::Handle open_committed_index(const ReadOnlyFile& index) {
  const std::string& path = index.path();
  h5::Handle f = h5::open_image(path, read_verified_index(index));
  T3D_USER_CHECK(h5::has_attr(f, "complete") && h5::read_int_attr(f, "complete", path) == 1,
                 "snapshot `", path,
                 "` is incomplete (no `complete` mark): it was never committed. Resume from an "
                 "older snapshot.");
  return f;
}

// One snapshot: its index, catalog and shard files. SnapshotReader chains these for incremental
// snapshots.
struct Level {
  // How a shard dataset holds its box: whole values; (format 2) some chunks as values, the
  // others from the parent; (format 1) an XOR mask against the parent's box.
  enum class Kind { kValues, kChanged, kXor };
  struct Piece {
    std::string file, path;
    std::vector<int64_t> offset, shape;
    Kind kind = Kind::kValues;
  };
  struct Tensor {
    std::vector<int64_t> global_shape;
    std::vector<Piece> pieces;
  };
  std::string path, dir;
  int64_t format = kFormatVersion;
  IndexInfo info;
  std::map<std::string, Tensor> tensors;
  std::map<std::string, h5::Handle> open_shards;  // verified shard files, by relative name

  void load_index(const ReadOnlyFile& index) {
    const h5::Handle f = open_committed_index(index);
    const int64_t version = h5::read_int_attr(f, "format_version", path);
    T3D_USER_CHECK(version >= kOldestFormatVersion && version <= kFormatVersion, "snapshot `", path,
                   "` has format version ", version, "; this titan3d reads versions ",
                   kOldestFormatVersion, " to ", kFormatVersion);
    format = version;
    info.step = h5::read_int_attr(f, "step", path);
    info.parent = h5::read_string_attr(f, "parent", path);
    if (h5::has_attr(f, "id")) info.id = h5::read_uints_attr(f, "id", path).at(0);
    if (!info.parent.empty()) info.parent_id = h5::read_uints_attr(f, "parent_id", path).at(0);
    info.recipe = h5::read_string_attr(f, "recipe", path);
    info.layout = h5::read_string_attr(f, "layout", path);
    if (h5::has_attr(f, "device")) info.device = h5::read_string_attr(f, "device", path);
    if (h5::has_attr(f, "gemm_table"))
      info.gemm_table = h5::read_string_attr(f, "gemm_table", path);
    std::istringstream files(h5::read_string_attr(f, "shard_files", path));
    const auto bytes = h5::read_ints_attr(f, "shard_bytes", path);
    const auto hashes = h5::read_uints_attr(f, "shard_hash", path);
    for (std::string file; std::getline(files, file);) {
      // The name is checked here; the file is opened by ReadOnlyFile::open_inside when read.
      path_inside(dir, file, "snapshot index `" + path + "` (shard_files)");
      const size_t i = info.shards.size();
      T3D_USER_CHECK(i < bytes.size() && i < hashes.size(), "snapshot `", path,
                     "`: shard lists disagree");
      info.shards.push_back({file, static_cast<uint64_t>(bytes[i]), hashes[i]});
    }
    h5::require_hard_links(f, "state", path);
    const h5::Handle state(T3D_H5(H5Gopen2(f, "state", H5P_DEFAULT), path + ":/state"), H5Gclose);
    H5O_info_t oinfo;
    T3D_H5(H5Oget_info2(state, &oinfo, H5O_INFO_NUM_ATTRS), path + ":/state");
    for (hsize_t i = 0; i < oinfo.num_attrs; ++i) {
      char name[256] = {};
      T3D_H5(H5Aget_name_by_idx(state, ".", H5_INDEX_NAME, H5_ITER_INC, i, name, sizeof(name),
                                H5P_DEFAULT),
             path + ":/state");
      info.counters[name] = h5::read_int_attr(state, name, path + ":/state");
    }
    load_catalog(f);
  }

  // The virtual datasets' mappings: which shard dataset holds which box of each tensor.
  void load_catalog(hid_t f) {
    std::vector<std::string> names;
    H5Ovisit2(
        f, H5_INDEX_NAME, H5_ITER_INC,
        [](hid_t, const char* name, const H5O_info_t* oi, void* out) -> herr_t {
          if (oi->type == H5O_TYPE_DATASET)
            static_cast<std::vector<std::string>*>(out)->push_back(name);
          return 0;
        },
        &names, H5O_INFO_BASIC);
    for (const auto& name : names) {
      const h5::Handle d = h5::open_dataset(f, name, path);
      const h5::Handle dcpl(T3D_H5(H5Dget_create_plist(d), path + ":" + name), H5Pclose);
      T3D_USER_CHECK(H5Pget_layout(dcpl) == H5D_VIRTUAL, "snapshot `", path, "`: `", name,
                     "` is not a virtual dataset");
      Tensor t;
      const h5::Handle space(T3D_H5(H5Dget_space(d), path), H5Sclose);
      const int rank = H5Sget_simple_extent_ndims(space);
      std::vector<hsize_t> dims(static_cast<size_t>(std::max(rank, 0)));
      T3D_H5(H5Sget_simple_extent_dims(space, dims.data(), nullptr), path + ":" + name);
      t.global_shape.assign(dims.begin(), dims.end());
      size_t count = 0;
      T3D_H5(H5Pget_virtual_count(dcpl, &count), path + ":" + name);
      for (size_t i = 0; i < count; ++i) {
        Piece p;
        p.file.resize(static_cast<size_t>(H5Pget_virtual_filename(dcpl, i, nullptr, 0)));
        H5Pget_virtual_filename(dcpl, i, p.file.data(), p.file.size() + 1);
        p.path.resize(static_cast<size_t>(H5Pget_virtual_dsetname(dcpl, i, nullptr, 0)));
        H5Pget_virtual_dsetname(dcpl, i, p.path.data(), p.path.size() + 1);
        const h5::Handle vs(T3D_H5(H5Pget_virtual_vspace(dcpl, i), path + ":" + name), H5Sclose);
        std::vector<hsize_t> start(dims.size()), stride(dims.size()), cnt(dims.size()),
            block(dims.size());
        T3D_H5(H5Sget_regular_hyperslab(vs, start.data(), stride.data(), cnt.data(), block.data()),
               path + ":" + name);
        for (size_t k = 0; k < dims.size(); ++k) {
          p.offset.push_back(static_cast<int64_t>(start[k]));
          p.shape.push_back(static_cast<int64_t>(cnt[k] * block[k]));
        }
        t.pieces.push_back(std::move(p));
      }
      // Format 1: an incremental snapshot's datasets are all XOR masks under /xor/. Format 2:
      // a box an incremental snapshot holds only in part is under /changed/. Either way the
      // catalog is keyed by the tensor they rebuild.
      const bool incremental = !info.parent.empty();
      const bool xor_mask = name.rfind("xor/", 0) == 0;
      const bool changed = name.rfind(kChangedPrefix, 0) == 0;
      T3D_USER_CHECK(format == 1 ? xor_mask == incremental : !xor_mask && (incremental || !changed),
                     "snapshot `", path, "`: dataset `", name, "` does not belong in a",
                     incremental ? "n incremental" : " full", " snapshot of format version ",
                     format);
      const Kind kind = xor_mask ? Kind::kXor : changed ? Kind::kChanged : Kind::kValues;
      for (auto& p : t.pieces) p.kind = kind;
      const std::string tensor = xor_mask  ? name.substr(4)
                                 : changed ? name.substr(std::strlen(kChangedPrefix))
                                           : name;
      const auto it = tensors.find(tensor);
      if (it == tensors.end()) {
        tensors.emplace(tensor, std::move(t));
      } else {  // some boxes of the tensor whole, others in part
        T3D_USER_CHECK(it->second.global_shape == t.global_shape, "snapshot `", path, "`: `", name,
                       "` and `", tensor, "` disagree on the tensor's shape");
        for (auto& p : t.pieces) it->second.pieces.push_back(std::move(p));
      }
    }
  }

  // Opens a shard file after checking its size and hash against the index.
  hid_t shard(const std::string& file) {
    if (auto it = open_shards.find(file); it != open_shards.end()) return it->second;
    const auto entry = std::find_if(info.shards.begin(), info.shards.end(),
                                    [&](const ShardEntry& s) { return s.file == file; });
    const std::string full = dir + "/" + file;
    T3D_USER_CHECK(entry != info.shards.end(), "snapshot `", path, "` maps a tensor to `", full,
                   "`, which its shard list does not name");
    T3D_USER_CHECK(fs::exists(full), "snapshot `", path, "`: shard file `", full, "` is missing");
    // Hashed and then opened through one descriptor: the file verified is the file read.
    const ReadOnlyFile shard_file =
        ReadOnlyFile::open_inside(dir, file, "snapshot index `" + path + "` (shard_files)");
    const FileDigest d = digest_file(shard_file);
    T3D_USER_CHECK(d.bytes == entry->bytes, "snapshot shard `", full, "` has ", d.bytes,
                   " bytes, the index recorded ", entry->bytes,
                   ": the file is truncated or "
                   "was replaced. Resume from another snapshot.");
    T3D_USER_CHECK(d.hash == entry->hash, "snapshot shard `", full, "` is damaged: its hash ",
                   to_hex(d.hash), " differs from the index's ", to_hex(entry->hash),
                   " (a flipped or overwritten byte). Resume from another snapshot.");
    return open_shards.emplace(file, h5::open_file(shard_file)).first->second;
  }

  // The piece of tensor `name` with exactly this box: a chain shares one writer layout.
  const Piece& piece(const std::string& name, const Piece& like, const std::string& child) const {
    const auto it = tensors.find(name);
    if (it != tensors.end())
      for (const auto& p : it->second.pieces)
        if (p.offset == like.offset && p.shape == like.shape) return p;
    throw UserError("snapshot `" + child + "` cannot be rebuilt from its ancestor `" + path +
                    "`: the ancestor has no box " + shape_str(like.shape) + " at " +
                    shape_str(like.offset) + " of `" + name + "` (a different writer layout)");
  }

  // Reads one whole piece as stored (values, a partial box, or an XOR mask) into `out`, which
  // holds kernels::numel(p.shape) floats.
  void read_into(const Piece& p, float* out) {
    const std::string full = dir + "/" + p.file;
    h5::require_hard_links(shard(p.file), p.path, full);
    const h5::Handle d = h5::open_dataset(shard(p.file), p.path, full);
    T3D_H5(H5Dread(d, H5T_NATIVE_FLOAT, H5S_ALL, H5S_ALL, H5P_DEFAULT, out), full + ":" + p.path);
  }

  // Copies the chunks a partial box (kChanged) holds (`chunk_written` 1) over `data`, the
  // parent's content of the box; `stored` is scratch of the box's size.
  void copy_written_chunks(const Piece& p, float* data, float* stored) {
    const std::string full = dir + "/" + p.file, what = full + ":" + p.path;
    read_into(p, stored);
    const h5::Handle d = h5::open_dataset(shard(p.file), p.path, full);
    const int64_t chunk = h5::read_int_attr(d, "chunk_elems", what);
    const auto written = h5::read_ints_attr(d, "chunk_written", what);
    const int64_t n = kernels::numel(p.shape);
    T3D_USER_CHECK(chunk > 0 && static_cast<int64_t>(written.size()) == (n + chunk - 1) / chunk,
                   "snapshot shard `", full, "`: `", p.path, "` has chunk_elems ", chunk,
                   " and a chunk_written list of ", written.size(), " for ", n, " elements");
    for (int64_t c = 0; c < static_cast<int64_t>(written.size()); ++c) {
      if (!written[static_cast<size_t>(c)]) continue;
      std::memcpy(data + c * chunk, stored + c * chunk,
                  static_cast<size_t>(std::min(chunk, n - c * chunk)) * sizeof(float));
    }
  }

  // Checks every chunk of a piece's content (rebuilt, for an incremental snapshot).
  void check_hashes(const Piece& p, const float* data) {
    const std::string full = dir + "/" + p.file;
    h5::require_hard_links(shard(p.file), p.path, full);
    const h5::Handle d = h5::open_dataset(shard(p.file), p.path, full);
    const int64_t chunk = h5::read_int_attr(d, "chunk_elems", full + ":" + p.path);
    const auto hashes = h5::read_uints_attr(d, "chunk_hash", full + ":" + p.path);
    const int64_t n = kernels::numel(p.shape);
    T3D_USER_CHECK(chunk > 0, "snapshot shard `", full, "`: `", p.path, "` has chunk_elems ",
                   chunk);
    for (int64_t c = 0; c * chunk < std::max<int64_t>(n, 1); ++c) {
      const int64_t len = std::min(chunk, n - c * chunk);
      T3D_USER_CHECK(static_cast<size_t>(c) < hashes.size() &&
                         hash64(data + c * chunk, static_cast<size_t>(len) * 4) ==
                             hashes[static_cast<size_t>(c)],
                     "snapshot shard `", full, "`: chunk ", c, " of `", p.path,
                     "` fails its content hash",
                     info.parent.empty() ? "" : " after rebuilding it from the parent chain",
                     ". Resume from another snapshot.");
    }
  }
};

// Runs `f`; a UserError raised while working on an ancestor gets the snapshot asked for as
// context, so the message says both what is broken and why it was needed.
template <typename F>
void for_ancestor(const Level& lv, const Level& top, F&& f) {
  if (&lv == &top) return f();
  try {
    f();
  } catch (const UserError& e) {
    throw UserError("snapshot `" + top.path + "` is incremental and needs its ancestor `" +
                    lv.path + "`, which is unusable: " + e.what());
  }
}

}  // namespace

struct SnapshotReader::Impl {
  std::vector<std::unique_ptr<Level>> chain;  // full base first, the snapshot asked for last
  Level& top() { return *chain.back(); }

  // Loads the index at `path` and, for an incremental snapshot, each ancestor's.
  void load(const std::string& path) {
    std::vector<std::unique_ptr<Level>> rev;
    check_index_file(path);
    rev.push_back(open_level(ReadOnlyFile::open(path, "snapshot index")));
    while (!rev.back()->info.parent.empty()) {
      const Level& child = *rev.back();
      // The parent is an index of the same directory, named without a directory.
      T3D_USER_CHECK(child.info.parent.find('/') == std::string::npos, "snapshot `", child.path,
                     "` names the parent `", child.info.parent,
                     "`, which is not a file name in its own directory; titan3d writes "
                     "parents beside their children. Resume from a full snapshot.");
      const std::string parent =
          path_inside(child.dir, child.info.parent, "snapshot `" + child.path + "` (parent)");
      T3D_USER_CHECK(rev.size() < 10000, "snapshot `", path, "`: its parent chain does not end");
      T3D_USER_CHECK(fs::exists(parent), "snapshot `", path, "` is incremental and needs ",
                     &child == rev.front().get() ? "its parent" : "its ancestor", " `", parent,
                     "`, which is missing (deleted, or not copied along). Resume from a "
                     "snapshot whose chain is complete, or from a full one (empty `parent`).");
      std::unique_ptr<Level> lv;
      try {
        lv = open_level(ReadOnlyFile::open_inside(child.dir, child.info.parent,
                                                  "snapshot `" + child.path + "` (parent)"));
      } catch (const UserError& e) {
        throw UserError("snapshot `" + path + "` is incremental and needs its ancestor `" + parent +
                        "`, which is unusable: " + e.what());
      }
      T3D_USER_CHECK(lv->info.id == child.info.parent_id && lv->info.step < child.info.step,
                     "snapshot `", child.path, "` was taken against another `", parent,
                     "` than the one there now (snapshot id ", to_hex(lv->info.id), ", expected ",
                     to_hex(child.info.parent_id),
                     "): a later run overwrote that step. The chain is broken; resume from a "
                     "full snapshot.");
      rev.push_back(std::move(lv));
    }
    chain.assign(std::make_move_iterator(rev.rbegin()), std::make_move_iterator(rev.rend()));
  }

  static std::unique_ptr<Level> open_level(const ReadOnlyFile& index) {
    auto lv = std::make_unique<Level>();
    lv->path = index.path();
    lv->dir = fs::path(lv->path).parent_path().string();
    if (lv->dir.empty()) lv->dir = ".";
    lv->load_index(index);
    return lv;
  }

  // Scratch for pieces read whole but wanted in part, and for stored chunks and masks: kept
  // between reads, so that a restore does not fault in fresh pages for every box.
  std::vector<float> box_scratch, stored_scratch;

  // The content of the top snapshot's piece `p` of tensor `name`, into `out`
  // (kernels::numel(p.shape) floats): from the newest level that holds the box whole, with each
  // newer level's chunks (format 2) or XOR mask (format 1) applied in order, every level's chunk
  // hashes checked on the way.
  void rebuild(const std::string& name, const Level::Piece& p, float* out) {
    std::vector<const Level::Piece*> pieces(chain.size());
    size_t base = chain.size();
    while (base-- > 0) {
      Level& lv = *chain[base];
      for_ancestor(lv, top(),
                   [&] { pieces[base] = &lv == &top() ? &p : &lv.piece(name, p, top().path); });
      if (pieces[base]->kind == Level::Kind::kValues) break;
    }
    T3D_USER_CHECK(base < chain.size(), "snapshot `", top().path,
                   "`: no level of its chain holds `", name, "` whole (its full base is damaged)");
    const auto n = static_cast<size_t>(kernels::numel(p.shape));
    for (size_t l = base; l < chain.size(); ++l) {
      Level& lv = *chain[l];
      const Level::Piece& q = *pieces[l];
      for_ancestor(lv, top(), [&] {
        if (q.kind == Level::Kind::kValues) {
          lv.read_into(q, out);
        } else {
          if (stored_scratch.size() < n) stored_scratch.resize(n);
          if (q.kind == Level::Kind::kXor) {
            lv.read_into(q, stored_scratch.data());
            xor_floats(out, stored_scratch.data(), out, static_cast<int64_t>(n));
          } else {
            lv.copy_written_chunks(q, out, stored_scratch.data());
          }
        }
        lv.check_hashes(q, out);
      });
    }
  }
};

SnapshotReader::SnapshotReader(const std::string& index_path) : impl_(std::make_unique<Impl>()) {
  impl_->load(index_path);
}

SnapshotReader::~SnapshotReader() = default;
const IndexInfo& SnapshotReader::info() const { return impl_->top().info; }
const std::string& SnapshotReader::path() const { return impl_->top().path; }

std::vector<std::string> SnapshotReader::chain() const {
  std::vector<std::string> paths;
  for (const auto& lv : impl_->chain) paths.push_back(lv->path);
  return paths;
}

void SnapshotReader::verify() {
  for (auto& lv : impl_->chain)
    for_ancestor(*lv, impl_->top(), [&] {
      for (const auto& s : lv->info.shards) lv->shard(s.file);
    });
}

void SnapshotReader::read(const Slice& want, const kernels::Exec& into) {
  auto& m = impl_->top();
  const auto it = m.tensors.find(want.path);
  T3D_USER_CHECK(it != m.tensors.end(), "snapshot `", m.path, "` has no tensor `", want.path,
                 "`: the model's structure differs from the one snapshotted");
  const auto& t = it->second;
  T3D_USER_CHECK(t.global_shape == want.global_shape, "snapshot `", m.path, "`: `", want.path,
                 "` has shape ", shape_str(t.global_shape), ", the model needs ",
                 shape_str(want.global_shape), ": the model's size differs");
  T3D_ASSERT(want.shape.size() <= 2 && !want.shape.empty(), "only 1-D and 2-D tensors");
  const Box2 w = as_2d(want.offset, want.shape);
  int64_t covered = 0;
  for (const auto& p : t.pieces) {
    const Box2 b = as_2d(p.offset, p.shape);
    const int64_t r0 = std::max(w.r0, b.r0), r1 = std::min(w.r0 + w.rows, b.r0 + b.rows);
    const int64_t c0 = std::max(w.c0, b.c0), c1 = std::min(w.c0 + w.cols, b.c0 + b.cols);
    if (r0 >= r1 || c0 >= c1) continue;
    // Each piece is rebuilt whole into host scratch, then the overlap crosses: one copy when the
    // piece is the box wanted (a resume on the writer's layout), else one per row.
    auto& data = impl_->box_scratch;
    if (data.size() < static_cast<size_t>(kernels::numel(p.shape)))
      data.resize(static_cast<size_t>(kernels::numel(p.shape)));
    impl_->rebuild(want.path, p, data.data());
    if (p.offset == want.offset && p.shape == want.shape) {
      kernels::copy_from_host(into, want.data, data.data(),
                              sizeof(float) * static_cast<size_t>(kernels::numel(want.shape)));
      covered += kernels::numel(want.shape);
      continue;
    }
    for (int64_t r = r0; r < r1; ++r)
      kernels::copy_from_host(into, want.data + (r - w.r0) * w.cols + (c0 - w.c0),
                              data.data() + (r - b.r0) * b.cols + (c0 - b.c0),
                              static_cast<size_t>(c1 - c0) * sizeof(float));
    covered += (r1 - r0) * (c1 - c0);
  }
  // Pieces never overlap (each box has one writer), so the areas add up exactly when covered.
  T3D_USER_CHECK(covered == kernels::numel(want.shape), "snapshot `", m.path, "` covers only ",
                 covered, " of the ", kernels::numel(want.shape), " elements of `", want.path,
                 "` needed at ", shape_str(want.offset), ": shards are missing");
}

std::string read_recipe(const std::string& index_path) {
  check_index_file(index_path);
  const h5::Handle f = open_committed_index(ReadOnlyFile::open(index_path, "snapshot index"));
  return h5::read_string_attr(f, "recipe", index_path);
}

std::string read_gemm_table(const std::string& index_path) {
  check_index_file(index_path);
  const h5::Handle f = open_committed_index(ReadOnlyFile::open(index_path, "snapshot index"));
  return h5::has_attr(f, "gemm_table") ? h5::read_string_attr(f, "gemm_table", index_path) : "";
}

std::vector<char> read_verified_index(const std::string& path) {
  return read_verified_index(ReadOnlyFile::open(path, "snapshot index"));
}

std::vector<char> read_verified_index(const ReadOnlyFile& index) {
  const std::string& path = index.path();
  std::vector<char> bytes(index.size());
  index.read_at(0, bytes.data(), bytes.size());
  const auto u64_at = [&](size_t at) {
    uint64_t v = 0;
    for (int i = 7; i >= 0; --i) v = v << 8 | static_cast<unsigned char>(bytes[at + i]);
    return v;
  };
  const size_t n = bytes.size();
  T3D_USER_CHECK(n >= kIndexTrailer && std::memcmp(&bytes[n - kIndexTrailer], kIndexMagic, 8) == 0,
                 "snapshot index `", path,
                 "` has no integrity trailer: it is damaged (its end was overwritten or cut off), "
                 "or it was written by a titan3d without index checksums, which this version does "
                 "not load unchecked. Resume from another snapshot (or read this one with the "
                 "titan3d that wrote it).");
  const uint64_t len = u64_at(n - 16), hash = u64_at(n - 8);
  T3D_USER_CHECK(len == n - kIndexTrailer, "snapshot index `", path,
                 "` is damaged: ", n - kIndexTrailer, " bytes before its trailer, which records ",
                 len,
                 " (truncated, extended, or a flipped byte in the trailer). Resume from another "
                 "snapshot.");
  const uint64_t actual = hash64(bytes.data(), len);
  T3D_USER_CHECK(actual == hash, "snapshot index `", path, "` is damaged: its hash ",
                 to_hex(actual), " differs from the ", to_hex(hash),
                 " recorded in its trailer (a flipped or overwritten byte). Resume from another "
                 "snapshot.");
  bytes.resize(len);
  return bytes;
}

std::string find_latest(const std::string& dir, std::vector<std::string>* skipped, int64_t before,
                        const std::function<void(SnapshotReader&)>& accept) {
  auto steps = committed_steps(dir);
  for (auto it = steps.rbegin(); it != steps.rend(); ++it) {
    if (before >= 0 && *it >= before) continue;
    const std::string path = index_path(dir, *it);
    try {
      SnapshotReader reader(path);
      reader.verify();
      if (accept) accept(reader);
      return path;
    } catch (const UserError& e) {
      if (skipped) skipped->push_back(fs::path(path).filename().string() + ": " + e.what());
    }
  }
  return "";
}

}  // namespace t3d::checkpoint
