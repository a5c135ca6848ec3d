// The bf16 attention tiles (kernels/attention_bf16.h), taken when the linear layers run bf16
// GEMMs on a CPU with AVX512-BF16, against the double-precision full-softmax reference evaluated
// on the same bf16-rounded q, k, v (and dout): what is left is the kernel's own rounding of P and
// dS to bf16 and its fp32 sums. Tolerances, derived from that:
//   - lse: scores are fp32 sums of exact products of bf16 values (two 8-bit significands fit in
//     fp32), so the fp32 tolerance of test_attention.cpp holds: 2e-5 relative + 2e-6 absolute.
//   - out = sum_j p_j v_j with every p_j rounded to 8 significant bits (relative error <= 2^-9):
//     |error| <= 2^-9 sum_j p_j |v_j| <= 2^-9 max|v| (the p_j sum to 1). Asserted: 2^-8 max|v|.
//   - gradients: each is a sum of products with one factor rounded (P or dS: 2^-9 relative)
//     plus dS's fp32 inputs; the error is bounded by 2^-9 times the sum of |terms|, which at these
//     sizes stays within 1e-2 of the largest |gradient| (verify_gemm_kind's bf16 bound in
//     kernels/gemm.h, for the same reason). A wrong index, mask or packing gives errors of the
//     order of the gradients themselves.
// A control asserts that the outputs do differ from the unrounded reference by more than fp32
// error: the bf16 path is really taken.
#include <gtest/gtest.h>

#include <algorithm>
#include <cmath>
#include <vector>

#include "kernels/attention_bf16.h"
#include "kernels/blas.h"
#include "kernels/gemm.h"
#include "kernels/ops.h"
#include "kernels/precision.h"
#include "reference.h"

