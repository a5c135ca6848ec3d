// The bandwidth measurement selfcheck runs on a device communicator (time_all_reduce and its row,
// runtime/selfcheck/selfcheck_internal.h), here on the staged one over host memory (a CPU Exec:
// its copies are plain copies; on a GPU the same code copies device memory): it runs, every rank
// gets the same positive time, and the row's bus bandwidth is 2(n-1)/n of its algorithm
// bandwidth. Then the device_comm rows' whole flow (tensor_group_rows: training's choice, the
// agreed row, training's open_device_comm, the measurement) with a CPU device, where training's
// functions give StagedComms over host memory: "staged" rows with positive bandwidth, and
// parallel.device_comm = "nccl" a FAILED row per group naming it and why, on every rank alike (no
// crash, no hang). Run under mpirun -np 2 and 3.
#include <gtest/gtest.h>

#include <cstdio>
#include <string>
#include <vector>

#include "kernels/device.h"
#include "kernels/exec.h"
#include "parallel/comm.h"
#include "parallel/mesh.h"
#include "parallel/staged_comm.h"
#include "runtime/selfcheck/selfcheck_internal.h"

namespace t3d::runtime::selfcheck {
namespace {

TEST(SelfcheckBandwidth, TheStagedCommunicatorsMeasurementGivesAPositiveRow) {
  const parallel::Comm world = parallel::Comm::world(60.0);
  const parallel::StagedComm staged(world, kernels::kCpu);
  const int n = world.size();
  for (size_t bytes : bandwidth_sizes(/*quick=*/true)) {
    std::vector<float> buf(bytes / sizeof(float), 0.0f);
    const double seconds = time_all_reduce(staged, world, kernels::kCpu, buf.data(), buf.size(),
                                           bandwidth_iters(true, bytes));
    ASSERT_GT(seconds, 0.0);
    double lowest = seconds, highest = seconds;  // the slowest rank's, agreed
    world.all_reduce(&lowest, 1, parallel::ReduceOp::min);
    world.all_reduce(&highest, 1, parallel::ReduceOp::max);
    EXPECT_EQ(lowest, highest);
    for (float x : buf) ASSERT_EQ(x, 0.0f);
    const CheckRow row = bandwidth_row("dp × cp", bytes, seconds, n, "device memory");
    EXPECT_EQ(row.check, "bandwidth");
    EXPECT_EQ(row.group, "dp × cp");
    double ms = 0, algbw = 0, busbw = 0;
    ASSERT_EQ(std::sscanf(row.detail.c_str(), "all_reduce %lf ms algbw %lf GB/s busbw %lf GB/s",
                          &ms, &algbw, &busbw),
              3)
        << row.detail;
    EXPECT_GT(algbw, 0.0) << row.detail;
    EXPECT_NEAR(busbw, algbw * 2.0 * (n - 1) / n, 2e-3) << row.detail;
    EXPECT_NE(row.detail.find("device memory"), std::string::npos);
  }
}

// The rows of every tensor group on this rank's CPU device, over a mesh of dp = every rank.
std::vector<CheckRow> group_rows(DeviceComm key) {
  Job job;
  job.recipe.parallel.device_comm = key;
  const parallel::Comm world = parallel::Comm::world(60.0);
  job.mesh = std::make_unique<parallel::Mesh>(parallel::MeshShape(1, world.size(), 1, 1, 1),
                                              parallel::Comm::world(60.0));
  const auto device = kernels::Device::open(kernels::DeviceChoice::kCpu, 0);
  std::vector<CheckRow> rows;
  tensor_group_rows(job, *device, /*quick=*/true, rows);
  return rows;
}

// Each row as text, the same on every rank (rank 0's broadcast compared).
void expect_agreed(const std::vector<CheckRow>& rows) {
  const parallel::Comm world = parallel::Comm::world(60.0);
  std::string text;
  for (const auto& r : rows)
    text += r.check + "|" + r.group + "|" + r.scope + "|" + r.detail + "\n";
  size_t n = text.size();
  world.broadcast(reinterpret_cast<char*>(&n), sizeof(n), 0);
  std::string zeroth(n, '\0');
  if (world.rank() == 0) zeroth = text;
  world.broadcast(zeroth.data(), n, 0);
  EXPECT_EQ(text, zeroth);
}

TEST(SelfcheckDeviceComm, StagedGroupsAreNamedAndMeasured) {
  const std::vector<CheckRow> rows = group_rows(DeviceComm::kStaged);
  expect_agreed(rows);
  // tp, pp, cp, dp × cp, edp, ep in training's order; dp × cp and edp (every rank) measured.
  std::vector<std::string> named;
  int measured = 0;
  for (const auto& r : rows) {
    if (r.check == "device_comm") {
      named.push_back(r.group);
      EXPECT_EQ(r.status, CheckStatus::ok) << r.detail;
      EXPECT_EQ(r.scope, "staged");
      EXPECT_EQ(r.detail, "staged through host memory (parallel.device_comm = \"staged\")");
      continue;
    }
    ASSERT_EQ(r.check, "bandwidth");
    EXPECT_TRUE(r.group == "dp × cp" || r.group == "edp") << r.group;
    EXPECT_EQ(r.scope.rfind("staged ", 0), 0u) << r.scope;
    double ms = 0, algbw = 0, busbw = 0;
    ASSERT_EQ(std::sscanf(r.detail.c_str(), "all_reduce %lf ms algbw %lf GB/s busbw %lf GB/s", &ms,
                          &algbw, &busbw),
              3)
        << r.detail;
    EXPECT_GT(busbw, 0.0) << r.detail;
    ++measured;
  }
  EXPECT_EQ(named, (std::vector<std::string>{"tp", "pp", "cp", "dp × cp", "edp", "ep"}));
  EXPECT_EQ(measured, 2 * 3);  // two groups, --quick's three sizes
}

TEST(SelfcheckDeviceComm, AutoOnTheCpuIsStagedSayingWhy) {
  const std::vector<CheckRow> rows = group_rows(DeviceComm::kAuto);
  expect_agreed(rows);
  for (const auto& r : rows) {
    if (r.check != "device_comm") continue;
    EXPECT_EQ(r.status, CheckStatus::ok);
    EXPECT_EQ(r.scope, "staged");
    EXPECT_EQ(r.detail,
              "staged through host memory (rank 0 computes on the CPU (hardware.device))");
  }
}

TEST(SelfcheckDeviceComm, ARefusedNcclIsAFailedRowPerGroupNamingWhy) {
  const std::vector<CheckRow> rows = group_rows(DeviceComm::kNccl);
  expect_agreed(rows);
  const parallel::Comm world = parallel::Comm::world(60.0);
  ASSERT_EQ(rows.size(), 6u);  // no bandwidth row: nothing was opened
  for (const auto& r : rows) {
    EXPECT_EQ(r.check, "device_comm");
    EXPECT_EQ(r.status, CheckStatus::failed);
    EXPECT_EQ(r.scope, "refused");
    EXPECT_EQ(r.culprits.size(), static_cast<size_t>(world.size()));
    EXPECT_NE(r.detail.find("parallel.device_comm = \"nccl\", but the tensor collectives of " +
                            r.group + " cannot use NCCL: rank 0 computes on the CPU"),
              std::string::npos)
        << r.detail;
  }
}

}  // namespace
}  // namespace t3d::runtime::selfcheck
