// The snapshot format without MPI or a trainer: shards written by one layout read back by
// another, bit-exactly; damage inside a chunk is caught by its content hash.
#include <gtest/gtest.h>
#include <sys/stat.h>
#include <unistd.h>

#include <cstring>
#include <filesystem>
#include <fstream>
#include <iterator>
#include <limits>
#include <map>
#include <numeric>
#include <sstream>

#include "checkpoint/h5.h"
#include "checkpoint/io_thread.h"
#include "checkpoint/memory_tier_files.h"
#include "checkpoint/snapshot.h"
#include "kernels/check.h"

namespace t3d::checkpoint {
namespace {

namespace fs = std::filesystem;

class SnapshotFormat : public ::testing::Test {
 protected:
  void SetUp() override {
    dir_ = fs::temp_directory_path() / ("t3d_snapfmt_" + std::to_string(::getpid()));
    fs::remove_all(dir_);
    fs::create_directories(dir_);
    global_.resize(6 * 5);
    std::iota(global_.begin(), global_.end(), 0.5f);
  }
  void TearDown() override { fs::remove_all(dir_); }

  // "Two tp ranks" each write a 3-row half of a 6×5 tensor, as a tp2 run would.
  std::string write_two_row_shards() {
    IndexInfo info;
    info.step = 7, info.recipe = "[model]\n", info.layout = "pp=1 dp=1 cp=1 tp=2";
    info.counters = {{"step", 7}};
    for (int rank = 0; rank < 2; ++rank) {
      Slice s{"model/w", {6, 5}, {3 * rank, 0}, {3, 5}, global_.data() + 15 * rank};
      const std::string path = shard_path(dir_, 7, rank);
      const FileDigest d = write_shard(path, rank, {s}).digest;
      publish(path);
      info.shards.push_back({fs::path(path).lexically_relative(dir_).string(), d.bytes, d.hash});
    }
    write_index(dir_, info);
    return index_path(dir_, 7);
  }

  // One-shard snapshots of the whole 6×5 tensor at each step (on the IO thread).
  void write_whole_snapshots(std::initializer_list<int64_t> steps) {
    for (int64_t step : steps) {
      IndexInfo info;
      info.step = step, info.counters = {{"step", step}};
      Slice s{"model/w", {6, 5}, {0, 0}, {6, 5}, global_.data()};
      const std::string path = shard_path(dir_, step, 0);
      const FileDigest d = write_shard(path, 0, {s}).digest;
      publish(path);
      info.shards.push_back({fs::path(path).lexically_relative(dir_).string(), d.bytes, d.hash});
      write_index(dir_, info);
    }
  }

