// The snapshot format without MPI or a trainer: shards written by one layout read back by
// another, bit-exactly; damage inside a chunk is caught by its content hash.
#include <gtest/gtest.h>
#include <unistd.h>

#include <filesystem>
#include <fstream>
#include <numeric>

#include "checkpoint/io_thread.h"
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
    IndexInfo info{7, "[model]\n", "pp=1 dp=1 cp=1 tp=2", {{"step", 7}}, {}};
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

  std::string dir_;
  std::vector<float> global_;
  IoThread io_;  // HDF5 on one thread, as in titan3d
};

TEST_F(SnapshotFormat, ReadsAnyBoxAcrossShards) {
  io_.run([&] {
    SnapshotReader reader(write_two_row_shards());
    EXPECT_EQ(reader.info().step, 7);
    EXPECT_EQ(reader.info().counters.at("step"), 7);
    std::vector<float> whole(30);
    reader.read({"model/w", {6, 5}, {0, 0}, {6, 5}, whole.data()});
    EXPECT_EQ(whole, global_);
    // A column split straddling both row shards (a tp2 row-parallel layout).
    std::vector<float> cols(6 * 2);
    reader.read({"model/w", {6, 5}, {0, 3}, {6, 2}, cols.data()});
    for (int r = 0; r < 6; ++r)
      for (int c = 0; c < 2; ++c) EXPECT_EQ(cols[r * 2 + c], global_[r * 5 + 3 + c]);
    EXPECT_THROW(reader.read({"model/w", {6, 4}, {0, 0}, {6, 4}, whole.data()}), UserError);
    EXPECT_THROW(reader.read({"model/x", {6, 5}, {0, 0}, {6, 5}, whole.data()}), UserError);
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
      reader.read({"model/w", {6, 5}, {0, 0}, {6, 5}, whole.data()});
      FAIL() << "a damaged shard was read";
    } catch (const UserError& e) {
      EXPECT_NE(std::string(e.what()).find("rank00001.h5"), std::string::npos) << e.what();
    }
  });
}

TEST_F(SnapshotFormat, RetentionKeepsNewest) {
  io_.run([&] {
    for (int64_t step : {1, 2, 3}) {
      IndexInfo info{step, "", "", {{"step", step}}, {}};
      Slice s{"model/w", {6, 5}, {0, 0}, {6, 5}, global_.data()};
      const std::string path = shard_path(dir_, step, 0);
      const FileDigest d = write_shard(path, 0, {s}).digest;
      publish(path);
      info.shards.push_back({fs::path(path).lexically_relative(dir_).string(), d.bytes, d.hash});
      write_index(dir_, info);
    }
    retain(dir_, 2);
    EXPECT_EQ(committed_steps(dir_), (std::vector<int64_t>{2, 3}));
    EXPECT_FALSE(fs::exists(dir_ + "/step_00000001"));
    EXPECT_EQ(find_latest(dir_, nullptr), index_path(dir_, 3));
  });
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
