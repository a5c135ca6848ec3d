// The routed layer's references and permutation helpers, shared by the MoE kernel tests
// (test_moe.cpp, test_moe_experts.cpp).
#pragma once

#include <gtest/gtest.h>

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <vector>

#include "kernels/ops_moe.h"
#include "reference.h"

namespace t3d::kernels::moe_test {

using ref::Vec;
using I32 = std::vector<std::int32_t>;

struct Weights {
  Vec wg, wu, wd;  // (E, Fe, C), (E, Fe, C), (E, C, Fe)
};

// Which slots an expert capacity keeps, by its definition: walking the slots in order (token,
// then rank j), each expert keeps its first `capacity` (0: every slot is kept).
inline std::vector<bool> kept_ref(const I32& chosen, int E, int capacity) {
  std::vector<bool> kept(chosen.size(), true);
  std::vector<int> taken(E, 0);
  for (size_t i = 0; i < chosen.size(); ++i)
    kept[i] = capacity == 0 || taken[chosen[i]]++ < capacity;
  return kept;
}

// The routed layer token by token: out[t] = Σ_j gates[t K + j] · FFN_{chosen[t K + j]}(x[t]),
// each expert's SwiGLU FFN written out as loops; slots not `kept` (when given) add nothing.
inline Vec layer_ref(const Vec& x, const Vec& gates, const Weights& w, const I32& chosen, int N,
                     int K, int C, int Fe, const std::vector<bool>* kept = nullptr) {
  Vec out(N * C, 0.0), h(Fe);
  for (int t = 0; t < N; ++t)
    for (int j = 0; j < K; ++j) {
      if (kept && !(*kept)[t * K + j]) continue;
      const int e = chosen[t * K + j];
      for (int f = 0; f < Fe; ++f) {
        double g = 0, u = 0;
        for (int c = 0; c < C; ++c) {
          g += x[t * C + c] * w.wg[(e * Fe + f) * C + c];
          u += x[t * C + c] * w.wu[(e * Fe + f) * C + c];
        }
        h[f] = g / (1 + std::exp(-g)) * u;
      }
      for (int c = 0; c < C; ++c) {
        double y = 0;
        for (int f = 0; f < Fe; ++f) y += h[f] * w.wd[(e * C + c) * Fe + f];
        out[t * C + c] += gates[t * K + j] * y;
      }
    }
  return out;
}

struct Perm {
  std::vector<std::int64_t> offsets;
  I32 row_of_slot, slot_of_row;
};

inline Perm permute(const I32& chosen, int N, int E, int K, int capacity = 0) {
  Perm p{std::vector<std::int64_t>(E + 1, -7), I32(N * K, -7), I32(N * K, -7)};
  const std::int64_t dropped = moe_permute(p.offsets.data(), p.row_of_slot.data(),
                                           p.slot_of_row.data(), chosen.data(), N, E, K, capacity);
  EXPECT_EQ(dropped, N * K - p.offsets[E]);
  return p;
}

// ExpertShape::part_offsets of two parts per expert: its rows split after the first `first`
// (an empty second part where it has no more).
inline std::vector<std::int64_t> two_parts(const std::vector<std::int64_t>& offsets, int E,
                                           int first) {
  std::vector<std::int64_t> parts(2 * E + 1);
  for (int e = 0; e < E; ++e) {
    parts[2 * e] = offsets[e];
    parts[2 * e + 1] = std::min(offsets[e] + first, offsets[e + 1]);
  }
  parts[2 * E] = offsets[E];
  return parts;
}

// The shared experts' sigmoid gate (kernels/ops_gate.h), in double: out = out0 + g ⊙ shared with
// g[t] = sigmoid(x[t] · w); g returned through `g` when given.
inline Vec shared_gate_ref(const Vec& out0, const Vec& x, const Vec& w, const Vec& shared, int N,
                           int C, Vec* g = nullptr) {
  Vec out = out0;
  if (g) g->assign(N, 0.0);
  for (int t = 0; t < N; ++t) {
    double z = 0;
    for (int c = 0; c < C; ++c) z += x[t * C + c] * w[c];
    const double gt = 1.0 / (1.0 + std::exp(-z));
    if (g) (*g)[t] = gt;
    for (int c = 0; c < C; ++c) out[t * C + c] += gt * shared[t * C + c];
  }
  return out;
}

}  // namespace t3d::kernels::moe_test