  std::string dir_;
  std::vector<float> global_;
  IoThread io_;  // HDF5 on one thread, as in titan3d
};

// A GPU run's GEMM algorithms (several lines of text) travel in the index, where resume reads them
// alone (read_gemm_table), and in the memory tier's manifest; an index without them reads as "".
TEST_F(SnapshotFormat, TheGemmTableTravelsInTheIndexAndTheManifest) {
  const std::string table =
      "t3d-gemm-table 1\nlibrary cuBLASLt 1 on X (sm_90)\nsource measured\n"
      "8 8 8 8 8 8 0 1 0 bf16 64 0 0 0 0 0 0 0 1\n";
  io_.run([&] {
    IndexInfo info;
    info.step = 3, info.recipe = "[model]\n", info.layout = "test", info.gemm_table = table;
    info.counters = {{"step", 3}};
    Slice s{"model/w", {6, 5}, {0, 0}, {6, 5}, global_.data()};
    const std::string path = shard_path(dir_, 3, 0);
    const FileDigest d = write_shard(path, 0, {s}).digest;
    publish(path);
    info.shards.push_back({fs::path(path).lexically_relative(dir_).string(), d.bytes, d.hash});
    write_index(dir_, info);
    EXPECT_EQ(read_gemm_table(index_path(dir_, 3)), table);
    EXPECT_EQ(SnapshotReader(index_path(dir_, 3)).info().gemm_table, table);
    const auto manifest = parse_manifest(manifest_text(info));
    ASSERT_TRUE(manifest);
    EXPECT_EQ(manifest->gemm_table, table);
    EXPECT_EQ(manifest->recipe, info.recipe);
    EXPECT_EQ(read_gemm_table(write_two_row_shards()), "");  // a CPU run's
  });
}

TEST_F(SnapshotFormat, ReadsAnyBoxAcrossShards) {
  io_.run([&] {
    SnapshotReader reader(write_two_row_shards());
    EXPECT_EQ(reader.info().step, 7);
    EXPECT_EQ(reader.info().counters.at("step"), 7);
    std::vector<float> whole(30);
    reader.read({"model/w", {6, 5}, {0, 0}, {6, 5}, whole.data()}, kernels::kCpu);
    EXPECT_EQ(whole, global_);
    // A column split straddling both row shards (a tp2 row-parallel layout).
    std::vector<float> cols(6 * 2);
    reader.read({"model/w", {6, 5}, {0, 3}, {6, 2}, cols.data()}, kernels::kCpu);
    for (int r = 0; r < 6; ++r)
      for (int c = 0; c < 2; ++c) EXPECT_EQ(cols[r * 2 + c], global_[r * 5 + 3 + c]);
    EXPECT_THROW(reader.read({"model/w", {6, 4}, {0, 0}, {6, 4}, whole.data()}, kernels::kCpu),
                 UserError);
    EXPECT_THROW(reader.read({"model/x", {6, 5}, {0, 0}, {6, 5}, whole.data()}, kernels::kCpu),
                 UserError);
  });
}

TEST_F(SnapshotFormat, RefusesDamagedShard) {
  io_.run([&] {
    const std::string index = write_two_row_shards();
    const std::string shard = shard_path(dir_, 7, 1);
    {
      std::fstream f(shard, std::ios::in | std::ios::out | std::ios::binary);
      f.seekp(static_cast<std::streamoff>(fs::file_size(shard) / 2));
      f.put('\x7f');
    }
    SnapshotReader reader(index);
    std::vector<float> whole(30);
    try {
      reader.read({"model/w", {6, 5}, {0, 0}, {6, 5}, whole.data()}, kernels::kCpu);
      FAIL() << "a damaged shard was read";
    } catch (const UserError& e) {
      EXPECT_NE(std::string(e.what()).find("rank00001.h5"), std::string::npos) << e.what();
    }
  });
}

// Every single-bit flip anywhere in an index (HDF5 image or trailer) is refused as bytes, naming
// the file, before HDF5 parses it: SnapshotReader and read_recipe throw UserError, never crash.
TEST_F(SnapshotFormat, RefusesEveryFlippedIndexBitBeforeHdf5) {
  io_.run([&] {
    const std::string index = write_two_row_shards();
    std::string good;
    {
      std::ifstream in(index, std::ios::binary);
      good.assign(std::istreambuf_iterator<char>(in), {});
    }
    ASSERT_GT(good.size(), kIndexTrailer);
    EXPECT_EQ(good.compare(good.size() - kIndexTrailer, 8, kIndexMagic), 0);
    // Every byte of the trailer and a spread of the image, each bit position in turn.
    std::vector<size_t> offsets;
    for (size_t i = good.size() - kIndexTrailer; i < good.size(); ++i) offsets.push_back(i);
    for (size_t i = 0; i < good.size() - kIndexTrailer; i += 97) offsets.push_back(i);
    for (size_t k = 0; k < offsets.size(); ++k) {
      std::string bad = good;
      bad[offsets[k]] = static_cast<char>(bad[offsets[k]] ^ (1 << (k % 8)));
      std::ofstream(index, std::ios::binary | std::ios::trunc) << bad;
      try {
        SnapshotReader reader(index);
        ADD_FAILURE() << "index with byte " << offsets[k] << " flipped was accepted";
      } catch (const UserError& e) {
        EXPECT_NE(std::string(e.what()).find("step_00000007.h5"), std::string::npos) << e.what();
      }
      EXPECT_THROW(read_recipe(index), UserError);
    }
    std::ofstream(index, std::ios::binary | std::ios::trunc) << good;
    EXPECT_EQ(SnapshotReader(index).info().step, 7);
  });
}

// An index written by hand, as a hostile tool could (its trailer is right: hash64 detects damage,
// not tampering): one shard `shard` of 1 byte, `parent` ("" for none), no tensors. The writer
// cannot produce it, since it re-reads every index it writes.
std::string hand_written_index(const std::string& dir, int64_t step, const std::string& shard,
                               const std::string& parent) {
  const std::string path = index_path(dir, step);
  std::vector<char> image;
  {
    h5::Handle f = h5::create_memory_file(path);
    h5::write_attr(f, "format_version", kFormatVersion);
    h5::write_attr(f, "step", step);
    h5::write_attr(f, "recipe", std::string("[model]\n"));
    h5::write_attr(f, "layout", std::string("test"));
    h5::write_attr(f, "id", std::vector<uint64_t>{100});
    h5::write_attr(f, "parent", parent);
    if (!parent.empty()) h5::write_attr(f, "parent_id", std::vector<uint64_t>{99});
    h5::write_attr(f, "shard_files", shard);
    h5::write_attr(f, "shard_bytes", std::vector<int64_t>{1});
    h5::write_attr(f, "shard_hash", std::vector<uint64_t>{1});
    {
      h5::Handle state(H5Gcreate2(f, "state", H5P_DEFAULT, H5P_DEFAULT, H5P_DEFAULT), H5Gclose);
      h5::write_attr(state, "step", step);
      state.close(path);
    }
    h5::write_attr(f, "complete", int64_t{1});
    image = h5::file_image(f, path);
    f.close(path);
  }
  const uint64_t len = image.size(), hash = hash64(image.data(), image.size());
  image.insert(image.end(), kIndexMagic, kIndexMagic + 8);
  for (const uint64_t v : {len, hash})
    for (int i = 0; i < 8; ++i) image.push_back(static_cast<char>(v >> (8 * i) & 0xff));
  std::ofstream(path, std::ios::binary)
      .write(image.data(), static_cast<std::streamsize>(image.size()));
  return path;
}

// The names an index holds are data: a shard or parent path leaving the snapshot directory, a
// shard dataset that is an external link into another file, an index or a shard that is a FIFO
// are refused naming the file. Every outside target that a path check guards is a FIFO: opening
// it would block, which the alarm turns into a failure, so passing proves it was never opened.
TEST_F(SnapshotFormat, ReadsOnlyRegularFilesInsideItsDirectory) {
  alarm(60);
  io_.run([&] {
    const std::string outside = dir_ + "_outside";
    fs::remove_all(outside);
    fs::create_directories(outside);
    const auto error_of = [](const std::string& index) -> std::string {
      try {
        SnapshotReader reader(index);
        reader.verify();
        std::vector<float> whole(30);
        reader.read({"model/w", {6, 5}, {0, 0}, {6, 5}, whole.data()}, kernels::kCpu);
      } catch (const UserError& e) {
        return e.what();
      }
      return "";
    };
    const Slice whole{"model/w", {6, 5}, {0, 0}, {6, 5}, global_.data()};
    // An index of one shard at `file` (relative to the snapshot directory).
    const auto index = [&](int64_t step, const std::string& file) {
      const FileDigest d = digest_file(dir_ + "/" + file);
      IndexInfo info;
      info.step = step, info.recipe = "[model]\n", info.layout = "test", info.id = 100 + step;
      info.counters = {{"step", step}};
      info.shards.push_back({file, d.bytes, d.hash});
      write_index(dir_, info);
      return index_path(dir_, step);
    };
    // A shard outside, named with `..`.
    const std::string far = outside + "/rank00000.h5";
    ASSERT_EQ(mkfifo(far.c_str(), 0600), 0);
    const std::string up = fs::path(far).lexically_relative(dir_).string();
    std::string e = error_of(hand_written_index(dir_, 8, up, ""));
    EXPECT_NE(e.find("`" + up + "`"), std::string::npos) << e;
    EXPECT_NE(e.find("not a plain relative path"), std::string::npos) << e;
    // A parent outside: an incremental snapshot whose parent names a FIFO there.
    const std::string parent_far = outside + "/step_00000010.h5";
    ASSERT_EQ(mkfifo(parent_far.c_str(), 0600), 0);
    const std::string parent_up = fs::path(parent_far).lexically_relative(dir_).string();
    e = error_of(hand_written_index(dir_, 11, "step_00000011/rank00000.h5", parent_up));
    EXPECT_NE(e.find(parent_up), std::string::npos) << e;
    EXPECT_NE(e.find("not a file name in its own directory"), std::string::npos) << e;
    // An index that is a FIFO, and one that is a symbolic link to it.
    const std::string fifo_index = index_path(dir_, 12);
    ASSERT_EQ(mkfifo(fifo_index.c_str(), 0600), 0);
    e = error_of(fifo_index);
    EXPECT_NE(e.find(fifo_index), std::string::npos) << e;
    EXPECT_NE(e.find("a FIFO"), std::string::npos) << e;
    fs::create_symlink(fifo_index, index_path(dir_, 13));
    EXPECT_NE(error_of(index_path(dir_, 13)).find("a FIFO"), std::string::npos);
    EXPECT_THROW(read_recipe(fifo_index), UserError);
    // An index that is a symbolic link to a device (reading /dev/zero would never end).
    fs::create_symlink("/dev/zero", index_path(dir_, 16));
    EXPECT_NE(error_of(index_path(dir_, 16)).find("a device"), std::string::npos);
    // A shard that is a FIFO.
    const std::string fifo_shard = shard_path(dir_, 14, 0);
    write_shard(fifo_shard, 0, {whole});
    publish(fifo_shard);
    const std::string by_fifo = index(14, "step_00000014/rank00000.h5");
    fs::remove(fifo_shard);
    ASSERT_EQ(mkfifo(fifo_shard.c_str(), 0600), 0);
    e = error_of(by_fifo);
    EXPECT_NE(e.find(fifo_shard), std::string::npos) << e;
    EXPECT_NE(e.find("a FIFO"), std::string::npos) << e;
    // A shard whose dataset is an external link to the same tensor in another file.
    const std::string other = outside + "/other.h5", linked = shard_path(dir_, 15, 0);
    write_shard(other, 0, {whole});
    publish(other);
    write_shard(linked, 0, {whole});
    publish(linked);
    {
      const hid_t f = H5Fopen(linked.c_str(), H5F_ACC_RDWR, H5P_DEFAULT);
      ASSERT_GE(f, 0);
      ASSERT_GE(H5Ldelete(f, "model/w", H5P_DEFAULT), 0);
      ASSERT_GE(
          H5Lcreate_external(other.c_str(), "/model/w", f, "model/w", H5P_DEFAULT, H5P_DEFAULT), 0);
      H5Fclose(f);
    }
    e = error_of(index(15, "step_00000015/rank00000.h5"));
    EXPECT_NE(e.find(linked), std::string::npos) << e;
    EXPECT_NE(e.find("external link"), std::string::npos) << e;
    fs::remove_all(outside);
  });
  alarm(0);
}

TEST_F(SnapshotFormat, RetentionKeepsNewest) {
  io_.run([&] {
    write_whole_snapshots({1, 2, 3});
    retain(dir_, 2);
    EXPECT_EQ(committed_steps(dir_), (std::vector<int64_t>{2, 3}));
    EXPECT_FALSE(fs::exists(dir_ + "/step_00000001"));
    EXPECT_EQ(find_latest(dir_, nullptr), index_path(dir_, 3));
  });
}

// Incremental chains: a tensor of three chunks, snapshots written as a trainer would (only the
// parent's chunk hashes are kept), read back through the chain.
class IncrementalSnapshot : public SnapshotFormat {
 protected:
  static constexpr int64_t kRows = 6, kCols = kChunkElems / 2;  // 2 rows a chunk: 3 chunks

