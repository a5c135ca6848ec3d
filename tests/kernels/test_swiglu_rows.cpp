// The SwiGLU MLP path (kernels/ops_swiglu.h) against a double reference and against the linear
// ops it is made of, and the MoE ops that move per-slot values between slot order and row order
// (kernels/ops_moe.h moe_gather_slots / moe_scatter_slots) against a plain loop.
#include <gtest/gtest.h>

#include <cstdint>
#include <vector>

#include "kernels/ops.h"
#include "kernels/ops_moe.h"
#include "kernels/ops_swiglu.h"
#include "reference.h"

namespace t3d::kernels {
namespace {

using ref::kFp32;
using ref::Vec;

// Forward against the double reference; B and W against the same linear ops called one by one
// (bit for bit), with dx written and accumulated.
TEST(kernels_swiglu_mlp, ForwardBackwardMatchTheLinearOps) {
  const int N = 5, C = 6, F = 7;
  const auto x = ref::random_floats(N * C, 300), dy = ref::random_floats(N * C, 301);
  const auto wg = ref::random_floats(F * C, 302), wu = ref::random_floats(F * C, 303),
             wd = ref::random_floats(C * F, 304);
  const SwigluWeights w{wg.data(), wu.data(), wd.data()};
  std::vector<float> gate(N * F), up(N * F), h(N * F), y(N * C, 0.5f);
  const SwigluActs a{gate.data(), up.data(), h.data()};
  swiglu_mlp_forward(kFp32, y.data(), Out::kAccumulate, LinearInput(kFp32, x.data(), N, C), w, a,
                     {}, F);
  const Vec hr = ref::swiglu(ref::linear(ref::to_double(x), ref::to_double(wg), N, C, F),
                             ref::linear(ref::to_double(x), ref::to_double(wu), N, C, F));
  Vec yr = ref::linear(hr, ref::to_double(wd), N, F, C);
  for (auto& v : yr) v += 0.5;
  ref::expect_close(y, yr, 1e-5, 1e-6, "y");

  std::vector<float> dgate(N * F), dup(N * F), dh(N * F), dx(N * C), tmp(N * C);
  std::vector<float> dwg(F * C, 0.25f), dwu(F * C, 0.25f), dwd(C * F, 0.25f);
  const LinearInput dy_in(kFp32, dy.data(), N, C), x_in(kFp32, x.data(), N, C);
  swiglu_mlp_backward_hidden(kFp32, dgate.data(), dup.data(), dh.data(), dy_in, w, a, {}, F);
  swiglu_mlp_backward_input(kFp32, dx.data(), Out::kWrite, tmp.data(), dgate.data(), dup.data(), w,
                            {}, N, C, F);
  swiglu_mlp_backward_weight(kFp32, {dwg.data(), dwu.data(), dwd.data()}, dy_in, x_in, dgate.data(),
                             dup.data(), a, {}, F);

  std::vector<float> want_dh(N * F), want_dg(N * F), want_du(N * F), want_dx(N * C), t(N * C);
  std::vector<float> want_dwg(F * C, 0.25f), want_dwu(F * C, 0.25f), want_dwd(C * F, 0.25f);
  linear_backward_input(kFp32, want_dh.data(), dy.data(), wd.data(), N, F, C);
  swiglu_backward(kFp32, want_dg.data(), want_du.data(), want_dh.data(), gate.data(), up.data(),
                  N * F);
  linear_backward_input(kFp32, want_dx.data(), want_dg.data(), wg.data(), N, C, F);
  linear_backward_input(kFp32, t.data(), want_du.data(), wu.data(), N, C, F);
  add_inplace(kFp32, want_dx.data(), t.data(), N * C);
  linear_backward_weight(kFp32, want_dwd.data(), dy.data(), h.data(), N, F, C);
  linear_backward_weight(kFp32, want_dwg.data(), want_dg.data(), x.data(), N, C, F);
  linear_backward_weight(kFp32, want_dwu.data(), want_du.data(), x.data(), N, C, F);
  EXPECT_EQ(dh, want_dh);
  EXPECT_EQ(dgate, want_dg);
  EXPECT_EQ(dup, want_du);
  EXPECT_EQ(dx, want_dx);
  EXPECT_EQ(dwg, want_dwg);
  EXPECT_EQ(dwu, want_dwu);
  EXPECT_EQ(dwd, want_dwd);

  // Accumulated: dx += dgate wg (through tmp), then += dup wu.
  std::vector<float> acc(N * C, 1.0f), want_acc(N * C, 1.0f);
  swiglu_mlp_backward_input(kFp32, acc.data(), Out::kAccumulate, tmp.data(), dgate.data(),
                            dup.data(), w, {}, N, C, F);
  linear_backward_input(kFp32, t.data(), want_dg.data(), wg.data(), N, C, F);
  add_inplace(kFp32, want_acc.data(), t.data(), N * C);
  linear_backward_input(kFp32, t.data(), want_du.data(), wu.data(), N, C, F);
  add_inplace(kFp32, want_acc.data(), t.data(), N * C);
  EXPECT_EQ(acc, want_acc);
}

// A permutation's rows and their slots (some slots without a row: dropped).
TEST(kernels_moe_slots, GatherAndScatterFollowTheSlots) {
  const std::vector<std::int32_t> slot_of_row = {3, 0, 5, 1};  // 4 rows of 6 slots
  const std::vector<float> by_slot = {10, 11, 12, 13, 14, 15};
  std::vector<float> by_row(4, -1.0f);
  moe_gather_slots(kCpu, by_row.data(), by_slot.data(), slot_of_row.data(), 4);
  EXPECT_EQ(by_row, (std::vector<float>{13, 10, 15, 11}));
  std::vector<float> back(6, 7.0f);
  moe_scatter_slots(kCpu, back.data(), by_row.data(), slot_of_row.data(), 4);
  EXPECT_EQ(back, (std::vector<float>{10, 11, 7, 13, 7, 15}));  // slots 2 and 4 left alone
}

}  // namespace
}  // namespace t3d::kernels
