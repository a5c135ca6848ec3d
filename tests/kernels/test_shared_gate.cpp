// The shared experts' sigmoid gate (kernels/ops_gate.h) against its double reference
// (moe_reference.h shared_gate_ref): the forward, the backward against central differences of the
// reference, the contract's corners (dz over dg, no dx, accumulation into dw), and bits that do not
// depend on the thread count.
#include <gtest/gtest.h>

#include <cstring>
#include <vector>

#include "kernels/ops_gate.h"
#include "kernels/row_math.h"
#include "tests/kernels/moe_reference.h"

namespace t3d::kernels {
namespace {

using ref::Vec;

struct GateCase {
  int N = 7, C = 37;  // C not a multiple of 16: every lane count of the row dot
  std::vector<float> x, w, shared, out0, dy;
  explicit GateCase(int n = 7, int c = 37) : N(n), C(c) {
    x = ref::random_floats(N * C, 11);
    w = ref::random_floats(C, 12, -0.5f, 0.5f);
    shared = ref::random_floats(N * C, 13);
    out0 = ref::random_floats(N * C, 14);
    dy = ref::random_floats(N * C, 15);
  }
};

// The op's whole backward as the model runs it: dy -> dg -> dz, dshared, dx (+= on dx0), dw (+=).
struct GateGrads {
  std::vector<float> dx, dw, dshared, dz;
};
GateGrads run_backward(const GateCase& k, const std::vector<float>& g,
                       const std::vector<float>& dx0, const std::vector<float>& dw0) {
  GateGrads r{dx0, dw0, std::vector<float>(k.N * k.C), std::vector<float>(k.N)};
  std::vector<float> dg(k.N);
  shared_gate_backward_dot(kCpu, dg.data(), k.dy.data(), k.shared.data(), k.N, k.C);
  shared_gate_backward(kCpu, r.dshared.data(), r.dz.data(), dg.data(), g.data(), k.dy.data(), k.N,
                       k.C);
  shared_gate_backward_input(kCpu, r.dx.data(), r.dz.data(), k.w.data(), k.N, k.C);
  shared_gate_backward_weight(kCpu, r.dw.data(), r.dz.data(), k.x.data(), k.N, k.C);
  return r;
}

// The row dot's order, which the CPU and the GPU share (row_math.h gate_row_dot): 16 lanes in
// double, lane j summing columns j, j + 16, ... in order, then halves folded onto the first
// (8, 4, 2, 1), bit for bit, for row lengths on both sides of a multiple of 16.
TEST(kernels_shared_gate, RowDotIsSixteenLanesFolded) {
  const auto a = ref::random_floats(2100, 16), b = ref::random_floats(2100, 17);
  for (int C : {0, 1, 15, 16, 17, 37, 100, 2048, 2100}) {
    double lane[16] = {};
    for (int c = 0; c < C; ++c) lane[c % 16] += static_cast<double>(a[c]) * b[c];
    for (int w = 8; w >= 1; w /= 2)
      for (int j = 0; j < w; ++j) lane[j] += lane[j + w];
    const double got = detail::gate_row_dot(a.data(), b.data(), C);
    EXPECT_EQ(std::memcmp(&got, &lane[0], sizeof got), 0) << C << " columns";
  }
}

TEST(kernels_shared_gate, ForwardMatchesReference) {
  const GateCase k;
  std::vector<float> out = k.out0, g(k.N, -1.0f);
  shared_gate_forward(kCpu, out.data(), g.data(), k.x.data(), k.w.data(), k.shared.data(), k.N,
                      k.C);
  Vec g_ref;
  const Vec want =
      moe_test::shared_gate_ref(ref::to_double(k.out0), ref::to_double(k.x), ref::to_double(k.w),
                                ref::to_double(k.shared), k.N, k.C, &g_ref);
  ref::expect_close(g, g_ref, 1e-6, 1e-7, "g");
  ref::expect_close(out, want, 1e-6, 1e-6, "out");
  // A zero gate weight is sigmoid(0) = 1/2 exactly: out0 + shared / 2 to the last bit.
  const std::vector<float> zero(k.C, 0.0f);
  std::vector<float> half = k.out0;
  shared_gate_forward(kCpu, half.data(), g.data(), k.x.data(), zero.data(), k.shared.data(), k.N,
                      k.C);
  for (int i = 0; i < k.N * k.C; ++i) ASSERT_EQ(half[i], k.out0[i] + 0.5f * k.shared[i]) << i;
}

TEST(kernels_shared_gate, BackwardMatchesFiniteDifferences) {
  const GateCase k;
  std::vector<float> out = k.out0, g(k.N);
  shared_gate_forward(kCpu, out.data(), g.data(), k.x.data(), k.w.data(), k.shared.data(), k.N,
                      k.C);
  const std::vector<float> dx0 = ref::random_floats(k.N * k.C, 16);
  const std::vector<float> dw0 = ref::random_floats(k.C, 17);
  const GateGrads got = run_backward(k, g, dx0, dw0);
  // L = Σ out ⊙ dy; the reference as a function of each input in turn.
  const Vec x = ref::to_double(k.x), w = ref::to_double(k.w), sh = ref::to_double(k.shared);
  const Vec o0 = ref::to_double(k.out0), r = ref::to_double(k.dy);
  const auto of_x = [&](const Vec& v) { return moe_test::shared_gate_ref(o0, v, w, sh, k.N, k.C); };
  const auto of_w = [&](const Vec& v) { return moe_test::shared_gate_ref(o0, x, v, sh, k.N, k.C); };
  const auto of_s = [&](const Vec& v) { return moe_test::shared_gate_ref(o0, x, w, v, k.N, k.C); };
  Vec dx_want = ref::numeric_grad(of_x, x, r), dw_want = ref::numeric_grad(of_w, w, r);
  for (size_t i = 0; i < dx_want.size(); ++i) dx_want[i] += dx0[i];  // dx accumulates
  for (size_t i = 0; i < dw_want.size(); ++i) dw_want[i] += dw0[i];  // so does dw
  ref::expect_close(got.dx, dx_want, 1e-5, 1e-6, "dx");
  ref::expect_close(got.dw, dw_want, 1e-5, 1e-6, "dw");
  ref::expect_close(got.dshared, ref::numeric_grad(of_s, sh, r), 1e-5, 1e-6, "dshared");
}

TEST(kernels_shared_gate, ContractCorners) {
  const GateCase k;
  std::vector<float> out = k.out0, g(k.N);
  shared_gate_forward(kCpu, out.data(), g.data(), k.x.data(), k.w.data(), k.shared.data(), k.N,
                      k.C);
  const std::vector<float> dx0(k.N * k.C, 0.0f), dw0(k.C, 0.0f);
  const GateGrads base = run_backward(k, g, dx0, dw0);
  // dz written over dg (the model's one buffer): the same dz and dshared bits.
  std::vector<float> dgz(k.N), dshared(k.N * k.C);
  shared_gate_backward_dot(kCpu, dgz.data(), k.dy.data(), k.shared.data(), k.N, k.C);
  shared_gate_backward(kCpu, dshared.data(), dgz.data(), dgz.data(), g.data(), k.dy.data(), k.N,
                       k.C);
  EXPECT_EQ(dgz, base.dz);
  EXPECT_EQ(dshared, base.dshared);
  // dw over two row ranges added in turn: within rounding of the whole (each range is rounded
  // once), the split sequence parallelism makes before its tp sum.
  std::vector<float> dw2(k.C, 0.0f);
  shared_gate_backward_weight(kCpu, dw2.data(), base.dz.data(), k.x.data(), 3, k.C);
  shared_gate_backward_weight(kCpu, dw2.data(), base.dz.data() + 3, k.x.data() + 3 * k.C, k.N - 3,
                              k.C);
  ref::expect_close(dw2, ref::to_double(base.dw), 1e-6, 1e-7, "dw by two row ranges");
}

// Rows and columns split over threads; a row's dot and a column's sum never are: the same bits on
// 1 and 4 threads, at a size past the threshold where the ops fork.
TEST(kernels_shared_gate, SameBitsOnAnyThreadCount) {
  const GateCase k(600, 200);
  std::vector<float> out1 = k.out0, g1(k.N), out4 = k.out0, g4(k.N);
  GateGrads b1, b4;
  const std::vector<float> dx0(k.N * k.C, 0.0f), dw0(k.C, 0.0f);
  ref::with_threads(1, [&] {
    shared_gate_forward(kCpu, out1.data(), g1.data(), k.x.data(), k.w.data(), k.shared.data(), k.N,
                        k.C);
    b1 = run_backward(k, g1, dx0, dw0);
  });
  ref::with_threads(4, [&] {
    shared_gate_forward(kCpu, out4.data(), g4.data(), k.x.data(), k.w.data(), k.shared.data(), k.N,
                        k.C);
    b4 = run_backward(k, g4, dx0, dw0);
  });
  EXPECT_EQ(out1, out4);
  EXPECT_EQ(g1, g4);
  EXPECT_EQ(b1.dx, b4.dx);
  EXPECT_EQ(b1.dw, b4.dw);
  EXPECT_EQ(b1.dshared, b4.dshared);
}

}  // namespace
}  // namespace t3d::kernels