  void SetUp() override {
    SnapshotFormat::SetUp();
    data_.resize(kRows * kCols);
    uint32_t x = 12345;
    for (auto& v : data_) v = static_cast<float>((x = x * 1664525u + 1013904223u) >> 8) * 1e-7f;
  }
  Slice slice(std::vector<float>& d) {
    return {"model/w", {kRows, kCols}, {0, 0}, {kRows, kCols}, d.data()};
  }

  // Writes step `step` of data_, incremental on the previous one written unless `full`.
  ShardResult write(int64_t step, bool full, int deflate = 1) {
    WriteOptions opt;
    opt.deflate = deflate;
    const std::vector<Slice> now{slice(data_)};
    if (!full) opt.previous_hashes = &parent_hashes_, opt.skip_unchanged = true;
    const std::string path = shard_path(dir_, step, 0);
    ShardResult r = write_shard(path, 0, now, opt);
    publish(path);
    IndexInfo info;
    info.step = step, info.counters = {{"step", step}}, info.id = 1000 + step + (full ? 0 : 1);
    info.shards.push_back(
        {fs::path(path).lexically_relative(dir_).string(), r.digest.bytes, r.digest.hash});
    if (!full) info.parent = snapshot_name(parent_step_) + ".h5", info.parent_id = parent_id_;
    write_index(dir_, info);
    parent_hashes_ = r.hashes, parent_step_ = step, parent_id_ = info.id;
    return r;
  }
  std::vector<float> read(int64_t step) {
    std::vector<float> out(data_.size());
    SnapshotReader reader(index_path(dir_, step));
    reader.read(slice(out), kernels::kCpu);
    return out;
  }
  static bool same_bits(const std::vector<float>& a, const std::vector<float>& b) {
    return a.size() == b.size() && std::memcmp(a.data(), b.data(), a.size() * 4) == 0;
  }
  std::string error_of(int64_t step) {
    try {
      read(step);
    } catch (const UserError& e) {
      return e.what();
    }
    return "";
  }

