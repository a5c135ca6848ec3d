// The GPU step-time breakdown's arithmetic (runtime/train/gpu_op_times.h): host code, runs
// everywhere; the times themselves come from a GPU (kernels/cuda/op_timer.h).
#include <gtest/gtest.h>

#include <map>
#include <string>

#include "runtime/train/gpu_op_times.h"

namespace t3d::runtime {
namespace {

TEST(GpuOpTimes, OpsFallIntoTheirKinds) {
  EXPECT_EQ(gpu_op_kind("linear_forward"), "GEMM");
  EXPECT_EQ(gpu_op_kind("linear_backward_weight"), "GEMM");
  EXPECT_EQ(gpu_op_kind("moe_experts_forward"), "GEMM");
  EXPECT_EQ(gpu_op_kind("attention_backward"), "attention");
  EXPECT_EQ(gpu_op_kind("cross_entropy_fused"), "loss");
  EXPECT_EQ(gpu_op_kind("adamw_step"), "optimizer");
  EXPECT_EQ(gpu_op_kind("sum_of_squares"), "optimizer");
  EXPECT_EQ(gpu_op_kind("sum_of_squares_each"), "optimizer");  // the step's gradient norm
  EXPECT_EQ(gpu_op_kind("moe_route_forward"), "MoE routing");
  EXPECT_EQ(gpu_op_kind("copy_to_host_started"), "host crossings");
  EXPECT_EQ(gpu_op_kind("rmsnorm_forward"), "element-wise");
  EXPECT_EQ(gpu_op_kind("float_to_bf16"), "element-wise");
}

TEST(GpuOpTimes, TheBreakdownIsPerStepWithSharesAndTheUncoveredRest) {
  // Two steps of 10 ms: 12 ms of GEMMs, 4 of attention, 2 of RMSNorm in all.
  const std::map<std::string, double> ops = {{"linear_forward", 0.008},
                                             {"linear_backward_input", 0.004},
                                             {"attention_forward", 0.004},
                                             {"rmsnorm_forward", 0.002}};
  const std::string line = gpu_op_breakdown(ops, 2, 0.020, 2);
  EXPECT_NE(line.find("over 2 steps of 10.00 ms"), std::string::npos) << line;
  EXPECT_NE(line.find("GEMM 6.00 ms (60.0%), attention 2.00 ms (20.0%), element-wise 1.00 ms "
                      "(10.0%)"),
            std::string::npos)
      << line;
  EXPECT_NE(line.find("in no GPU op (communication, host, idle) 1.00 ms (10.0%)"),
            std::string::npos)
      << line;
  // The two largest ops only.
  EXPECT_NE(line.find("largest ops: linear_forward 4.00 ms attention_forward 2.00 ms"),
            std::string::npos)
      << line;
  EXPECT_EQ(line.find("rmsnorm_forward"), std::string::npos) << line;
  EXPECT_EQ(gpu_op_breakdown(ops, 0, 0.0), "");
}

}  // namespace
}  // namespace t3d::runtime
