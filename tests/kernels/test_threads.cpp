// The threaded paths of the non-GEMM kernels (ranks with several threads) give exactly the
// one-thread results, and the AVX2 / AVX-512 row loops match the SSE2 ones.
#include <gtest/gtest.h>

#include <cmath>
#include <random>
#include <vector>

#include "kernels/blas.h"
#include "kernels/ops.h"
#include "kernels/simd_rows.h"
#include "reference.h"

namespace t3d::kernels {
namespace {

using ref::with_threads;

using ref::kFp32;

std::vector<float> random_vec(std::size_t n, unsigned seed, float scale = 1.0f) {
  std::mt19937 rng(seed);
  std::uniform_real_distribution<float> d(-scale, scale);
  std::vector<float> v(n);
  for (auto& x : v) x = d(rng);
  return v;
}

struct AttnOut {
  std::vector<float> out, lse, dq, dk, dv;
};

AttnOut run_attention(const AttentionShape& s, int threads) {
  const std::size_t nq = s.B * s.T * s.n_heads * s.head_dim;
  const std::size_t nkv = s.B * s.T * s.n_kv_heads * s.head_dim;
  const auto q = random_vec(nq, 1, 2.0f), k = random_vec(nkv, 2, 2.0f), v = random_vec(nkv, 3);
  const auto dout = random_vec(nq, 4);
  AttnOut r{std::vector<float>(nq), std::vector<float>(s.B * s.n_heads * s.T),
            std::vector<float>(nq), std::vector<float>(nkv), std::vector<float>(nkv)};
  std::vector<float> scratch(attention_scratch_floats(s));
  with_threads(threads, [&] {
    attention_forward(kFp32, r.out.data(), r.lse.data(), q.data(), k.data(), v.data(),
                      scratch.data(), s);
    attention_backward(kFp32, r.dq.data(), r.dk.data(), r.dv.data(), dout.data(), q.data(),
                       k.data(), v.data(), r.out.data(), r.lse.data(), scratch.data(), s);
  });
  return r;
}

TEST(kernels_threads, AttentionTwoThreadsEqualsOne) {
  // Large enough to take the threaded path (B H T D >= 64k); GQA groups of 2, a ragged last tile.
  const AttentionShape s{2, 200, 4, 2, 48, 64};
  const AttnOut one = run_attention(s, 1), two = run_attention(s, 2);
  EXPECT_EQ(one.out, two.out);
  EXPECT_EQ(one.lse, two.lse);
  EXPECT_EQ(one.dq, two.dq);
  EXPECT_EQ(one.dk, two.dk);
  EXPECT_EQ(one.dv, two.dv);
}

TEST(kernels_threads, ElementwiseTwoThreadsEqualsOne) {
  const std::int64_t N = 300, C = 520, n = N * C;  // C not a multiple of the 64-column blocks
  const auto x = random_vec(n, 5), y = random_vec(n, 6), w = random_vec(C, 7),
             dy = random_vec(n, 8);
  auto run = [&](int threads) {
    std::vector<float> out(n), rstd(N), dx(n), dw(C, 0.5f), h(n), dg(n), du(n), r(x);
    std::vector<float> p(x), m(y), v(n, 0.25f), zeroed(y), logits(x), losses(N);
    std::vector<float> row_max(N), sum_exp(N), target_logit(N), piece_logits(x), piece_losses(N);
    std::vector<std::int32_t> targets(N);
    for (std::int64_t i = 0; i < N; ++i)
      targets[i] = i % 7 == 3 ? kIgnoreIndex : static_cast<std::int32_t>((i * 37) % C);
    with_threads(threads, [&] {
      cross_entropy_fused(kCpu, logits.data(), losses.data(), targets.data(), N, C, 0.01f);
      ce_local_max(kCpu, row_max.data(), piece_logits.data(), N, C);
      ce_local_sum_exp(kCpu, sum_exp.data(), piece_logits.data(), row_max.data(), N, C);
      ce_local_target_logit(kCpu, target_logit.data(), piece_logits.data(), targets.data(), N, C,
                            0);
      ce_loss_and_grad(kCpu, piece_logits.data(), piece_losses.data(), targets.data(),
                       row_max.data(), sum_exp.data(), target_logit.data(), N, C, 0, 0.01f);
      zero(kCpu, zeroed.data(), n);
      adamw_step(kCpu, p.data(), dy.data(), m.data(), v.data(), n,
                 {1e-2f, 0.9f, 0.95f, 1e-8f, 0.1f, 0.37f}, 3);
      rmsnorm_forward(kCpu, out.data(), rstd.data(), x.data(), w.data(), N, C, 1e-5f);
      rmsnorm_backward(kCpu, dx.data(), dw.data(), dy.data(), x.data(), w.data(), rstd.data(), N,
                       C);
      swiglu_forward(kCpu, h.data(), x.data(), y.data(), n);
      swiglu_backward(kCpu, dg.data(), du.data(), dy.data(), x.data(), y.data(), n);
      add_inplace(kCpu, r.data(), y.data(), n);
    });
    EXPECT_EQ(zeroed, std::vector<float>(n, 0.0f));
    EXPECT_EQ(piece_logits, logits);  // one vocab slice: the pieces are the fused kernel
    EXPECT_EQ(piece_losses, losses);
    return std::vector<std::vector<float>>{out, rstd, dx, dw, h,      dg,    du,
                                           r,   p,    m,  v,  logits, losses};
  };
  const auto one = run(1), two = run(2);
  for (std::size_t i = 0; i < one.size(); ++i) EXPECT_EQ(one[i], two[i]) << "output " << i;
}

void expect_near_rel(const std::vector<float>& a, const std::vector<float>& b, const char* what) {
  ASSERT_EQ(a.size(), b.size());
  for (std::size_t i = 0; i < a.size(); ++i) {
    ASSERT_NEAR(a[i], b[i], 1e-6 * (1.0 + std::abs(b[i]))) << what << " at " << i;
  }
}

TEST(kernels_threads, WideRowLoopsMatchSse2) {
  const CpuFeatures f = detect_cpu_features();
  std::vector<const detail::SimdRows*> wide;
  if (f.avx2 && f.fma) wide.push_back(&detail::kSimdRowsAvx2);
  if (f.avx512f && f.avx512dq && f.avx512bw && f.avx512vl) wide.push_back(&detail::kSimdRowsAvx512);
  if (wide.empty()) GTEST_SKIP() << "no AVX2 on this CPU";
  const std::int64_t nq = 37, nk = 45, D = 24, n = 1003;
  const auto S0 = random_vec(nq * nk, 9, 6.0f), o0 = random_vec(nq * D, 10),
             g = random_vec(n, 11, 8.0f);
  const auto u = random_vec(n, 12), dh = random_vec(n, 13), dvec = random_vec(nq, 14);
  auto run = [&](const detail::SimdRows& r) {
    std::vector<float> S(S0), m(nq, -INFINITY), l(nq, 0.0f), o(o0), P(S0), dP(S0), dots(nq);
    std::vector<float> lse(nq, 3.0f), h(n), dg(n), du(n);
    r.softmax_tile_fwd(S.data(), nq, nk, 30, 0, m.data(), l.data(), o.data(), D, D);
    r.softmax_tile_fwd(S.data(), nq, nk, 30, 10, m.data(), l.data(), o.data(), D, D);  // rescale
    r.exp_tile_bwd(P.data(), nq, nk, 30, 10, lse.data());
    r.softmax_grad_tile(dP.data(), P.data(), nq, nk, dvec.data());
    r.row_dots(dots.data(), o.data(), o0.data(), nq, D, D);
    r.swiglu_fwd(h.data(), g.data(), u.data(), n);
    r.swiglu_bwd(dg.data(), du.data(), dh.data(), g.data(), u.data(), n);
    return std::vector<std::vector<float>>{S, m, l, o, P, dP, dots, h, dg, du};
  };
  const auto base = run(detail::kSimdRowsSse2);
  for (const auto* w : wide) {
    const auto got = run(*w);
    for (std::size_t i = 0; i < base.size(); ++i) {
      SCOPED_TRACE(w->isa);
      expect_near_rel(got[i], base[i], "output");
    }
  }
}

// RMSNorm and AdamW promise the same bits on every ISA (simd_rows.h): against the contract
// written out as plain scalar code here (this file is built for baseline x86-64: no FMA), each
// ISA's version must agree exactly, not just closely.
TEST(kernels_threads, RmsNormAndAdamWAreTheSameBitsOnEveryIsa) {
  const CpuFeatures f = detect_cpu_features();
  std::vector<const detail::SimdRows*> isas{&detail::kSimdRowsSse2};
  if (f.avx2 && f.fma) isas.push_back(&detail::kSimdRowsAvx2);
  if (f.avx512f && f.avx512dq && f.avx512bw && f.avx512vl) isas.push_back(&detail::kSimdRowsAvx512);
  const std::int64_t N = 7, C = 147, n = 1003;  // C: 9 lanes of 16 and a tail of 3, 2 blocks + 19
  const float eps = 1e-5f;
  const auto x = random_vec(N * C, 21, 3.0f), w = random_vec(C, 22), dy = random_vec(N * C, 23);
  const auto g = random_vec(n, 24), p0 = random_vec(n, 25), m0 = random_vec(n, 26, 0.1f);
  std::vector<float> v0 = random_vec(n, 27, 0.01f);
  for (auto& e : v0) e = e * e;

  // The contract: lane j of 16 sums the terms of c ≡ j (mod 16) in order, lanes joined pairwise.
  const auto sum16 = [&](auto term) {
    double lane[16] = {};
    for (std::int64_t c = 0; c < C; ++c) lane[c % 16] += term(c);
    for (int width = 8; width >= 1; width /= 2)
      for (int j = 0; j < width; ++j) lane[j] += lane[j + width];
    return lane[0];
  };
  std::vector<float> out(N * C), rstd(N), dx(N * C), dw(C, 0.5f);
  for (std::int64_t i = 0; i < N; ++i) {
    const float* xr = x.data() + i * C;
    const float* dr = dy.data() + i * C;
    const double ss = sum16([&](std::int64_t c) { return static_cast<double>(xr[c]) * xr[c]; });
    const float r = static_cast<float>(1.0 / std::sqrt(ss / static_cast<double>(C) + eps));
    rstd[i] = r;
    for (std::int64_t c = 0; c < C; ++c) out[i * C + c] = xr[c] * r * w[c];
    const double dot =
        sum16([&](std::int64_t c) { return static_cast<double>(dr[c]) * w[c] * xr[c]; });
    const float k = static_cast<float>(dot * r * r * r / static_cast<double>(C));
    for (std::int64_t c = 0; c < C; ++c) dx[i * C + c] = r * w[c] * dr[c] - k * xr[c];
  }
  for (std::int64_t c = 0; c < C; ++c)
    for (std::int64_t i = 0; i < N; ++i) dw[c] += dy[i * C + c] * x[i * C + c] * rstd[i];
  const detail::AdamWScalars s{0.9f, 0.95f, 1e-8f, 0.999f, 0.0125f, 1.3f, 0.37f};
  std::vector<float> p(p0), m(m0), v(v0);
  for (std::int64_t i = 0; i < n; ++i) {
    const float gi = g[i] * s.grad_scale;
    m[i] = s.beta1 * m[i] + (1.0f - s.beta1) * gi;
    v[i] = s.beta2 * v[i] + (1.0f - s.beta2) * gi * gi;
    p[i] = p[i] * s.decay - s.step_size * m[i] / (std::sqrt(v[i]) * s.inv_sqrt_bc2 + s.eps);
  }

  for (const auto* isa : isas) {
    SCOPED_TRACE(isa->isa);
    std::vector<float> got_out(N * C), got_rstd(N), got_dx(N * C), got_dw(C, 0.5f);
    isa->rmsnorm_fwd(got_out.data(), got_rstd.data(), x.data(), w.data(), N, C, eps);
    isa->rmsnorm_bwd(got_dx.data(), dy.data(), x.data(), w.data(), got_rstd.data(), N, C, false);
    std::vector<float> got_acc(x);  // accumulate: x + the written dinp, each rounded as written
    isa->rmsnorm_bwd(got_acc.data(), dy.data(), x.data(), w.data(), got_rstd.data(), N, C, true);
    for (std::int64_t i = 0; i < N * C; ++i) EXPECT_EQ(got_acc[i], x[i] + dx[i]) << i;
    for (std::int64_t c0 = 0; c0 < C; c0 += 64)
      isa->rmsnorm_dweight(got_dw.data(), dy.data(), x.data(), got_rstd.data(), N, C, c0);
    EXPECT_EQ(got_out, out);
    EXPECT_EQ(got_rstd, rstd);
    EXPECT_EQ(got_dx, dx);
    EXPECT_EQ(got_dw, dw);
    std::vector<float> got_p(p0), got_m(m0), got_v(v0);
    isa->adamw(got_p.data(), g.data(), got_m.data(), got_v.data(), n, s);
    EXPECT_EQ(got_p, p);
    EXPECT_EQ(got_m, m);
    EXPECT_EQ(got_v, v);
  }
}

}  // namespace
}  // namespace t3d::kernels
