// Snapshotter on 2 data-parallel ranks with a tiny real Model and ShardedState, against a
// temporary directory: stage, write, commit (the index and published shards), restore into a
// fresh state (another seed) bit for bit under every ZeRO stage; a failed write dropped with the
// previous snapshot still restorable; retention that removes only this run's older snapshots; the
// memory tier over two hosts faked by name (each rank its own): buddy copies, and a restart whose
// host lost its /dev/shm directory gets every shard moved to it and restores bit for bit.
// The Job is built by hand: a recipe struct and the mesh of the two ranks (pp 1, dp 2).
#include <gtest/gtest.h>
#include <mpi.h>
#include <unistd.h>

#include <chrono>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <filesystem>
#include <fstream>
#include <memory>
#include <string>
#include <thread>
#include <vector>

#include "checkpoint/memory_tier_files.h"
#include "checkpoint/snapshot.h"
#include "kernels/arena.h"
#include "parallel/comm.h"
#include "parallel/mesh.h"
#include "parallel/zero.h"
#include "runtime/launch/job.h"
#include "runtime/model/model.h"
#include "runtime/train/memory_tier_copies.h"
#include "runtime/train/sharded_state.h"
#include "runtime/train/snapshots.h"
#include "tests/train/small_model.h"

namespace t3d::runtime {
namespace {

namespace fs = std::filesystem;
namespace ck = checkpoint;

constexpr double kBucketMb = kSmallModelBucketMb;

// `data`: a file the stored recipe can name (resume re-validates it).
Recipe small_recipe(const std::string& dir, const std::string& data, int zero) {
  Recipe r;
  r.model = small_model();
  r.parallel.dp = 2;
  r.parallel.zero = zero;
  r.parallel.bucket_mb = kBucketMb;
  r.train.steps = 10;
  r.data.path = data;
  r.snapshot.every = 1;
  r.snapshot.dir = dir;
  r.snapshot.keep = 3;
  r.snapshot.full_every = 1;
  return r;
}

// One rank's job, model and state under the recipe's ZeRO stage, initialised from `seed`.
struct Rank {
  Job job;
  kernels::Arena arena{size_t{64} << 20};
  std::unique_ptr<Model> model;
  std::unique_ptr<TrainingState> training;
  ShardedState* state = nullptr;  // the dense model's only group

  Rank(const Recipe& recipe, uint64_t seed) {
    job.recipe = recipe;
    job.set_precision({});  // fp32 OpenBLAS, as the Model's options: what snapshots record
    job.mesh = std::make_unique<parallel::Mesh>(parallel::MeshShape(1, 2, 1, 1, 1),
                                                parallel::Comm::world(60.0));
    const int zero = static_cast<int>(recipe.parallel.zero);
    ModelOptions o;
    const parallel::FullRegions full = parallel::full_regions(zero);
    o.param_region = full.params, o.grad_region = full.grads, o.with_optimizer = full.moments;
    model =
        std::make_unique<Model>(recipe.model, std::vector<parallel::LayerRange>{{0, 3, true, true}},
                                job.mesh->group(parallel::Dim::tp), arena, o);
    training = std::make_unique<TrainingState>(*model, job.mesh->dp_cp(), job.mesh->dp_cp(), zero,
                                               kBucketMb, arena);
    training->init(seed);
    state = &training->dense();
  }

  // An AdamW step on gradients derived from `salt`: parameters and both moments change.
  void step(int salt) {
    state->for_each_piece(state->owned(), [&](const ShardedState::Piece& p) {
      float* g = state->grads(p);
      for (int64_t k = 0; k < p.size(); ++k)
        g[k] = 0.01f * static_cast<float>(((p.lo + k) * 37 + salt * 11) % 101 - 50);
    });
    state->adamw_step(job.recipe.train, 1e-2, salt, 1.0f);
  }

