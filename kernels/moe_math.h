// The mixture-of-experts ops' row arithmetic (kernels/ops_moe.h), written once for both backends:
// the CPU's ops_moe.cpp runs these over its rows (split over the threads), the CUDA twins
// (kernels/cuda/ops_moe.cu) run each row in one thread. Internal to kernels/.
//
// Bits: IEEE single and double arithmetic in the written order (kernels/row_math.h's contract;
// the CUDA file compiles with -fmad=false). The one function a backend brings is the softmax's and
// the sigmoid's exp (std::exp: libm's expf on the CPU, CUDA's expf on a GPU, within 2 ulp of each
// other), so the router's scores agree within fp32 rounding, and everything after them (the
// selection, the gates, the backward, the auxiliary loss) is the same arithmetic on the same
// inputs.
#pragma once

#include <cmath>
#include <cstdint>

#include "kernels/row_math.h"

namespace t3d::kernels::detail {
namespace {

// +infinity, from its bits (numeric_limits is not callable in device code).
T3D_HD inline float moe_infinity() { return float_of_bits(0x7F800000u); }

// The selection's key of a score: NaN ranks below every number (it is never preferred, and the
// order stays total, so each of the K passes finds an expert).
T3D_HD inline float moe_select_key(float v) { return v != v ? -moe_infinity() : v; }

// Whether (key a, index ia) comes before (key b, index ib): larger key first, ties to the lower
// index. A strict total order over the E experts of a row.
T3D_HD inline bool moe_ranks_before(float a, std::int64_t ia, float b, std::int64_t ib) {
  return a > b || (a == b && ia < ib);
}

// One row's top-k of s + bias (bias may be null): pass j picks the best expert among those
// ranked after pass j - 1's pick, so no marks are needed and the K picks are distinct and in
// rank order.
T3D_HD inline void moe_select_row(std::int32_t* chosen, const float* s, const float* bias,
                                  std::int64_t E, std::int64_t K) {
  float prev_key = moe_infinity();
  std::int64_t prev = -1;  // (+inf, -1) ranks before everything
  for (std::int64_t j = 0; j < K; ++j) {
    float best_key = 0.0f;
    std::int64_t best = -1;
    for (std::int64_t e = 0; e < E; ++e) {
      const float key = moe_select_key(bias ? s[e] + bias[e] : s[e]);
      if (!moe_ranks_before(prev_key, prev, key, e)) continue;  // taken by an earlier pass
      if (best < 0 || moe_ranks_before(key, e, best_key, best)) best_key = key, best = e;
    }
    chosen[j] = static_cast<std::int32_t>(best);
    prev_key = best_key, prev = best;
  }
}

// One token of moe_route_forward: its scores s (E) from its logits x (E) (s may be x: each
// element is read before it is written), its K choices c and gates g.
T3D_HD inline void moe_route_row(float* s, std::int32_t* c, float* g, const float* x,
                                 const float* bias, std::int64_t E, std::int64_t K, bool softmax,
                                 bool normalize, float scale) {
  if (softmax) {
    float mx = -moe_infinity();
    for (std::int64_t e = 0; e < E; ++e) mx = x[e] > mx ? x[e] : mx;
    double sum = 0.0;
    for (std::int64_t e = 0; e < E; ++e) {
      s[e] = std::exp(x[e] - mx);
      sum += s[e];
    }
    const double inv = 1.0 / sum;
    for (std::int64_t e = 0; e < E; ++e) s[e] = static_cast<float>(s[e] * inv);
  } else {
    for (std::int64_t e = 0; e < E; ++e) s[e] = 1.0f / (1.0f + std::exp(-x[e]));
  }
  moe_select_row(c, s, bias, E, K);
  double norm = 1.0;
  if (normalize) {
    double sum = 0.0;
    for (std::int64_t j = 0; j < K; ++j) sum += s[c[j]];
    norm = 1.0 / sum;
  }
  for (std::int64_t j = 0; j < K; ++j) g[j] = static_cast<float>(s[c[j]] * norm * scale);
}

// One token of moe_route_backward. With a = scale, c_j the chosen experts and Z = Σ_j s[c_j]:
//   normalize: g_j = a s[c_j] / Z, so ds[c_k] = (a / Z) (dg_k − Σ_j dg_j s[c_j] / Z);
//   otherwise: g_j = a s[c_j],     so ds[c_k] = a dg_k;
// the chosen experts are distinct, so each gate's gradient lands on its own score. Then
// softmax: dlogits = s ⊙ (ds − Σ_e s ds); sigmoid: dlogits = ds s (1 − s).
// ds is built in the dlogits row d, which the score function's backward then rewrites in place;
// extra (E) or null is the scores' gradient from elsewhere, added first.
T3D_HD inline void moe_route_backward_row(float* d, const float* dg, const float* extra,
                                          const float* s, const std::int32_t* c, std::int64_t E,
                                          std::int64_t K, bool softmax, bool normalize,
                                          float scale) {
  for (std::int64_t e = 0; e < E; ++e) d[e] = extra ? extra[e] : 0.0f;
  if (normalize) {
    double z = 0.0, dot = 0.0;
    for (std::int64_t j = 0; j < K; ++j) z += s[c[j]];
    for (std::int64_t j = 0; j < K; ++j) dot += static_cast<double>(dg[j]) * s[c[j]];
    const double a_z = scale / z, mean = dot / z;
    for (std::int64_t j = 0; j < K; ++j) d[c[j]] += static_cast<float>(a_z * (dg[j] - mean));
  } else {
    for (std::int64_t j = 0; j < K; ++j) d[c[j]] += scale * dg[j];
  }
  if (softmax) {
    double dot = 0.0;
    for (std::int64_t e = 0; e < E; ++e) dot += static_cast<double>(s[e]) * d[e];
    for (std::int64_t e = 0; e < E; ++e) d[e] = static_cast<float>(s[e] * (d[e] - dot));
  } else {
    for (std::int64_t e = 0; e < E; ++e) d[e] = d[e] * s[e] * (1.0f - s[e]);
  }
}

// One token of the auxiliary loss (kernels/ops_moe.h moe_aux_loss), with f (E) its sequence's
// routed fractions and s (E) its scores: returns Σ_e f_e p[t, e] (p = s, or s / Σ s for sigmoid);
// with d (E) non-null writes the gradient of w · (that sum) with respect to s, w = weight · E / T:
//   softmax: w f_e;  sigmoid: w (f_e − Σ_e' f_e' p[t, e']) / Σ s.
T3D_HD inline double moe_aux_token(float* d, const float* s, const double* f, std::int64_t E,
                                   bool sigmoid, double w) {
  double sum = 1.0;
  if (sigmoid) {
    sum = 0.0;
    for (std::int64_t e = 0; e < E; ++e) sum += s[e];
  }
  double fp = 0.0;  // Σ_e f_e p[t, e]
  for (std::int64_t e = 0; e < E; ++e) fp += f[e] * s[e];
  fp /= sum;
  if (d)
    for (std::int64_t e = 0; e < E; ++e)
      d[e] = static_cast<float>(sigmoid ? w * (f[e] - fp) / sum : w * f[e]);
  return fp;
}

// A permuted row's gate gradient term: U[r, f] · h[r, f] in double (exact: a product of two
// floats), summed over f in increasing order into one double per row, rounded once.
T3D_HD inline double moe_gate_term(float u, float h) { return static_cast<double>(u) * h; }

}  // namespace
}  // namespace t3d::kernels::detail
