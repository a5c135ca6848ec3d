// Naive double-precision twins of the kernels, plus the helpers every kernel test uses:
// random inputs, closeness checks and a central-difference gradient of L(x) = sum(f(x) * r).
// Written for clarity, not speed: loops over the math as it is written on paper.
#pragma once

#include <gtest/gtest.h>

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <functional>
#include <random>
#include <sstream>
#include <string>
#include <vector>

#include "kernels/blas.h"
#include "kernels/gemm.h"
#include "kernels/precision.h"

namespace t3d::kernels::ref {

// Runs fn with `threads` BLAS threads (the kernels' thread count), restoring the old count.
template <class Fn>
void with_threads(int threads, Fn&& fn) {
  const int saved = blas_threads();
  set_blas_threads(threads);
  fn();
  set_blas_threads(saved);
}

using Vec = std::vector<double>;

// The fp32 GEMM the exact-layer and attention tests pin (its tiles are what they compare).
inline constexpr GemmKind kFp32 = GemmKind::kOpenBlasF32;

inline std::vector<float> random_floats(std::size_t n, std::uint32_t seed, float lo = -1.0f,
                                        float hi = 1.0f) {
  std::mt19937 rng(seed);
  std::uniform_real_distribution<float> dist(lo, hi);
  std::vector<float> v(n);
  for (auto& x : v) x = dist(rng);
  return v;
}

inline Vec to_double(const std::vector<float>& v) { return Vec(v.begin(), v.end()); }

// x rounded to bf16 (nearest even, the kernels' float_to_bf16), and bf16 values widened back.
inline std::vector<bf16> rounded(const std::vector<float>& x) {
  std::vector<bf16> r(x.size());
  float_to_bf16(r.data(), x.data(), static_cast<std::int64_t>(x.size()));
  return r;
}
inline std::vector<float> widened(const std::vector<bf16>& x) {
  std::vector<float> f(x.size());
  bf16_to_float(f.data(), x.data(), static_cast<std::int64_t>(x.size()));
  return f;
}

// Every element within atol + rtol * |expected|; reports the first few offenders.
// max |actual - expected| <= tol * max |expected|.
inline void expect_close_to_max(const std::vector<float>& actual, const Vec& expected, double tol,
                                const char* what) {
  ASSERT_EQ(actual.size(), expected.size()) << what;
  double err = 0, big = 0;
  for (std::size_t i = 0; i < actual.size(); ++i) {
    err = std::max(err, std::abs(actual[i] - expected[i]));
    big = std::max(big, std::abs(expected[i]));
  }
  EXPECT_LE(err, tol * big) << what << ": max error " << err << ", max |expected| " << big;
}

inline double max_abs_diff(const std::vector<float>& a, const Vec& b) {
  double e = 0;
  for (std::size_t i = 0; i < a.size(); ++i) e = std::max(e, std::abs(a[i] - b[i]));
  return e;
}

inline void expect_close(const std::vector<float>& actual, const Vec& expected, double rtol,
                         double atol, const char* what) {
  ASSERT_EQ(actual.size(), expected.size()) << what;
  int bad = 0;
  for (std::size_t i = 0; i < actual.size(); ++i) {
    const double err = std::abs(actual[i] - expected[i]);
    if (!(err <= atol + rtol * std::abs(expected[i]))) {
      ADD_FAILURE() << what << "[" << i << "]: got " << actual[i] << ", expected " << expected[i]
                    << " (err " << err << ")";
      if (++bad == 5) return;
    }
  }
}

// d/dx of L(x) = sum_i f(x)_i r_i by central differences, in double: truncation error is
// O(h^2 * f''') and rounding O(eps_double / h), both ~1e-10 at h = 1e-5.
inline Vec numeric_grad(const std::function<Vec(const Vec&)>& f, Vec x, const Vec& r,
                        double h = 1e-5) {
  Vec g(x.size());
  for (std::size_t i = 0; i < x.size(); ++i) {
    const double x0 = x[i];
    x[i] = x0 + h;
    const Vec up = f(x);
    x[i] = x0 - h;
    const Vec down = f(x);
    x[i] = x0;
    double s = 0.0;
    for (std::size_t j = 0; j < r.size(); ++j) s += (up[j] - down[j]) * r[j];
    g[i] = s / (2 * h);
  }
  return g;
}

// ---- references ---------------------------------------------------------------------------

// out (N, C) = x / sqrt(mean(x^2) + eps) * w
inline Vec rmsnorm(const Vec& x, const Vec& w, int N, int C, double eps) {
  Vec out(x.size());
  for (int i = 0; i < N; ++i) {
    double ss = 0;
    for (int c = 0; c < C; ++c) ss += x[i * C + c] * x[i * C + c];
    const double r = 1.0 / std::sqrt(ss / C + eps);
    for (int c = 0; c < C; ++c) out[i * C + c] = x[i * C + c] * r * w[c];
  }
  return out;
}

// Rotate-half RoPE straight from the HF formula, angles computed here (not from a table).
inline Vec rope(const Vec& x, int B, int T, int H, int D, int pos_offset, double theta) {
  Vec out(x.size());
  const int half = D / 2;
  for (int b = 0; b < B; ++b)
    for (int t = 0; t < T; ++t)
      for (int h = 0; h < H; ++h) {
        const std::size_t base = ((std::size_t)(b * T + t) * H + h) * D;
        for (int i = 0; i < half; ++i) {
          const double a = (pos_offset + t) / std::pow(theta, 2.0 * i / D);
          const double x1 = x[base + i], x2 = x[base + i + half];
          // x * cos + rotate_half(x) * sin, rotate_half(x) = (-x2, x1)
          out[base + i] = x1 * std::cos(a) - x2 * std::sin(a);
          out[base + i + half] = x2 * std::cos(a) + x1 * std::sin(a);
        }
      }
  return out;
}

// Full T x T causal softmax attention in double. q (B,T,H*D), k/v (B,T,Hkv*D) -> out, lse.
inline void attention(const Vec& q, const Vec& k, const Vec& v, int B, int T, int H, int Hkv, int D,
                      Vec* out, Vec* lse) {
  out->assign((std::size_t)B * T * H * D, 0.0);
  if (lse) lse->assign((std::size_t)B * H * T, 0.0);
  const int group = H / Hkv;
  const double scale = 1.0 / std::sqrt((double)D);
  Vec p(T);
  for (int b = 0; b < B; ++b)
    for (int h = 0; h < H; ++h) {
      const int kvh = h / group;
      for (int i = 0; i < T; ++i) {
        const double* qi = &q[((std::size_t)(b * T + i) * H + h) * D];
        double mx = -INFINITY;
        for (int j = 0; j <= i; ++j) {
          const double* kj = &k[((std::size_t)(b * T + j) * Hkv + kvh) * D];
          double s = 0;
          for (int d = 0; d < D; ++d) s += qi[d] * kj[d];
          p[j] = s * scale;
          mx = std::max(mx, p[j]);
        }
        double sum = 0;
        for (int j = 0; j <= i; ++j) sum += std::exp(p[j] - mx);
        double* o = &(*out)[((std::size_t)(b * T + i) * H + h) * D];
        for (int j = 0; j <= i; ++j) {
          const double w = std::exp(p[j] - mx) / sum;
          const double* vj = &v[((std::size_t)(b * T + j) * Hkv + kvh) * D];
          for (int d = 0; d < D; ++d) o[d] += w * vj[d];
        }
        if (lse) (*lse)[((std::size_t)b * H + h) * T + i] = mx + std::log(sum);
      }
    }
}

// y (N, out) = x (N, in) w^T, w (out, in)
inline Vec linear(const Vec& x, const Vec& w, int N, int in, int out) {
  Vec y((std::size_t)N * out, 0.0);
  for (int i = 0; i < N; ++i)
    for (int o = 0; o < out; ++o) {
      double s = 0;
      for (int c = 0; c < in; ++c) s += x[(std::size_t)i * in + c] * w[(std::size_t)o * in + c];
      y[(std::size_t)i * out + o] = s;
    }
  return y;
}

inline Vec swiglu(const Vec& gate, const Vec& up) {
  Vec h(gate.size());
  for (std::size_t i = 0; i < h.size(); ++i) h[i] = gate[i] / (1 + std::exp(-gate[i])) * up[i];
  return h;
}

// losses (N) = logsumexp(row) - row[target]; ignored targets (-100) give 0.
inline Vec cross_entropy(const Vec& logits, const std::vector<std::int32_t>& targets, int N,
                         int V) {
  Vec loss(N, 0.0);
  for (int i = 0; i < N; ++i) {
    if (targets[i] == -100) continue;
    const double* x = &logits[(std::size_t)i * V];
    const double mx = *std::max_element(x, x + V);
    double s = 0;
    for (int j = 0; j < V; ++j) s += std::exp(x[j] - mx);
    loss[i] = std::log(s) + mx - x[targets[i]];
  }
  return loss;
}

// A gtest parameter's name for INSTANTIATE_TEST_SUITE_P: its PrintTo text, '.' spelled 'p'.
template <typename Info>
std::string param_name(const Info& info) {
  std::ostringstream os;
  PrintTo(info.param, &os);
  std::string s = os.str();
  for (auto& ch : s)
    if (ch == '.') ch = 'p';
  return s;
}

}  // namespace t3d::kernels::ref