namespace t3d::kernels {
namespace {

using ref::Vec;

// The linear layers' kind that takes attention's bf16 tiles (where the CPU has AVX512-BF16).
constexpr GemmKind kBf16 = GemmKind::kOneDnnBf16;

#define SKIP_WITHOUT_BF16_TILES()          \
  if (!detail::bf16_attention_supported()) \
  GTEST_SKIP() << "this CPU has no AVX512-BF16: attention stays fp32 here"

std::vector<float> rounded(std::vector<float> x) {
  for (auto& v : x) v = bf16_to_float(float_to_bf16(v));
  return x;
}

struct Bf16Case {
  int B, T, H, Hkv, D, tile;
  float q_scale;
};

void PrintTo(const Bf16Case& c, std::ostream* os) {
  *os << "B" << c.B << "_T" << c.T << "_H" << c.H << "_Hkv" << c.Hkv << "_D" << c.D << "_tile"
      << c.tile << "_qs" << c.q_scale;
}

struct Bf16Inputs {
  std::vector<float> q, k, v;  // bf16-exact values: the reference sees what the kernel sees
  AttentionShape shape;
};

Bf16Inputs make_bf16_inputs(const Bf16Case& c) {
  Bf16Inputs in;
  in.shape = {c.B, c.T, c.H, c.Hkv, c.D, c.tile};
  in.q = ref::random_floats((std::size_t)c.B * c.T * c.H * c.D, 70);
  for (auto& x : in.q) x *= c.q_scale;
  in.q = rounded(in.q);
  in.k = rounded(ref::random_floats((std::size_t)c.B * c.T * c.Hkv * c.D, 71));
  in.v = rounded(ref::random_floats((std::size_t)c.B * c.T * c.Hkv * c.D, 72));
  return in;
}

class kernels_attention_bf16 : public ::testing::TestWithParam<Bf16Case> {};

TEST_P(kernels_attention_bf16, ForwardMatchesFullSoftmaxOfRoundedInputs) {
  SKIP_WITHOUT_BF16_TILES();
  const Bf16Case c = GetParam();
  const Bf16Inputs in = make_bf16_inputs(c);
  std::vector<float> out(in.q.size(), 123.0f), lse((std::size_t)c.B * c.H * c.T);
  std::vector<float> scratch(attention_scratch_floats(in.shape));
  attention_forward(kBf16, out.data(), lse.data(), in.q.data(), in.k.data(), in.v.data(),
                    scratch.data(), in.shape);
  Vec out_ref, lse_ref;
  ref::attention(ref::to_double(in.q), ref::to_double(in.k), ref::to_double(in.v), c.B, c.T, c.H,
                 c.Hkv, c.D, &out_ref, &lse_ref);
  ref::expect_close(out, out_ref, 0.0, std::ldexp(1.0, -8), "out");  // max|v| <= 1
  ref::expect_close(lse, lse_ref, 2e-5, 2e-6, "lse");
  EXPECT_GT(ref::max_abs_diff(out, out_ref), 1e-5) << "as exact as fp32: P not rounded to bf16";
}

TEST_P(kernels_attention_bf16, BackwardMatchesFiniteDifferencesOfRoundedInputs) {
  SKIP_WITHOUT_BF16_TILES();
  const Bf16Case c = GetParam();
  const Bf16Inputs in = make_bf16_inputs(c);
  std::vector<float> out(in.q.size()), lse((std::size_t)c.B * c.H * c.T);
  std::vector<float> scratch(attention_scratch_floats(in.shape));
  attention_forward(kBf16, out.data(), lse.data(), in.q.data(), in.k.data(), in.v.data(),
                    scratch.data(), in.shape);
  const std::vector<float> dout = rounded(ref::random_floats(out.size(), 73));
  std::vector<float> dq(in.q.size(), 7.0f), dk(in.k.size(), 7.0f), dv(in.v.size(), 7.0f);
  attention_backward(kBf16, dq.data(), dk.data(), dv.data(), dout.data(), in.q.data(), in.k.data(),
                     in.v.data(), out.data(), lse.data(), scratch.data(), in.shape);

  const Vec qd = ref::to_double(in.q), kd = ref::to_double(in.k), vd = ref::to_double(in.v);
  const Vec r = ref::to_double(dout);
  auto f = [&](const Vec& qq, const Vec& kk, const Vec& vv) {
    Vec o;
    ref::attention(qq, kk, vv, c.B, c.T, c.H, c.Hkv, c.D, &o, nullptr);
    return o;
  };
  const Vec gq = ref::numeric_grad([&](const Vec& x) { return f(x, kd, vd); }, qd, r);
  const Vec gk = ref::numeric_grad([&](const Vec& x) { return f(qd, x, vd); }, kd, r);
  const Vec gv = ref::numeric_grad([&](const Vec& x) { return f(qd, kd, x); }, vd, r);
  ref::expect_close_to_max(dq, gq, 1e-2, "dq");
  ref::expect_close_to_max(dk, gk, 1e-2, "dk");
  ref::expect_close_to_max(dv, gv, 1e-2, "dv");
  EXPECT_GT(ref::max_abs_diff(dv, gv), 1e-5) << "as exact as fp32: P not rounded to bf16";
}

INSTANTIATE_TEST_SUITE_P(
    Shapes, kernels_attention_bf16,
    ::testing::Values(Bf16Case{2, 37, 4, 2, 8, 8, 1.0f},   // GQA, T not a multiple of the tile
                      Bf16Case{1, 23, 3, 1, 6, 5, 1.0f},   // multi-query, odd tile (key tile 6)
                      Bf16Case{1, 16, 2, 2, 8, 16, 1.0f},  // plain MHA, exactly one tile
                      Bf16Case{1, 9, 2, 2, 5, 64, 1.0f},   // tile larger than T, odd head dim
                      Bf16Case{1, 29, 4, 2, 8, 4, 12.0f},  // peaked softmax, many small tiles
                      Bf16Case{1, 40, 2, 1, 36, 13,
                               1.0f}),  // 18 pairs of D: two column-pair blocks
    [](const auto& info) { return ref::param_name(info); });

// Larger shapes, too large for finite differences: the bf16 tiles against the fp32 tiles (checked
// against finite differences in test_attention.cpp, and for context parallelism against full
// attention) on the same rounded inputs, within the bf16 bounds above.
struct BigCase {
  int B, T, H, Hkv, D, tile;
  float q_scale;
  int q_pos, kv_len;  // context parallelism: queries at [q_pos, q_pos + T) of kv_len keys
};

void PrintTo(const BigCase& c, std::ostream* os) {
  *os << "B" << c.B << "_T" << c.T << "_H" << c.H << "_Hkv" << c.Hkv << "_D" << c.D << "_tile"
      << c.tile << "_qs" << c.q_scale << "_at" << c.q_pos << "_of" << c.kv_len;
}

class kernels_attention_bf16_large : public ::testing::TestWithParam<BigCase> {};

TEST_P(kernels_attention_bf16_large, MatchesFp32TilesOnRoundedInputs) {
  SKIP_WITHOUT_BF16_TILES();
  const BigCase c = GetParam();
  AttentionShape shape{c.B, c.T, c.H, c.Hkv, c.D, c.tile};
  shape.q_pos = c.q_pos, shape.kv_len = c.kv_len;
  const std::size_t nq = (std::size_t)c.B * c.T * c.H * c.D;
  const std::size_t nkv = (std::size_t)c.B * shape.keys() * c.Hkv * c.D;
  std::vector<float> q = ref::random_floats(nq, 70);
  for (auto& x : q) x *= c.q_scale;
  q = rounded(q);
  const std::vector<float> k = rounded(ref::random_floats(nkv, 71));
  const std::vector<float> v = rounded(ref::random_floats(nkv, 72));
  const std::vector<float> dout = rounded(ref::random_floats(nq, 74));
  struct Result {
    std::vector<float> out, lse, dq, dk, dv;
  };
  const auto run = [&](GemmKind kind) {
    // Outputs start as garbage: every element must be written.
    Result r{std::vector<float>(nq, 5.0f), std::vector<float>((std::size_t)c.B * c.H * c.T, 5.0f),
             std::vector<float>(nq, 5.0f), std::vector<float>(nkv, 5.0f),
             std::vector<float>(nkv, 5.0f)};
    std::vector<float> scratch(attention_scratch_floats(shape));
    attention_forward(kind, r.out.data(), r.lse.data(), q.data(), k.data(), v.data(),
                      scratch.data(), shape);
    attention_backward(kind, r.dq.data(), r.dk.data(), r.dv.data(), dout.data(), q.data(), k.data(),
                       v.data(), r.out.data(), r.lse.data(), scratch.data(), shape);
    return r;
  };
  const Result fp32 = run(GemmKind::kOpenBlasF32);
  const Result b = run(kBf16);
  ref::expect_close(b.out, ref::to_double(fp32.out), 0.0, std::ldexp(1.0, -8), "out");
  ref::expect_close(b.lse, ref::to_double(fp32.lse), 2e-5, 2e-6, "lse");
  ref::expect_close_to_max(b.dq, ref::to_double(fp32.dq), 1e-2, "dq");
  ref::expect_close_to_max(b.dk, ref::to_double(fp32.dk), 1e-2, "dk");
  ref::expect_close_to_max(b.dv, ref::to_double(fp32.dv), 1e-2, "dv");
  EXPECT_NE(b.out, fp32.out) << "bf16 tiles not taken";
}

INSTANTIATE_TEST_SUITE_P(
    Shapes, kernels_attention_bf16_large,
    ::testing::Values(
        // the model's shape class: head dim 64, 64-row tiles, a ragged one; keys in one key tile
        BigCase{2, 150, 4, 2, 64, 64, 2.0f, 0, 0},
        // more keys than one key tile (256): online softmax across key tiles, peaked and flat
        BigCase{1, 300, 2, 1, 64, 64, 8.0f, 0, 0}, BigCase{1, 531, 2, 2, 48, 96, 1.0f, 0, 0},
        // odd head dim and tile, T not a multiple of 16
        BigCase{1, 277, 2, 1, 33, 37, 2.0f, 0, 0},
        // context parallelism: a block of queries; keys past the last query get zero gradients
        BigCase{2, 100, 4, 2, 64, 64, 2.0f, 150, 400},
        BigCase{1, 120, 2, 2, 64, 64, 2.0f, 200, 400},
        BigCase{1, 57, 2, 1, 40, 16, 2.0f, 301, 358}),
    [](const auto& info) { return ref::param_name(info); });

// Ranks with several threads split attention over (batch, head) items; each item is computed by
// one thread in a fixed order, so the bf16 results are the same bits with 1 and 2 threads and
// from run to run.
TEST(kernels_attention_bf16_threads, TwoThreadsEqualOneAndRepeat) {
  SKIP_WITHOUT_BF16_TILES();
  // Large enough for the threaded path; the second has several key tiles per query tile.
  for (const Bf16Case c :
       {Bf16Case{2, 200, 4, 2, 48, 64, 2.0f}, Bf16Case{2, 300, 4, 2, 64, 64, 2.0f}}) {
    SCOPED_TRACE("T=" + std::to_string(c.T));
    const Bf16Inputs in = make_bf16_inputs(c);
    const AttentionShape& s = in.shape;
    const std::vector<float> dout = ref::random_floats(in.q.size(), 75);
    const auto run = [&](int threads) {
      const int saved = blas_threads();
      set_blas_threads(threads);
      std::vector<std::vector<float>> r{
          std::vector<float>(in.q.size()), std::vector<float>((std::size_t)s.B * s.n_heads * s.T),
          std::vector<float>(in.q.size()), std::vector<float>(in.k.size()),
          std::vector<float>(in.v.size())};
      std::vector<float> scratch(attention_scratch_floats(s));
      attention_forward(kBf16, r[0].data(), r[1].data(), in.q.data(), in.k.data(), in.v.data(),
                        scratch.data(), s);
      attention_backward(kBf16, r[2].data(), r[3].data(), r[4].data(), dout.data(), in.q.data(),
                         in.k.data(), in.v.data(), r[0].data(), r[1].data(), scratch.data(), s);
      set_blas_threads(saved);
      return r;
    };
    const auto one = run(1), two = run(2), again = run(2);
    for (int i = 0; i < 5; ++i) {
      EXPECT_EQ(one[i], two[i]) << "output " << i;
      EXPECT_EQ(two[i], again[i]) << "output " << i;
    }
  }
}

}  // namespace
}  // namespace t3d::kernels