  // This rank's owned parameters and moments, back to back.
  std::vector<float> owned() const {
    std::vector<float> out;
    state->for_each_piece(state->owned(), [&](const ShardedState::Piece& p) {
      for (float* a : {state->params(p), state->exp_avg(p), state->exp_avg_sq(p)})
        out.insert(out.end(), a, a + p.size());
    });
    return out;
  }
  // Every parameter the model reads: the region (ZeRO 0-2), or each gathered bucket (ZeRO 3).
  std::vector<float> model_params() {
    if (job.recipe.parallel.zero < 3) {
      const float* region = model->state().params.data();
      return {region, region + model->layout().total_floats()};
    }
    std::vector<float> out;
    for (size_t b = 0; b < state->reducer().buckets().size(); ++b) {
      const auto& bucket = state->reducer().buckets()[b];
      const float* got = state->reducer().bucket_params(static_cast<int>(b));
      out.insert(out.end(), got, got + (bucket.end - bucket.begin));
    }
    return out;
  }
};

// Bit for bit: NaN payloads and signed zeros included.
::testing::AssertionResult same_bits(const std::vector<float>& want,
                                     const std::vector<float>& got) {
  if (want.size() != got.size())
    return ::testing::AssertionFailure() << want.size() << " floats, got " << got.size();
  for (size_t i = 0; i < want.size(); ++i)
    if (std::memcmp(&want[i], &got[i], sizeof(float)) != 0)
      return ::testing::AssertionFailure() << "float " << i << ": " << want[i] << " != " << got[i];
  return ::testing::AssertionSuccess();
}

class SnapshotsTest : public ::testing::Test {
 protected:
  parallel::Comm world = parallel::Comm::world(60.0);
  std::string dir, data;

  // A fresh directory both ranks see (rank 0 makes it, with a small training file), removed
  // afterwards.
  void SetUp() override {
    ASSERT_EQ(world.size(), 2);
    char name[4096] = {};
    if (world.rank() == 0) {
      std::string tmpl = (fs::temp_directory_path() / "t3d_snapshots_XXXXXX").string();
      ASSERT_NE(mkdtemp(tmpl.data()), nullptr);
      std::strncpy(name, tmpl.c_str(), sizeof(name) - 1);
      std::FILE* f = std::fopen((tmpl + "/corpus.txt").c_str(), "w");
      ASSERT_NE(f, nullptr);
      std::fputs("a few words to train on\n", f);
      std::fclose(f);
    }
    world.broadcast(name, sizeof(name), 0);
    dir = std::string(name) + "/snapshots";
    data = std::string(name) + "/corpus.txt";
  }
  // A fresh rank (another seed) resuming `latest` from `run`'s directory restores step `step`,
  // its owned state bit for bit `want`.
  static void expect_latest_is(Recipe run, int64_t step, const std::vector<float>& want) {
    run.snapshot.resume = "latest";
    Rank b(run, 99);
    Snapshotter snap(b.job, *b.model, *b.training, nullptr);
    EXPECT_EQ(snap.restore(), step);
    b.state->restored();
    EXPECT_TRUE(same_bits(want, b.owned()));
  }
  Recipe recipe(const std::string& in, int zero) const { return small_recipe(in, data, zero); }
  void TearDown() override {
    world.barrier();
    if (world.rank() == 0) fs::remove_all(fs::path(dir).parent_path());
  }

