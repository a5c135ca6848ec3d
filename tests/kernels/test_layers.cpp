// Embedding, RMSNorm, RoPE, linear and SwiGLU: forward against the double reference, backward
// against central differences of that reference for L = sum(out * r).
#include <gtest/gtest.h>

#include <vector>

#include "kernels/check.h"
#include "kernels/ops.h"
#include "reference.h"

namespace t3d::kernels {
namespace {

using ref::Vec;

using ref::kFp32;

TEST(kernels_embedding, ForwardBackwardWithVocabSlice) {
  const int N = 6, C = 5, V = 8;
  const std::vector<std::int32_t> tokens = {0, 3, 7, 3, 5, 2};
  auto wte_full = ref::random_floats(V * C, 10);
  // A shard holding rows [3, 6): tokens 3, 3 and 5 are its own, the rest give zeros.
  const int start = 3, end = 6;
  std::vector<float> shard(wte_full.begin() + start * C, wte_full.begin() + end * C);
  std::vector<float> out(N * C, -1.0f);
  embedding_forward(kCpu, out.data(), tokens.data(), shard.data(), N, C, start, end);
  Vec expected(N * C, 0.0);
  for (int i = 0; i < N; ++i)
    if (tokens[i] >= start && tokens[i] < end)
      for (int c = 0; c < C; ++c) expected[i * C + c] = wte_full[tokens[i] * C + c];
  ref::expect_close(out, expected, 0, 0, "out");  // a copy: exact

  // Backward accumulates (+=) into the shard gradient; repeated token 3 gets two rows.
  auto dout = ref::random_floats(N * C, 11);
  std::vector<float> dwte(shard.size(), 1.0f);
  embedding_backward(kCpu, dwte.data(), dout.data(), tokens.data(), N, C, start, end);
  Vec dexp(shard.size(), 1.0);
  for (int i = 0; i < N; ++i)
    if (tokens[i] >= start && tokens[i] < end)
      for (int c = 0; c < C; ++c) dexp[(tokens[i] - start) * C + c] += dout[i * C + c];
  ref::expect_close(dwte, dexp, 1e-6, 1e-6, "dwte");
}

TEST(kernels_embedding, CheckTokenIdsNamesTheBadId) {
  const std::vector<std::int32_t> tokens = {1, 2, 50, 3};
  EXPECT_NO_THROW(check_token_ids(tokens.data(), 2, 10));
  try {
    check_token_ids(tokens.data(), 4, 10);
    FAIL();
  } catch (const UserError& e) {
    EXPECT_NE(std::string(e.what()).find("token id 50 at position 2"), std::string::npos);
  }
}

// Tolerance: fp32 forward of O(1) values, 1e-5 relative; backward 1e-4 (fp32 vs exact).
TEST(kernels_rmsnorm, ForwardAndGradients) {
  const int N = 4, C = 33;
  const float eps = 1e-5f;
  auto x = ref::random_floats(N * C, 20, -2, 2);
  auto w = ref::random_floats(C, 21, 0.5, 1.5);
  std::vector<float> out(N * C), rstd(N);
  rmsnorm_forward(kCpu, out.data(), rstd.data(), x.data(), w.data(), N, C, eps);
  ref::expect_close(out, ref::rmsnorm(ref::to_double(x), ref::to_double(w), N, C, eps), 1e-5, 1e-6,
                    "out");
  // The bf16 copy it writes when asked: out rounded (and out itself unchanged).
  std::vector<float> again(N * C), rstd_again(N);
  std::vector<bf16> out16(N * C);
  rmsnorm_forward(kCpu, again.data(), rstd_again.data(), x.data(), w.data(), N, C, eps,
                  out16.data());
  EXPECT_EQ(again, out);
  for (int i = 0; i < N * C; ++i) ASSERT_EQ(out16[i], float_to_bf16(out[i])) << i;

  const auto r = ref::to_double(ref::random_floats(N * C, 22));
  std::vector<float> dout(r.begin(), r.end()), dx(N * C, 99.0f), dw(C, 0.5f);
  rmsnorm_backward(kCpu, dx.data(), dw.data(), dout.data(), x.data(), w.data(), rstd.data(), N, C);
  const auto xd = ref::to_double(x), wd = ref::to_double(w);
  const Vec gx =
      ref::numeric_grad([&](const Vec& xx) { return ref::rmsnorm(xx, wd, N, C, eps); }, xd, r);
  Vec gw = ref::numeric_grad([&](const Vec& ww) { return ref::rmsnorm(xd, ww, N, C, eps); }, wd, r);
  for (auto& g : gw) g += 0.5;  // parameter gradient accumulates onto the old value
  ref::expect_close(dx, gx, 1e-4, 1e-5, "dinp");
  ref::expect_close(dw, gw, 1e-4, 1e-5, "dweight");
}

TEST(kernels_rope, ForwardMatchesHfFormulaWithOffsetAndBackwardIsInverse) {
  const int B = 2, T = 5, H = 3, D = 8, offset = 11;
  const double theta = 10000.0;
  std::vector<float> table((offset + T) * D);
  rope_table(table.data(), offset + T, D, theta);
  auto x = ref::random_floats(B * T * H * D, 30);
  std::vector<float> out(x.size());
  rope_forward(kCpu, out.data(), x.data(), table.data(), B, T, H, D, offset);
  const auto fwd = [&](const Vec& xx) { return ref::rope(xx, B, T, H, D, offset, theta); };
  ref::expect_close(out, fwd(ref::to_double(x)), 1e-5, 1e-6, "out");
  // Offset matters: position 0 would be the identity, position 11 is not.
  std::vector<float> no_offset(x.size());
  rope_forward(kCpu, no_offset.data(), x.data(), table.data(), B, T, H, D, 0);
  EXPECT_EQ(no_offset[3], x[3]);  // t = 0, angle 0
  EXPECT_NE(out[3], x[3]);

  // In place, as the model will call it.
  std::vector<float> inplace = x;
  rope_forward(kCpu, inplace.data(), inplace.data(), table.data(), B, T, H, D, offset);
  EXPECT_EQ(inplace, out);

  const auto r = ref::to_double(ref::random_floats(x.size(), 31));
  std::vector<float> dout(r.begin(), r.end()), dx(x.size());
  rope_backward(kCpu, dx.data(), dout.data(), table.data(), B, T, H, D, offset);
  ref::expect_close(dx, ref::numeric_grad(fwd, ref::to_double(x), r), 1e-4, 1e-6, "dinp");
}

// transformers' rope_scaling, written here as its _compute_llama3_parameters reads: every
// frequency against that, the three regimes each present, linear = f / factor, none = theta's.
TEST(kernels_rope, ScaledFrequenciesAreTransformersDefinitions) {
  const int D = 128;
  const double theta = 500000.0, pi = 3.14159265358979323846;
  RopeScaling llama3;
  llama3.kind = RopeScaling::Kind::kLlama3;
  llama3.factor = 8, llama3.low_freq_factor = 1, llama3.high_freq_factor = 4;
  llama3.original_context = 8192;
  std::vector<double> got(D / 2), none(D / 2), linear(D / 2);
  rope_frequencies(got.data(), D, theta, llama3);
  rope_frequencies(none.data(), D, theta, {});
  RopeScaling lin;
  lin.kind = RopeScaling::Kind::kLinear, lin.factor = 4;
  rope_frequencies(linear.data(), D, theta, lin);
  int slowed = 0, kept = 0, smoothed = 0;
  for (int i = 0; i < D / 2; ++i) {
    const double f = 1.0 / std::pow(theta, 2.0 * i / D);
    EXPECT_NEAR(none[i], f, 1e-15 * f);
    EXPECT_NEAR(linear[i], f / 4, 1e-15 * f);
    const double wavelen = 2 * pi / f, low_wl = 8192.0 / 1, high_wl = 8192.0 / 4;
    double want = wavelen > low_wl ? f / 8 : f;
    const double smooth = (8192.0 / wavelen - 1) / (4 - 1);
    if (!(wavelen < high_wl) && !(wavelen > low_wl)) want = (1 - smooth) * want / 8 + smooth * want;
    EXPECT_NEAR(got[i], want, 1e-14 * f) << i;
    slowed += wavelen > low_wl, kept += wavelen < high_wl;
    smoothed += !(wavelen < high_wl) && !(wavelen > low_wl);
  }
  EXPECT_GT(slowed, 0);
  EXPECT_GT(kept, 0);
  EXPECT_GT(smoothed, 0);
  // The table is cos/sin of position × frequency.
  std::vector<float> table(20 * D);
  rope_table(table.data(), 20, D, theta, llama3);
  EXPECT_EQ(table[19 * D + 40], static_cast<float>(std::cos(19 * got[40])));
  EXPECT_EQ(table[19 * D + D / 2 + 63], static_cast<float>(std::sin(19 * got[63])));
  RopeScaling bad = llama3;
  bad.high_freq_factor = 1;
  EXPECT_THROW(rope_frequencies(got.data(), D, theta, bad), UserError);
  bad = lin, bad.factor = 0;
  EXPECT_THROW(rope_frequencies(got.data(), D, theta, bad), UserError);
}

TEST(kernels_rope, RejectsOddHeadDim) {
  std::vector<float> table(10 * 3);
  EXPECT_THROW(rope_table(table.data(), 10, 3, 10000.0), UserError);
}

TEST(kernels_linear, ForwardAccumulateAndSplitBackward) {
  const int N = 7, in = 13, out = 5;
  auto x = ref::random_floats(N * in, 40);
  auto w = ref::random_floats(out * in, 41);  // [out, in] as Hugging Face stores it
  std::vector<float> y(N * out, 123.0f);      // overwritten in kWrite mode
  linear_forward(kFp32, y.data(), x.data(), w.data(), N, in, out);
  const auto xd = ref::to_double(x), wd = ref::to_double(w);
  const Vec yref = ref::linear(xd, wd, N, in, out);
  ref::expect_close(y, yref, 1e-5, 1e-5, "y");

  std::vector<float> resid(N * out, 1.0f);  // residual stream: +=
  linear_forward(kFp32, resid.data(), x.data(), w.data(), N, in, out, Out::kAccumulate);
  Vec rexp = yref;
  for (auto& v : rexp) v += 1.0;
  ref::expect_close(resid, rexp, 1e-5, 1e-5, "residual");

  const auto r = ref::to_double(ref::random_floats(N * out, 42));
  std::vector<float> dy(r.begin(), r.end()), dx(N * in, 99.0f), dw(out * in, 0.25f);
  linear_backward_input(kFp32, dx.data(), dy.data(), w.data(), N, in, out);
  linear_backward_weight(kFp32, dw.data(), dy.data(), x.data(), N, in, out);
  Vec gw = ref::numeric_grad([&](const Vec& ww) { return ref::linear(xd, ww, N, in, out); }, wd, r);
  for (auto& g : gw) g += 0.25;
  ref::expect_close(
      dx, ref::numeric_grad([&](const Vec& xx) { return ref::linear(xx, wd, N, in, out); }, xd, r),
      1e-4, 1e-5, "dx");
  ref::expect_close(dw, gw, 1e-4, 1e-5, "dw");
}

// A bf16 linear op whose Exec carries a current WeightCopy reads the weight's copy instead of
// rounding the weight: the same bits. A copy that is not current, a weight outside its range and
// fp32 GEMMs never read it (a copy of zeros shows which ran).
TEST(kernels_linear, AWeightCopyIsReadInPlaceOfRoundingTheWeight) {
  try {
    verify_gemm_kind(GemmKind::kOneDnnBf16);
  } catch (const UserError& e) {
    GTEST_SKIP() << e.what();
  }
  const int N = 7, in = 24, out = 16;
  const auto x = ref::random_floats(N * in, 43);
  const auto region = ref::random_floats(2 * out * in, 44);  // two weights [out, in]
  const float* w = region.data() + out * in;                 // the second
  // The second's copy after a gap: the copy's offsets are its own.
  const std::int64_t gap = 32, at = out * in + gap;
  std::vector<bf16> rounded(static_cast<std::size_t>(at + out * in)), zeros(rounded.size());
  float_to_bf16_threads(rounded.data(), region.data(), out * in);
  float_to_bf16_threads(rounded.data() + at, w, out * in);
  const Exec plain(GemmKind::kOneDnnBf16);
  WeightCopy copy{
      region.data(), {{0, out * in, 0}, {out * in, 2 * out * in, at}}, rounded.data(), true};
  Exec with = plain;
  with.weight_copy = &copy;
  const auto dy = ref::random_floats(N * out, 45);
  // y = x w^T, dx = dy w, by the raw ops and through LinearInput.
  const auto run = [&](const Exec& e, const float* weight) {
    std::vector<float> y(N * out), dx(N * in), y2(N * out), dx2(N * in);
    linear_forward(e, y.data(), x.data(), weight, N, in, out);
    linear_backward_input(e, dx.data(), dy.data(), weight, N, in, out);
    linear_forward(y2.data(), LinearInput(e, x.data(), N, in), weight, out);
    linear_backward_input(dx2.data(), LinearInput(e, dy.data(), N, out), weight, in);
    return std::vector<std::vector<float>>{y, dx, y2, dx2};
  };
  const auto reference = run(plain, w);
  EXPECT_EQ(run(with, w), reference) << "the copy's bits differ from rounding the weight";
  const int out1 = out - 1;  // a weight starting inside a tensor: its rows 1..
  std::vector<float> y_plain(N * out1), y_with(N * out1);
  linear_forward(plain, y_plain.data(), x.data(), w + in, N, in, out1);
  linear_forward(with, y_with.data(), x.data(), w + in, N, in, out1);
  EXPECT_EQ(y_with, y_plain) << "inside a tensor";
  copy.rounded = zeros.data();
  for (const auto& out_of_copy : run(with, w))
    EXPECT_EQ(out_of_copy, std::vector<float>(out_of_copy.size(), 0.0f)) << "the copy not read";
  copy.current = false;
  EXPECT_EQ(run(with, w), reference) << "a copy not current was read";
  copy.current = true;
  const std::vector<float> outside(region.begin() + out * in, region.end());
  EXPECT_EQ(run(with, outside.data()), reference) << "a weight outside the copy's range";
  Exec fp32 = with;
  fp32.gemm = GemmKind::kOneDnnF32;
  EXPECT_EQ(run(fp32, w), run(Exec(GemmKind::kOneDnnF32), w)) << "fp32 GEMMs read the copy";
}

// y = residual + x wᵀ in one op: the bits of the GEMM into scratch and then the add, every kind.
TEST(kernels_linear, TheResidualInTheGemmIsTheGemmThenTheAdd) {
  const int N = 6, in = 40, out = 24;
  const auto x = ref::random_floats(N * in, 46);
  const auto w = ref::random_floats(out * in, 47);
  const auto residual = ref::random_floats(N * out, 48, -3, 3);
  for (const GemmKind kind :
       {GemmKind::kOpenBlasF32, GemmKind::kOneDnnF32, GemmKind::kOneDnnBf16}) {
    try {
      verify_gemm_kind(kind);
    } catch (const UserError&) {
      continue;  // not on this CPU (the GEMM tests say so)
    }
    std::vector<float> product(N * out), apart(N * out), fused(N * out, 7.0f);
    linear_forward(kind, product.data(), x.data(), w.data(), N, in, out);
    add(kind, apart.data(), residual.data(), product.data(), N * out);
    linear_forward_residual(fused.data(), residual.data(), LinearInput(kind, x.data(), N, in),
                            w.data(), out);
    EXPECT_EQ(fused, apart) << gemm_kind_name(kind);
  }
}

TEST(kernels_swiglu, ForwardAndGradients) {
  const int n = 97;
  auto gate = ref::random_floats(n, 50, -6, 6), up = ref::random_floats(n, 51, -2, 2);
  std::vector<float> h(n);
  swiglu_forward(kCpu, h.data(), gate.data(), up.data(), n);
  const auto gd = ref::to_double(gate), ud = ref::to_double(up);
  ref::expect_close(h, ref::swiglu(gd, ud), 1e-5, 1e-6, "h");

  const auto r = ref::to_double(ref::random_floats(n, 52));
  std::vector<float> dh(r.begin(), r.end()), dgate(n), dup(n);
  swiglu_backward(kCpu, dgate.data(), dup.data(), dh.data(), gate.data(), up.data(), n);
  ref::expect_close(dgate,
                    ref::numeric_grad([&](const Vec& g) { return ref::swiglu(g, ud); }, gd, r),
                    1e-4, 1e-5, "dgate");
  ref::expect_close(dup, ref::numeric_grad([&](const Vec& u) { return ref::swiglu(gd, u); }, ud, r),
                    1e-4, 1e-5, "dup");
}

// The fused bf16 SwiGLU is the plain one with its inputs and outputs rounded, bit for bit: the
// forward on the floats (h, gate and up rounded), the backward on the rounded gate and up.
TEST(kernels_swiglu, Bf16CopiesAreThePlainResultsRounded) {
  const int n = 1037;  // not a multiple of any vector width
  auto gate = ref::random_floats(n, 53, -8, 8), up = ref::random_floats(n, 54, -3, 3);
  const auto dh = ref::random_floats(n, 55, -1, 1);
  gate[0] = 0.0f, gate[1] = -0.0f, up[2] = 1e-39f;  // zeros and a denormal
  using ref::rounded, ref::widened;
  std::vector<float> h(n);
  swiglu_forward(kCpu, h.data(), gate.data(), up.data(), n);
  std::vector<bf16> h16(n), gate16(n), up16(n);
  swiglu_forward_bf16(kCpu, h16.data(), gate16.data(), up16.data(), gate.data(), up.data(), n);
  EXPECT_EQ(h16, rounded(h));
  EXPECT_EQ(gate16, rounded(gate));
  EXPECT_EQ(up16, rounded(up));

  std::vector<float> dgate(n), dup(n);
  const auto gate_r = widened(gate16), up_r = widened(up16);
  swiglu_backward(kCpu, dgate.data(), dup.data(), dh.data(), gate_r.data(), up_r.data(), n);
  std::vector<bf16> dgate16(n), dup16(n);
  swiglu_backward_bf16(kCpu, dgate16.data(), dup16.data(), dh.data(), gate16.data(), up16.data(),
                       n);
  EXPECT_EQ(dgate16, rounded(dgate));
  EXPECT_EQ(dup16, rounded(dup));
}

TEST(kernels_elementwise, AddAndZero) {
  std::vector<float> x = {1, 2, 3}, y = {10, 20, 30};
  add_inplace(kCpu, x.data(), y.data(), 3);
  EXPECT_EQ(x, (std::vector<float>{11, 22, 33}));
  zero(kCpu, x.data(), 2);
  EXPECT_EQ(x, (std::vector<float>{0, 0, 33}));
}

}  // namespace
}  // namespace t3d::kernels
