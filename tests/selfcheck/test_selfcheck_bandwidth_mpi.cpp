// The bandwidth measurement selfcheck runs on a device communicator (time_all_reduce and its row,
// runtime/selfcheck/selfcheck_internal.h), here on the staged one over host memory (a CPU Exec:
// its copies are plain copies; on a GPU the same code copies device memory): it runs, every rank
// gets the same positive time, and the row's bus bandwidth is 2(n-1)/n of its algorithm
// bandwidth. Run under mpirun -np 2 and 3.
#include <gtest/gtest.h>

#include <cstdio>
#include <string>
#include <vector>

#include "kernels/exec.h"
#include "parallel/comm.h"
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

}  // namespace
}  // namespace t3d::runtime::selfcheck
