// selfcheck's device communicator rows (runtime/selfcheck/selfcheck_device_comm.cpp), their host
// logic on the CPU: the path a row names is the one training chooses (choose_device_comm, the same
// function StageGroups calls) for a group of one rank, ranks sharing a GPU, parallel.device_comm
// = "staged" and NCCL not loaded, summarised over the world's ranks; and the bandwidth row's
// text and nccl-tests' bus bandwidth factor.
#include <gtest/gtest.h>

#include <string>
#include <vector>

#include "parallel/nccl_library.h"
#include "runtime/selfcheck/selfcheck_internal.h"
#include "runtime/stage/device_comm.h"
#include "tests/stage/nccl_fixtures.h"

namespace t3d::runtime::selfcheck {
namespace {

using testing::loaded_nccl;
using testing::missing_nccl;

// One host, two GPUs, one rank each.
std::vector<RankDevice> own_gpus() {
  return {{"a", "0000:1b:00.0", true}, {"a", "0000:2c:00.0", true}};
}

// The row's scope and detail for `ranks` of one group (every world rank in that one group).
PathSummary row_of(DeviceComm key, const std::vector<RankDevice>& ranks,
                   const parallel::NcclLibrary& nccl) {
  const DeviceCommPath p = choose_device_comm(key, "tp", ranks, nccl);
  return summarize_paths(std::vector<DeviceCommPath>(ranks.size(), p));
}

TEST(SelfcheckDeviceComm, NamesNcclWhereEveryRankHasAGpuOfItsOwn) {
  const PathSummary s = row_of(DeviceComm::kAuto, own_gpus(), loaded_nccl());
  EXPECT_EQ(s.name, "nccl");
  EXPECT_EQ(s.detail, "NCCL 2.28.9 (2 ranks, one GPU each)");
}

TEST(SelfcheckDeviceComm, NamesStagedAndWhyForOneRank) {
  const PathSummary s = row_of(DeviceComm::kAuto, {own_gpus()[0]}, loaded_nccl());
  EXPECT_EQ(s.name, "staged");
  EXPECT_EQ(s.detail, "staged through host memory (one rank: NCCL would only add its start-up)");
}

TEST(SelfcheckDeviceComm, NamesStagedAndWhyForRanksSharingAGpu) {
  const std::vector<RankDevice> shared = {{"a", "0000:1b:00.0", true}, {"a", "0000:1b:00.0", true}};
  const PathSummary s = row_of(DeviceComm::kAuto, shared, loaded_nccl());
  EXPECT_EQ(s.name, "staged");
  EXPECT_EQ(s.detail,
            "staged through host memory (ranks 0 and 1 share GPU 0000:1b:00.0 on a, which NCCL "
            "refuses)");
}

TEST(SelfcheckDeviceComm, NamesStagedWhenTheKeyForcesIt) {
  const PathSummary s = row_of(DeviceComm::kStaged, own_gpus(), loaded_nccl());
  EXPECT_EQ(s.name, "staged");
  EXPECT_EQ(s.detail, "staged through host memory (parallel.device_comm = \"staged\")");
}

TEST(SelfcheckDeviceComm, NamesStagedAndWhereNcclWasLookedForWhenItIsMissing) {
  const PathSummary s = row_of(DeviceComm::kAuto, own_gpus(), missing_nccl());
  EXPECT_EQ(s.name, "staged");
  EXPECT_EQ(s.detail,
            "staged through host memory (NCCL not loaded: looked for "
            "T3D_NCCL_LIBRARY=/nowhere/libnccl.so.2: no such file)");
}

TEST(SelfcheckDeviceComm, GroupsOfAKindThatChooseDifferentlyShowBoth) {
  // Two tp groups: one on two GPUs, one on a shared GPU; a rank that could not choose (empty
  // detail, its failure is the row's) is left out.
  const DeviceCommPath nccl =
      choose_device_comm(DeviceComm::kAuto, "tp", own_gpus(), loaded_nccl());
  const std::vector<RankDevice> shared = {{"b", "0000:1b:00.0", true}, {"b", "0000:1b:00.0", true}};
  const DeviceCommPath staged = choose_device_comm(DeviceComm::kAuto, "tp", shared, loaded_nccl());
  const PathSummary s = summarize_paths({staged, nccl, nccl, staged, DeviceCommPath{}});
  EXPECT_EQ(s.name, "nccl+staged");
  EXPECT_EQ(s.detail, staged.detail + "; " + nccl.detail);
}

TEST(SelfcheckDeviceComm, PathNamesAreNcclAndStaged) {
  EXPECT_STREQ(path_name(DeviceCommPath{true, ""}), "nccl");
  EXPECT_STREQ(path_name(DeviceCommPath{false, ""}), "staged");
}

TEST(SelfcheckBandwidth, RowHasNcclTestsBusBandwidth) {
  EXPECT_DOUBLE_EQ(all_reduce_bus_factor(2), 1.0);
  EXPECT_DOUBLE_EQ(all_reduce_bus_factor(4), 1.5);
  EXPECT_DOUBLE_EQ(all_reduce_bus_factor(8), 1.75);
  // 1 MiB in 1 ms over 4 ranks: algbw 1.048576 GB/s, busbw 1.5 times that.
  const CheckRow row = bandwidth_row("tp", 1 << 20, 1e-3, 4, "device memory");
  EXPECT_EQ(row.check, "bandwidth");
  EXPECT_EQ(row.group, "tp");
  EXPECT_EQ(row.scope, "1 MiB");
  EXPECT_EQ(row.status, CheckStatus::info);
  EXPECT_EQ(row.detail,
            "all_reduce    1.000 ms  algbw   1.049 GB/s  busbw   1.573 GB/s  device memory");
}

}  // namespace
}  // namespace t3d::runtime::selfcheck
