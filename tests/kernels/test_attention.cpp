// Tiled causal GQA attention against the full T x T double-precision softmax, and its backward
// against central differences of that reference.
#include <gtest/gtest.h>

#include <vector>

#include "kernels/check.h"
#include "kernels/ops.h"
#include "reference.h"

namespace t3d::kernels {
namespace {

using ref::Vec;

using ref::kFp32;

struct Case {
  int B, T, H, Hkv, D, tile;
  float q_scale;  // large values make the softmax peaked and exercise the running-max rescale
};

void PrintTo(const Case& c, std::ostream* os) {
  *os << "B" << c.B << "_T" << c.T << "_H" << c.H << "_Hkv" << c.Hkv << "_D" << c.D << "_tile"
      << c.tile << "_qs" << c.q_scale;
}

class kernels_attention : public ::testing::TestWithParam<Case> {};

struct Inputs {
  std::vector<float> q, k, v;
  AttentionShape shape;
};

Inputs make_inputs(const Case& c) {
  Inputs in;
  in.shape = {c.B, c.T, c.H, c.Hkv, c.D, c.tile};
  in.q = ref::random_floats((std::size_t)c.B * c.T * c.H * c.D, 60);
  for (auto& x : in.q) x *= c.q_scale;
  in.k = ref::random_floats((std::size_t)c.B * c.T * c.Hkv * c.D, 61);
  in.v = ref::random_floats((std::size_t)c.B * c.T * c.Hkv * c.D, 62);
  return in;
}

// Tolerance: fp32 tiles with a polynomial exp (rel. error ~2e-7); 2e-5 relative + 2e-6 absolute.
TEST_P(kernels_attention, ForwardMatchesFullSoftmax) {
  const Case c = GetParam();
  Inputs in = make_inputs(c);
  std::vector<float> out(in.q.size(), 123.0f), lse((std::size_t)c.B * c.H * c.T);
  std::vector<float> scratch(attention_scratch_floats(in.shape));
  attention_forward(kFp32, out.data(), lse.data(), in.q.data(), in.k.data(), in.v.data(),
                    scratch.data(), in.shape);
  Vec out_ref, lse_ref;
  ref::attention(ref::to_double(in.q), ref::to_double(in.k), ref::to_double(in.v), c.B, c.T, c.H,
                 c.Hkv, c.D, &out_ref, &lse_ref);
  ref::expect_close(out, out_ref, 2e-5, 2e-6, "out");
  ref::expect_close(lse, lse_ref, 2e-5, 2e-6, "lse");
}

// Tolerance: backward in fp32 vs exact derivative, 1e-4 relative + 2e-5 absolute.
TEST_P(kernels_attention, BackwardMatchesFiniteDifferences) {
  const Case c = GetParam();
  Inputs in = make_inputs(c);
  std::vector<float> out(in.q.size()), lse((std::size_t)c.B * c.H * c.T);
  std::vector<float> scratch(attention_scratch_floats(in.shape));
  attention_forward(kFp32, out.data(), lse.data(), in.q.data(), in.k.data(), in.v.data(),
                    scratch.data(), in.shape);
  const Vec r = ref::to_double(ref::random_floats(out.size(), 63));
  std::vector<float> dout(r.begin(), r.end());
  // Stale values in the outputs must not leak in (activation gradients are written).
  std::vector<float> dq(in.q.size(), 7.0f), dk(in.k.size(), 7.0f), dv(in.v.size(), 7.0f);
  attention_backward(kFp32, dq.data(), dk.data(), dv.data(), dout.data(), in.q.data(), in.k.data(),
                     in.v.data(), out.data(), lse.data(), scratch.data(), in.shape);

  const Vec qd = ref::to_double(in.q), kd = ref::to_double(in.k), vd = ref::to_double(in.v);
  auto f = [&](const Vec& qq, const Vec& kk, const Vec& vv) {
    Vec o;
    ref::attention(qq, kk, vv, c.B, c.T, c.H, c.Hkv, c.D, &o, nullptr);
    return o;
  };
  ref::expect_close(dq, ref::numeric_grad([&](const Vec& x) { return f(x, kd, vd); }, qd, r), 1e-4,
                    2e-5, "dq");
  ref::expect_close(dk, ref::numeric_grad([&](const Vec& x) { return f(qd, x, vd); }, kd, r), 1e-4,
                    2e-5, "dk");
  ref::expect_close(dv, ref::numeric_grad([&](const Vec& x) { return f(qd, kd, x); }, vd, r), 1e-4,
                    2e-5, "dv");
}

INSTANTIATE_TEST_SUITE_P(
    Shapes, kernels_attention,
    ::testing::Values(Case{2, 37, 4, 2, 8, 8, 1.0f},    // GQA, T not a multiple of the tile
                      Case{1, 23, 3, 1, 6, 5, 1.0f},    // multi-query, odd tile
                      Case{1, 16, 2, 2, 8, 16, 1.0f},   // plain MHA, exactly one tile
                      Case{1, 9, 2, 2, 4, 64, 1.0f},    // tile larger than T
                      Case{1, 29, 4, 2, 8, 4, 12.0f}),  // peaked softmax, many small tiles
    [](const auto& info) { return ref::param_name(info); });

// Context parallelism: a block of query rows at positions [q_pos, q_pos + Tq) against all the
// keys gives those rows of the full attention, and (with the output gradient zero elsewhere) the
// same dq rows and the same dk, dv. The full-sequence kernel is checked against the reference
// above; the blocks start mid-tile and end past a tile to exercise the absolute-position mask.
TEST(kernels_attention_blocks, QueryBlockEqualsRowsOfFullAttention) {
  const int B = 2, T = 37, H = 4, Hkv = 2, D = 8, tile = 8;
  const Inputs in = make_inputs({B, T, H, Hkv, D, tile, 3.0f});
  std::vector<float> scratch(attention_scratch_floats(in.shape));
  std::vector<float> out(in.q.size()), lse((std::size_t)B * H * T);
  attention_forward(kFp32, out.data(), lse.data(), in.q.data(), in.k.data(), in.v.data(),
                    scratch.data(), in.shape);
  const std::vector<float> g = ref::random_floats(out.size(), 64);
  for (const auto& [q_pos, Tq] : {std::pair{0, 5}, std::pair{5, 11}, std::pair{19, 18}}) {
    SCOPED_TRACE("block at " + std::to_string(q_pos) + ", " + std::to_string(Tq) + " rows");
    const auto rows = [&](const std::vector<float>& x,
                          int width) {  // (B, Tq, width) of (B, T, width)
      std::vector<float> y;
      for (int b = 0; b < B; ++b)
        y.insert(y.end(), x.begin() + ((std::size_t)b * T + q_pos) * width,
                 x.begin() + ((std::size_t)b * T + q_pos + Tq) * width);
      return y;
    };
    AttentionShape blk = in.shape;
    blk.T = Tq, blk.q_pos = q_pos, blk.kv_len = T;
    const std::vector<float> q = rows(in.q, H * D);
    std::vector<float> o(q.size()), l((std::size_t)B * H * Tq);
    attention_forward(kFp32, o.data(), l.data(), q.data(), in.k.data(), in.v.data(), scratch.data(),
                      blk);
    const std::vector<float> o_full = rows(out, H * D);
    ref::expect_close(o, ref::to_double(o_full), 1e-5, 1e-6, "out");

    // Backward of sum(g * out) over the block's rows only.
    std::vector<float> dout_full(out.size(), 0.0f);
    for (int b = 0; b < B; ++b)
      for (std::size_t i = ((std::size_t)b * T + q_pos) * H * D;
           i < ((std::size_t)b * T + q_pos + Tq) * H * D; ++i)
        dout_full[i] = g[i];
    std::vector<float> dq(in.q.size()), dk(in.k.size()), dv(in.v.size());
    attention_backward(kFp32, dq.data(), dk.data(), dv.data(), dout_full.data(), in.q.data(),
                       in.k.data(), in.v.data(), out.data(), lse.data(), scratch.data(), in.shape);
    const std::vector<float> dout = rows(dout_full, H * D);
    std::vector<float> bq(q.size()), bk(in.k.size(), 7.0f), bv(in.v.size(), 7.0f);
    attention_backward(kFp32, bq.data(), bk.data(), bv.data(), dout.data(), q.data(), in.k.data(),
                       in.v.data(), o.data(), l.data(), scratch.data(), blk);
    ref::expect_close(bq, ref::to_double(rows(dq, H * D)), 1e-4, 1e-6, "dq");
    ref::expect_close(bk, ref::to_double(dk), 1e-4, 1e-6, "dk");
    ref::expect_close(bv, ref::to_double(dv), 1e-4, 1e-6, "dv");
  }
}

TEST(kernels_attention_blocks, QueriesPastTheKeysAreRefused) {
  AttentionShape s{1, 8, 2, 2, 4, 4};
  s.q_pos = 4, s.kv_len = 10;  // positions 4..11 but only 10 keys
  std::vector<float> buf(1024), scratch(attention_scratch_floats(s));
  EXPECT_THROW(attention_forward(kFp32, buf.data(), buf.data(), buf.data(), buf.data(), buf.data(),
                                 scratch.data(), s),
               std::exception);
}

TEST(kernels_attention_shape, ScratchDoesNotGrowWithSequence) {
  AttentionShape a{1, 128, 8, 2, 64, 64}, b{1, 32768, 8, 2, 64, 64};
  EXPECT_EQ(attention_scratch_floats(a), attention_scratch_floats(b));
}

TEST(kernels_attention_shape, HeadsMustGroupEvenly) {
  AttentionShape s{1, 4, 6, 4, 8, 4};
  std::vector<float> buf(1024), scratch(attention_scratch_floats(s));
  EXPECT_THROW(attention_forward(kFp32, buf.data(), buf.data(), buf.data(), buf.data(), buf.data(),
                                 scratch.data(), s),
               UserError);
}

}  // namespace
}  // namespace t3d::kernels