  std::vector<float> data_;
  std::vector<std::vector<uint64_t>> parent_hashes_;
  int64_t parent_step_ = 0;
  uint64_t parent_id_ = 0;

  // Steps 1 (full), 2 and 3 (one chunk changed each) and 4 (nothing changed), each read back
  // bit for bit; `deflate` 0 stores chunks directly, 1 through HDF5's filters.
  void check_chain(int deflate) {
    const std::vector<float> v1 = data_;
    EXPECT_EQ(write(1, true, deflate).chunks_written, 3);
    data_[5] = -0.0f, data_[7] = std::numeric_limits<float>::quiet_NaN();  // chunk 0 only
    const std::vector<float> v2 = data_;
    const ShardResult r2 = write(2, false, deflate);
    EXPECT_EQ(r2.chunks, 3);
    EXPECT_EQ(r2.chunks_written, 1);
    EXPECT_EQ(r2.chunks_unchanged, 2);
    for (int64_t i = 4 * kCols; i < kRows * kCols; ++i) data_[i] *= 1.0001f;  // chunk 2
    const std::vector<float> v3 = data_;
    EXPECT_EQ(write(3, false, deflate).chunks_written, 1);
    EXPECT_TRUE(same_bits(read(1), v1));
    EXPECT_TRUE(same_bits(read(2), v2));
    EXPECT_TRUE(same_bits(read(3), v3));
    SnapshotReader reader(index_path(dir_, 3));
    EXPECT_EQ(reader.chain().size(), 3u);
    EXPECT_EQ(reader.info().parent, "step_00000002.h5");
    // Another layout's box (a column split) rebuilt through the chain.
    std::vector<float> cols(kRows * 3);
    reader.read({"model/w", {kRows, kCols}, {0, kCols - 3}, {kRows, 3}, cols.data()},
                kernels::kCpu);
    for (int64_t r = 0; r < kRows; ++r)
      for (int64_t c = 0; c < 3; ++c) EXPECT_EQ(cols[r * 3 + c], v3[r * kCols + kCols - 3 + c]);
    // An unchanged snapshot is nearly free: no chunk is written.
    EXPECT_EQ(write(4, false, deflate).chunks_written, 0);
    EXPECT_LT(fs::file_size(shard_path(dir_, 4, 0)), fs::file_size(shard_path(dir_, 1, 0)) / 100);
    EXPECT_TRUE(same_bits(read(4), v3));
  }
};

// set_aside moves the named steps' snapshots out of the listing, and `latest` with them when it
// names one of them (it names the newest commit, so it would point at a snapshot no longer here).
TEST_F(SnapshotFormat, SetAsideMovesTheStepsAndTheLatestThatNamesOne) {
  io_.run([&] {
    write_whole_snapshots({1, 2, 3});
    ASSERT_TRUE(fs::exists(dir_ + "/latest"));
    set_aside(dir_, {1}, dir_ + "/aside-1");  // `latest` names step 3: it stays
    EXPECT_EQ(committed_steps(dir_), (std::vector<int64_t>{2, 3}));
    EXPECT_TRUE(fs::exists(dir_ + "/latest"));
    set_aside(dir_, {3}, dir_ + "/aside-3");
    EXPECT_EQ(committed_steps(dir_), (std::vector<int64_t>{2}));
    EXPECT_EQ(committed_steps(dir_ + "/aside-3"), (std::vector<int64_t>{3}));
    EXPECT_FALSE(fs::exists(dir_ + "/latest")) << "`latest` still names the step set aside";
    EXPECT_EQ(find_latest(dir_, nullptr), index_path(dir_, 2));
  });
}

TEST_F(IncrementalSnapshot, ChainRebuildsBitExactly) {
  io_.run([&] {
    require_deflate();  // Debian's HDF5 has zlib; the reason the default may compress
    check_chain(1);
  });
}

TEST_F(IncrementalSnapshot, ChainOfStoredChunksRebuildsBitExactly) {
  io_.run([&] { check_chain(0); });
}

// A shard handed over in waves (pieces of boxes, as a staging buffer smaller than the state
// does it) holds the very bytes of one written at once, and the same hashes.
TEST_F(IncrementalSnapshot, ShardWrittenInPiecesEqualsOneWrittenWhole) {
  io_.run([&] {
    std::vector<float> other(kCols * 3);
    for (size_t i = 0; i < other.size(); ++i) other[i] = static_cast<float>(i) * 0.5f;
    const std::vector<Slice> boxes{
        slice(data_), {"optim/exp_avg/v", {kCols * 3}, {0}, {kCols * 3}, other.data()}};
    const ShardResult whole = write_shard(shard_path(dir_, 1, 0), 0, boxes);
    ShardWriter w(shard_path(dir_, 2, 0), 0, boxes);
    ASSERT_EQ(w.chunks(0), 3);
    const int64_t c = w.chunk_elems_of(0);
    w.write(0, 0, 1, data_.data());
    w.write(0, 1, 3, data_.data() + c);
    w.write(1, 0, 1, other.data());
    w.write(1, 1, w.chunks(1), other.data() + w.chunk_elems_of(1));
    const ShardResult pieces = w.finish();
    EXPECT_EQ(pieces.hashes, whole.hashes);
    EXPECT_EQ(pieces.raw_bytes, whole.raw_bytes);
    // Every dataset, named alike, with the same bytes (HDF5 stamps object times, so the files
    // themselves differ).
    const auto datasets = [](const std::string& shard) {
      const std::string path = temp_path(shard);
      const h5::Handle f = h5::open_file(path);
      std::map<std::string, std::string> out;
      std::istringstream names(h5::read_string_attr(f, "tensors", path));
      for (std::string name; std::getline(names, name);) {
        const h5::Handle d = h5::open_dataset(f, name, path);
        std::string bytes(static_cast<size_t>(H5Dget_storage_size(d)), '\0');
        H5Dread(d, H5T_NATIVE_FLOAT, H5S_ALL, H5S_ALL, H5P_DEFAULT, bytes.data());
        out[name] = bytes;
      }
      return out;
    };
    const auto a = datasets(shard_path(dir_, 1, 0)), b = datasets(shard_path(dir_, 2, 0));
    EXPECT_EQ(a.size(), 2u);
    EXPECT_TRUE(a == b);
  });
}

TEST_F(IncrementalSnapshot, RefusesMissingReplacedOrDamagedAncestor) {
  io_.run([&] {
    write(1, true);
    data_[0] += 1;
    write(2, false);
    data_[1] += 1;
    write(3, false);
    // A damaged ancestor: the message names the snapshot asked for and the broken shard.
    const std::string shard1 = shard_path(dir_, 1, 0);
    fs::copy_file(shard1, shard1 + ".good");
    {
      std::fstream f(shard1, std::ios::in | std::ios::out | std::ios::binary);
      f.seekp(static_cast<std::streamoff>(fs::file_size(shard1) / 2));
      f.put('\x5a');
    }
    std::string e = error_of(3);
    EXPECT_NE(e.find("needs its ancestor"), std::string::npos) << e;
    EXPECT_NE(e.find("step_00000001/rank00000.h5"), std::string::npos) << e;
    EXPECT_EQ(find_latest(dir_, nullptr), "");  // no snapshot verifies: all rest on step 1
    fs::rename(shard1 + ".good", shard1);
    // A parent replaced by another snapshot of the same step.
    const std::string index2 = index_path(dir_, 2);
    fs::copy_file(index2, index2 + ".good");
    {
      IndexInfo other;
      other.step = 2, other.id = 77, other.counters = {{"step", 2}};
      const FileDigest d = digest_file(shard_path(dir_, 2, 0));
      other.shards.push_back({"step_00000002/rank00000.h5", d.bytes, d.hash});
      other.parent = "step_00000001.h5", other.parent_id = 1001;
      write_index(dir_, other);
    }
    e = error_of(3);
    EXPECT_NE(e.find("taken against another"), std::string::npos) << e;
    fs::rename(index2 + ".good", index2);
    // A missing parent.
    fs::remove(index2);
    e = error_of(3);
    EXPECT_NE(e.find("needs its parent"), std::string::npos) << e;
    EXPECT_NE(e.find("step_00000002.h5"), std::string::npos) << e;
    EXPECT_NE(e.find("missing"), std::string::npos) << e;
    EXPECT_EQ(find_latest(dir_, nullptr), index_path(dir_, 1));
  });
}

TEST_F(IncrementalSnapshot, RetentionKeepsWhatKeptSnapshotsNeed) {
  io_.run([&] {
    write(1, true);
    write(2, false);
    write(3, false);
    EXPECT_TRUE(retain(dir_, 1).empty());  // 3 is rebuilt from 2 and 1
    EXPECT_EQ(committed_steps(dir_), (std::vector<int64_t>{1, 2, 3}));
    write(4, true);
    write(5, false);
    retain(dir_, 2);
    EXPECT_EQ(committed_steps(dir_), (std::vector<int64_t>{4, 5}));
    EXPECT_FALSE(fs::exists(dir_ + "/step_00000002"));
    EXPECT_EQ(find_latest(dir_, nullptr), index_path(dir_, 5));
  });
}

TEST(SnapshotChunks, WholeRowsOfAboutOneMiB) {
  EXPECT_EQ(chunk_elems({10}), 10);
  EXPECT_EQ(chunk_elems({3 * kChunkElems}), kChunkElems);
  EXPECT_EQ(chunk_elems({4096, 256}), kChunkElems);               // 1024 rows
  EXPECT_EQ(chunk_elems({3, 100}), 300);                          // the whole box
  EXPECT_EQ(chunk_elems({2, kChunkElems * 2}), kChunkElems * 2);  // one row, however long
  EXPECT_EQ(chunk_elems({10, 300}) % 300, 0);
}

// The digest a shard writer records, built from the bytes as they went out (O_DIRECT, no second
// read of the file), is the one a reader computes from the file, whatever the shapes, the pieces
// the shard is handed over in, incremental or deflated; and it reads back only a few blocks.
TEST_F(IncrementalSnapshot, RecordedDigestIsTheFilesDigest) {
  io_.run([&] {
    std::vector<float> big(40 * kChunkElems + 12345), odd(1000 * 37), tiny(5);
    for (size_t i = 0; i < big.size(); ++i) big[i] = static_cast<float>(i) * 0.25f;
    for (size_t i = 0; i < odd.size(); ++i) odd[i] = static_cast<float>(i) * -1.5f;
    tiny = {1, 2, 3, 4, 5};
    const std::vector<Slice> boxes{slice(data_),
                                   {"optim/exp_avg/big",
                                    {static_cast<int64_t>(big.size())},
                                    {0},
                                    {static_cast<int64_t>(big.size())},
                                    big.data()},
                                   {"model/norm", {5}, {0}, {5}, tiny.data()},
                                   {"model/odd", {1000, 74}, {0, 37}, {1000, 37}, odd.data()}};
    const auto check = [&](const std::string& path, const ShardResult& r, const char* what) {
      const FileDigest d = digest_file(temp_path(path));
      EXPECT_EQ(r.digest.bytes, d.bytes) << what;
      EXPECT_EQ(r.digest.hash, d.hash) << what;
    };
    // Whole, then in pieces that cut boxes mid-way (as staging waves do).
    const ShardResult whole = write_shard(shard_path(dir_, 1, 0), 0, boxes);
    check(shard_path(dir_, 1, 0), whole, "whole");
    EXPECT_GT(whole.direct_bytes, whole.raw_bytes / 2);
    // Read back: the blocks with metadata (at the start) and the last, partial one.
    EXPECT_GT(whole.digest.bytes, 40u << 20);
    EXPECT_LE(whole.read_back_bytes, 3u * (4 << 20)) << whole.read_back_bytes;
    ShardWriter w(shard_path(dir_, 2, 0), 0, boxes);
    for (size_t b = 0; b < boxes.size(); ++b)
      for (int64_t c = 0; c < w.chunks(b); ++c)
        w.write(b, c, c + 1, boxes[b].data + c * w.chunk_elems_of(b));
    check(shard_path(dir_, 2, 0), w.finish(), "chunk by chunk");
    // Incremental (one chunk of the first box changed), stored as is and deflated.
    data_[3] += 1.0f;
    for (const int deflate : {0, 1}) {
      WriteOptions opt;
      opt.previous_hashes = &whole.hashes, opt.skip_unchanged = true, opt.deflate = deflate;
      const std::string path = shard_path(dir_, 3 + deflate, 0);
      const ShardResult r = write_shard(path, 0, boxes, opt);
      EXPECT_EQ(r.chunks_written, 1);
      check(path, r, deflate ? "incremental, deflated" : "incremental");
      // The blocks allocated up front for every chunk are trimmed: the file ends where HDF5's
      // data does (a reader would otherwise carry ~40 MiB of zeros in the digest).
      EXPECT_LT(r.digest.bytes, whole.digest.bytes / 4) << deflate;
    }
  });
}

TEST(SnapshotHash, StreamedInPiecesEqualsWhole) {
  std::vector<unsigned char> a(1000);
  for (size_t i = 0; i < a.size(); ++i) a[i] = static_cast<unsigned char>(i * 7 + 3);
  for (size_t n : {0, 5, 31, 32, 33, 64, 100, 1000})
    for (size_t cut : {0, 1, 7, 31, 32, 40, 63, 999}) {
      if (cut > n) continue;
      Hash64Stream s(n);
      s.update(a.data(), cut);
      for (size_t i = cut; i < n; i += 3) s.update(a.data() + i, std::min<size_t>(3, n - i));
      EXPECT_EQ(s.value(), hash64(a.data(), n, n)) << n << " cut at " << cut;
    }
}

// Blocks written out of order, twice, in part, or overwritten are read back: the digest is
// digest_file's either way.
TEST_F(SnapshotFormat, DigestOfWrittenBytesEqualsTheFiles) {
  const size_t block = 4 << 20;
  std::vector<unsigned char> bytes(3 * block + 1000);
  for (size_t i = 0; i < bytes.size(); ++i) bytes[i] = static_cast<unsigned char>(i * 31 + 7);
  const std::string path = dir_ + "/f.bin";
  std::ofstream(path, std::ios::binary)
      .write(reinterpret_cast<const char*>(bytes.data()),
             static_cast<std::streamsize>(bytes.size()));
  const FileDigest want = digest_file(path);
  FileDigestBuilder in_order;
  in_order.written(0, bytes.data(), 100);
  in_order.written(100, bytes.data() + 100, bytes.size() - 100);
  uint64_t read_back = 0;
  FileDigest got = in_order.finish(path, &read_back);
  EXPECT_EQ(got.hash, want.hash);
  EXPECT_EQ(got.bytes, want.bytes);
  EXPECT_EQ(read_back, 1000u);  // only the last, partial block
  FileDigestBuilder mixed;
  mixed.written(block, bytes.data() + block, block);                // block 1 whole
  mixed.written(2 * block + 8, bytes.data() + 2 * block + 8, 100);  // block 2 from its middle
  mixed.written(0, bytes.data(), block);                            // block 0, after block 1
  mixed.overwritten(block + 5, 1);                                  // block 1 touched again
  EXPECT_EQ(mixed.finish(path, &read_back).hash, want.hash);
  EXPECT_EQ(read_back, 2 * block + 1000);  // blocks 1, 2 and the partial one
  FileDigestBuilder wrong;  // bytes other than the file's in a block taken from memory
  std::vector<unsigned char> other(bytes.begin(), bytes.begin() + block);
  other[17] ^= 1;
  wrong.written(0, other.data(), block);
  EXPECT_NE(wrong.finish(path).hash, want.hash);
}

TEST(SnapshotHash, SensitiveToEveryByte) {
  std::vector<unsigned char> a(1000, 3);
  const uint64_t h = hash64(a.data(), a.size());
  for (size_t i : {0, 31, 32, 500, 999}) {
    auto b = a;
    b[i] ^= 1;
    EXPECT_NE(hash64(b.data(), b.size()), h) << i;
  }
  EXPECT_NE(hash64(a.data(), 999), h);
}

}  // namespace
}  // namespace t3d::checkpoint