  std::vector<int64_t> committed() const { return ck::committed_steps(dir); }
  std::vector<int64_t> committed(const std::string& in) const { return ck::committed_steps(in); }
};

TEST_F(SnapshotsTest, WriteCommitRestoreEveryZeroStage) {
  for (int zero : {0, 1, 2, 3}) {
    SCOPED_TRACE("ZeRO " + std::to_string(zero));
    const std::string here = dir + "/zero" + std::to_string(zero);
    Rank a(recipe(here, zero), 7);
    a.step(1);
    std::vector<float> want, want_params;
    {
      Snapshotter snap(a.job, *a.model, *a.training, nullptr);
      EXPECT_EQ(snap.restore(), 0);  // nothing to resume: a fresh start
      snap.after_step(1, false);     // due: staged, written in the background
      want = a.owned();
      want_params = a.model_params();
      snap.before_state_changes();  // as the trainer does before each optimizer step
      a.step(2);  // training goes on while the write runs: the snapshot holds step 1's state
      snap.finish();
    }
    // Committed: the index, and this rank's shard published under its final name.
    EXPECT_EQ(committed(here), std::vector<int64_t>{1});
    EXPECT_TRUE(fs::exists(ck::index_path(here, 1)));
    const std::string shard = ck::shard_path(here, 1, world.rank());
    EXPECT_TRUE(fs::exists(shard));
    EXPECT_FALSE(fs::exists(ck::temp_path(shard)));
    ASSERT_NE(want, a.owned()) << "the second step changed nothing: the test proves nothing";

    Recipe resume = recipe(here, zero);
    resume.snapshot.resume = ck::index_path(here, 1);
    Rank b(resume, 99);
    ASSERT_NE(b.owned(), want) << "another seed gives the same state: the test proves nothing";
    Snapshotter snap(b.job, *b.model, *b.training, nullptr);
    EXPECT_EQ(snap.restore(), 1);
    b.state->restored();
    EXPECT_TRUE(same_bits(want, b.owned()));
    EXPECT_TRUE(same_bits(want_params, b.model_params()));
  }
}

// Rank 1's write of step 2 fails like a full disk: the snapshot is dropped on every rank, no
// file of it remains, the run's final state is reported lost, and step 1 restores.
TEST_F(SnapshotsTest, FailedWriteIsDroppedAndThePreviousOneRestores) {
  Rank a(recipe(dir, 1), 7);
  a.step(1);
  std::vector<float> want;
  {
    Snapshotter snap(a.job, *a.model, *a.training, nullptr);
    snap.restore();
    snap.after_step(1, false);
    want = a.owned();
    snap.before_state_changes();
    a.step(2);
    ASSERT_EQ(setenv("T3D_SNAPSHOT_FAULT", "fail:2:1", 1), 0);
    snap.after_step(2, true);  // commits step 1, then starts step 2
    int exit_code = -1;
    try {
      snap.finish();
    } catch (const AgreedFailure& f) {
      exit_code = f.exit_code;
    }
    unsetenv("T3D_SNAPSHOT_FAULT");
    EXPECT_EQ(exit_code, 2) << "a run whose last snapshot failed must not end as a success";
  }
  EXPECT_EQ(committed(), std::vector<int64_t>{1});
  for (int rank = 0; rank < 2; ++rank) {
    const std::string shard = ck::shard_path(dir, 2, rank);
    EXPECT_FALSE(fs::exists(shard)) << shard;
    EXPECT_FALSE(fs::exists(ck::temp_path(shard))) << shard;
  }

  expect_latest_is(recipe(dir, 1), 1, want);
}

// snapshot.keep = 2 keeps this run's two newest. A previous run's snapshots in the directory
// (steps 4 and 5, newer than any of this run's) are set aside at the fresh start, untouched by
// retention, and never taken for this run's.
TEST_F(SnapshotsTest, RetentionRemovesOnlyThisRunsOlderSnapshots) {
  Recipe base = recipe(dir, 0);
  base.snapshot.keep = 2;
  {
    Rank previous(base, 7);
    Snapshotter snap(previous.job, *previous.model, *previous.training, nullptr);
    snap.restore();
    for (int64_t s = 1; s <= 5; ++s) snap.after_step(s, s == 5);
    snap.finish();
  }
  EXPECT_EQ(committed(), (std::vector<int64_t>{4, 5}));

  Rank run(base, 11);
  Snapshotter snap(run.job, *run.model, *run.training, nullptr);
  EXPECT_EQ(snap.restore(), 0);  // a fresh start: the previous run's snapshots are set aside
  EXPECT_TRUE(committed().empty());
  std::vector<float> newest;
  for (int64_t s = 1; s <= 3; ++s) {
    snap.before_state_changes();
    run.step(static_cast<int>(s));
    snap.after_step(s, s == 3);
    EXPECT_EQ(committed().size(), static_cast<size_t>(std::min<int64_t>(s - 1, 2)))
        << "after step " << s;  // the snapshot of step s is still being written
  }
  newest = run.owned();
  snap.finish();
  world.barrier();
  EXPECT_EQ(committed(), (std::vector<int64_t>{2, 3}));
  EXPECT_FALSE(fs::exists(fs::path(dir) / ck::snapshot_name(1)));
  // The previous run's two snapshots, whole, in the one set-aside directory.
  int set_aside = 0;
  for (const auto& entry : fs::directory_iterator(dir)) {
    if (entry.path().filename().string().rfind("set-aside-", 0) != 0) continue;
    ++set_aside;
    EXPECT_EQ(ck::committed_steps(entry.path().string()), (std::vector<int64_t>{4, 5}));
  }
  EXPECT_EQ(set_aside, 1);

  expect_latest_is(base, 3, newest);
}

// The memory tier with each rank on a "host" of its own (names given, as a two-host job's would
// be): a memory snapshot is committed in both hosts' directories, each holding its rank's shard and
// the other's buddy copy. Host B's directory is then lost while host B lives: the restart moves
// every shard to it from host A over MPI, writes the index on both, and both ranks restore step
// 10 bit for bit (tier: memory); a clean end removes both directories.
TEST_F(SnapshotsTest, MemoryTierBuddyCopiesAndAHostThatLostItsDirectory) {
  int32_t nonce = (std::rand() ^ static_cast<int32_t>(getpid())) & 0x7fffffff;
  world.broadcast(&nonce, 1, 0);
  char id[64];
  std::snprintf(id, sizeof(id), "7e57%012x-%08x", static_cast<unsigned>(nonce),
                static_cast<unsigned>(nonce));
  ::setenv("T3D_MEMORY_TIER_JOB", id, 1);
  const std::vector<std::string> hosts = {"t3dtest-a", "t3dtest-b"};
  const auto on_hosts = [&](Rank& r) {
    r.job.hosts = hosts;
    r.job.hostname = hosts[static_cast<size_t>(world.rank())];
    r.job.run_dir = fs::path(dir).parent_path().string();
  };
  Recipe run = recipe(dir, 1);
  run.snapshot.every = 0;  // only the memory tier
  run.snapshot.memory_every = 10;
  const std::string mine = ck::memory_tier_dir(id, hosts[static_cast<size_t>(world.rank())]);
  const std::string other = ck::memory_tier_dir(id, hosts[static_cast<size_t>(1 - world.rank())]);
  Rank a(run, 7);
  on_hosts(a);
  a.step(1);
  std::vector<float> want;
  {
    ::setenv("T3D_MEMORY_TIER_RESTORE", "0", 1);
    Snapshotter snap(a.job, *a.model, *a.training, nullptr);
    EXPECT_EQ(snap.restore(), 0);
    snap.after_step(10, false);  // memory snapshot 10: written in the background
    want = a.owned();
    snap.before_state_changes();
    a.step(2);
    // Step boundaries until it is committed on both hosts: its shards written, then its copies
    // moved (each found done at a later boundary), then the manifests.
    for (int64_t step = 11, committed = 0; step < 20 && !committed; ++step) {
      std::this_thread::sleep_for(std::chrono::milliseconds(50));
      snap.after_step(step, false);
      committed = ck::manifest_steps(mine).empty() ? 0 : 1;
      world.all_reduce(&committed, 1, parallel::ReduceOp::min);
    }
  }
  world.barrier();
  // Both directories: the manifest of step 10 and both shards (one of them the buddy copy).
  for (const std::string& d : {mine, other}) {
    EXPECT_EQ(ck::manifest_steps(d), std::vector<int64_t>{10}) << d;
    for (int k = 0; k < 2; ++k) EXPECT_TRUE(fs::exists(ck::shard_path(d, 10, k))) << d << " " << k;
  }
  world.barrier();
  if (world.rank() == 1) fs::remove_all(mine);  // host B lost its /dev/shm, and lives on
  world.barrier();

  run.snapshot.resume = "latest";
  ::setenv("T3D_MEMORY_TIER_RESTORE", "1", 1);
  Rank b(run, 99);
  on_hosts(b);
  {
    Snapshotter snap(b.job, *b.model, *b.training, nullptr);
    EXPECT_EQ(snap.restore(), 10);
    b.state->restored();
    EXPECT_TRUE(same_bits(want, b.owned()));
    for (int k = 0; k < 2; ++k) EXPECT_TRUE(fs::exists(ck::shard_path(mine, 10, k))) << k;
    EXPECT_TRUE(fs::exists(ck::index_path(mine, 10)));
    snap.finish();  // a clean end: the tier goes
  }
  world.barrier();
  EXPECT_FALSE(fs::exists(mine));
  if (world.rank() == 0) {
    std::ifstream incidents(fs::path(dir).parent_path() / "incidents.jsonl");
    std::string line;
    ASSERT_TRUE(std::getline(incidents, line));
    EXPECT_NE(line.find("\"tier\": \"memory\", \"snapshot_step\": 10,"), std::string::npos) << line;
  }
  ::unsetenv("T3D_MEMORY_TIER_JOB");
  ::unsetenv("T3D_MEMORY_TIER_RESTORE");
  ck::remove_memory_tiers(std::string(id) + "-");
}

// A memory-tier restore brings each host only the shards its ranks read: a tensor split by
// rows over shards 0 and 1, and shard 2 holding another tensor's ZeRO piece (`~1`). Three
// hosts (ranks 0 and 1 on the first); the first holds shards 0 and 2, the third shard 1.
TEST(MemoryTierRestore, EachHostGetsOnlyTheShardsItsRanksRead) {
  const std::vector<ck::ShardEntry> shards = {
      {"s/r0.h5", 10, 0}, {"s/r1.h5", 20, 0}, {"s/r2.h5", 30, 0}};
  const std::vector<ck::ShardPiece> pieces = {{"s/r0.h5", "model/w", {4, 6}, {0, 0}, {2, 6}},
                                              {"s/r1.h5", "model/w", {4, 6}, {2, 0}, {2, 6}},
                                              {"s/r2.h5", "optim/exp_avg/v~1", {100}, {40}, {60}}};
  float x = 0;
  const auto box = [&](const char* path, std::vector<int64_t> g, std::vector<int64_t> o,
                       std::vector<int64_t> sh) {
    return ck::Slice{path, g, o, sh, &x};
  };
  // Rows 2..3: shard 1 only; a column strip: both; the moment's first 40: none; 30..50: shard 2.
  EXPECT_EQ(shards_read(shards, pieces, {box("model/w", {4, 6}, {2, 0}, {2, 6})}),
            (std::vector<char>{0, 1, 0}));
  EXPECT_EQ(shards_read(shards, pieces, {box("model/w", {4, 6}, {0, 5}, {4, 1})}),
            (std::vector<char>{1, 1, 0}));
  EXPECT_EQ(shards_read(shards, pieces, {box("optim/exp_avg/v", {100}, {0}, {40})}),
            (std::vector<char>{0, 0, 0}));
  EXPECT_EQ(shards_read(shards, pieces,
                        {box("optim/exp_avg/v", {100}, {30}, {20}),
                         box("model/w", {4, 6}, {0, 0}, {1, 6})}),
            (std::vector<char>{1, 0, 1}));

  const HostRing ring = host_ring({"a", "a", "b", "c"});
  ASSERT_EQ(ring.leader, (std::vector<int>{0, 2, 3}));
  // Per rank, then shard. Held: host a (ranks 0, 1: only its leader reports) shards 0 and 2,
  // host c shard 1; host b nothing.
  const std::vector<char> held = {1, 0, 1, /*1*/ 0, 0, 0, /*2*/ 0, 0, 0, /*3*/ 0, 1, 0};
  // Rank 1 (host a) reads shard 1; rank 2 (host b) shard 0; rank 3 (host c) shards 1 and 2.
  const std::vector<char> read = {1, 0, 0, /*1*/ 0, 1, 0, /*2*/ 1, 0, 0, /*3*/ 0, 1, 1};
  const auto moves = restore_moves(ring, shards, held, read);
  std::vector<std::string> got;
  for (const auto& m : moves)
    got.push_back(std::to_string(m.src) + ">" + std::to_string(m.dst) + " " + m.file + " " +
                  std::to_string(m.bytes));
  EXPECT_EQ(got, (std::vector<std::string>{"3>0 s/r1.h5 20", "0>2 s/r0.h5 10", "0>3 s/r2.h5 30"}));
}

// The one agreement on a failure (job.h) that agree_on and the snapshots' commits share: the
// lowest failing rank, and its error, alike on every rank.
TEST(AgreedFailure, TheLowestFailingRankAndItsErrorReachEveryRank) {
  const parallel::Comm world = parallel::Comm::world(60.0);
  ASSERT_EQ(world.size(), 2);
  EXPECT_EQ(first_failing_rank(world, false), 2);
  EXPECT_EQ(first_failing_rank(world, true), 0);
  EXPECT_EQ(first_failing_rank(world, world.rank() == 1), 1);
  EXPECT_EQ(agreed_error(world, ""), "");
  EXPECT_EQ(agreed_error(world, world.rank() == 1 ? "disk full" : ""), "rank 1: disk full");
  EXPECT_EQ(agreed_error(world, "failed on " + std::to_string(world.rank())),
            "rank 0: failed on 0");
}

}  // namespace
}  // namespace t3d::runtime
