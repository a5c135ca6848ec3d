// Mixture-of-experts operators: the router against a double reference and central differences,
// the permutation's invariants, the routed layer (gather, grouped experts, combine) against a
// per-token reference and its central differences, the auxiliary loss and the bias rule against
// hand computations.
#include <gtest/gtest.h>

#include <algorithm>
#include <cmath>
#include <cstring>
#include <limits>
#include <numeric>
#include <random>
#include <vector>

#include "kernels/blas.h"
#include "kernels/check.h"
#include "kernels/ops_moe.h"
#include "reference.h"

namespace t3d::kernels {
namespace {

using ref::Vec;
using ref::with_threads;
using I32 = std::vector<std::int32_t>;

using ref::kFp32;

// ---- references ---------------------------------------------------------------------------

struct RouteRef {
  Vec scores, gates;
  I32 chosen;
};

// The router in double. The selection sorts (s + bias) descending with ties to the lower index;
// `fixed` (non-null) replaces it, as the backward holds the selection constant.
RouteRef route_ref(const Vec& logits, const std::vector<float>* bias, const RouterShape& r,
                   const I32* fixed = nullptr) {
  const int N = r.N, E = r.E, K = r.K;
  RouteRef o{Vec(N * E), Vec(N * K), I32(N * K)};
  for (int t = 0; t < N; ++t) {
    const double* x = &logits[t * E];
    double* s = &o.scores[t * E];
    if (r.score == RouterScore::kSoftmax) {
      const double mx = *std::max_element(x, x + E);
      double sum = 0;
      for (int e = 0; e < E; ++e) sum += std::exp(x[e] - mx);
      for (int e = 0; e < E; ++e) s[e] = std::exp(x[e] - mx) / sum;
    } else {
      for (int e = 0; e < E; ++e) s[e] = 1 / (1 + std::exp(-x[e]));
    }
    I32 idx(E);
    std::iota(idx.begin(), idx.end(), 0);
    const auto key = [&](int e) { return s[e] + (bias ? (*bias)[e] : 0.0); };
    std::stable_sort(idx.begin(), idx.end(), [&](int a, int b) { return key(a) > key(b); });
    for (int j = 0; j < K; ++j) o.chosen[t * K + j] = fixed ? (*fixed)[t * K + j] : idx[j];
    double z = 0;
    for (int j = 0; j < K; ++j) z += s[o.chosen[t * K + j]];
    for (int j = 0; j < K; ++j)
      o.gates[t * K + j] = s[o.chosen[t * K + j]] / (r.normalize ? z : 1.0) * r.scale;
  }
  return o;
}

struct Weights {
  Vec wg, wu, wd;  // (E, Fe, C), (E, Fe, C), (E, C, Fe)
};

// Which slots an expert capacity keeps, by its definition: walking the slots in order (token,
// then rank j), each expert keeps its first `capacity` (0: every slot is kept).
std::vector<bool> kept_ref(const I32& chosen, int E, int capacity) {
  std::vector<bool> kept(chosen.size(), true);
  std::vector<int> taken(E, 0);
  for (size_t i = 0; i < chosen.size(); ++i)
    kept[i] = capacity == 0 || taken[chosen[i]]++ < capacity;
  return kept;
}

// The routed layer token by token: out[t] = Σ_j gates[t K + j] · FFN_{chosen[t K + j]}(x[t]),
// each expert's SwiGLU FFN written out as loops; slots not `kept` (when given) add nothing.
Vec layer_ref(const Vec& x, const Vec& gates, const Weights& w, const I32& chosen, int N, int K,
              int C, int Fe, const std::vector<bool>* kept = nullptr) {
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

// Σ_b E Σ_e f[b, e] P[b, e] with f from `chosen` (a constant) and p the scores over all E.
double aux_ref(const Vec& s, const I32& chosen, int B, int T, int E, int K, bool sigmoid) {
  double total = 0;
  for (int b = 0; b < B; ++b) {
    Vec f(E, 0.0), P(E, 0.0);
    for (int i = 0; i < T * K; ++i) f[chosen[b * T * K + i]] += 1.0 / (T * K);
    for (int t = 0; t < T; ++t) {
      const double* row = &s[(b * T + t) * E];
      double sum = 0;
      for (int e = 0; e < E; ++e) sum += row[e];
      for (int e = 0; e < E; ++e) P[e] += (sigmoid ? row[e] / sum : row[e]) / T;
    }
    for (int e = 0; e < E; ++e) total += E * f[e] * P[e];
  }
  return total;
}

// Logits whose scores are well separated in every row (a shuffled ladder of step 0.4 plus noise
// below 0.05), so no selection flips under a finite-difference step.
std::vector<float> separated_logits(int N, int E, std::uint32_t seed) {
  std::mt19937 rng(seed);
  std::uniform_real_distribution<float> noise(-0.05f, 0.05f);
  std::vector<float> x(N * E);
  I32 perm(E);
  std::iota(perm.begin(), perm.end(), 0);
  for (int t = 0; t < N; ++t) {
    std::shuffle(perm.begin(), perm.end(), rng);
    for (int e = 0; e < E; ++e) x[t * E + e] = 0.4f * (perm[e] - E / 2) + noise(rng);
  }
  return x;
}

const char* score_name(RouterScore s) { return s == RouterScore::kSoftmax ? "softmax" : "sigmoid"; }

// ---- router -------------------------------------------------------------------------------

TEST(kernels_moe_router, ForwardMatchesReference) {
  const int N = 9, E = 8, K = 3;
  const auto logits = ref::random_floats(N * E, 100, -3, 3);
  const auto bias = ref::random_floats(E, 101, -0.3f, 0.3f);
  for (RouterScore score : {RouterScore::kSoftmax, RouterScore::kSigmoid})
    for (bool normalize : {true, false})
      for (float scale : {1.0f, 2.5f})
        for (const std::vector<float>* b :
             {static_cast<const std::vector<float>*>(nullptr), &bias}) {
          SCOPED_TRACE(testing::Message() << score_name(score) << " normalize " << normalize
                                          << " scale " << scale << " bias " << (b != nullptr));
          const RouterShape r{N, E, K, score, normalize, scale};
          std::vector<float> scores(N * E), gates(N * K, -1.0f);
          I32 chosen(N * K, -1);
          moe_route_forward(scores.data(), chosen.data(), gates.data(), logits.data(),
                            b ? b->data() : nullptr, r);
          const RouteRef want = route_ref(ref::to_double(logits), b, r);
          ref::expect_close(scores, want.scores, 1e-6, 1e-7, "scores");
          EXPECT_EQ(chosen, want.chosen);
          ref::expect_close(gates, want.gates, 1e-6, 1e-7, "gates");

          // In place (scores over the logits), as the model may call it: the same bits.
          std::vector<float> inplace = logits, gates2(N * K);
          I32 chosen2(N * K);
          moe_route_forward(inplace.data(), chosen2.data(), gates2.data(), inplace.data(),
                            b ? b->data() : nullptr, r);
          EXPECT_EQ(inplace, scores);
          EXPECT_EQ(chosen2, chosen);
          EXPECT_EQ(gates2, gates);
        }
}

TEST(kernels_moe_router, TiesGoToTheLowerIndex) {
  const int E = 5, K = 3;
  // Row 0: all equal; row 1: a three-way tie for first; row 2: a tie for the last place.
  const std::vector<float> logits = {0, 0, 0, 0, 0,  //
                                     1, 3, 3, 0, 3,  //
                                     2, 1, 0, 1, 5};
  for (RouterScore score : {RouterScore::kSoftmax, RouterScore::kSigmoid}) {
    SCOPED_TRACE(score_name(score));
    const RouterShape r{3, E, K, score, true, 1.0f};
    std::vector<float> scores(3 * E), gates(3 * K);
    I32 chosen(3 * K);
    moe_route_forward(scores.data(), chosen.data(), gates.data(), logits.data(), nullptr, r);
    EXPECT_EQ(chosen, (I32{0, 1, 2, 1, 2, 4, 4, 0, 1}));
    for (int j = 0; j < K; ++j) EXPECT_EQ(gates[j], gates[0]);  // equal scores, equal gates
  }
  // Ties made by the bias: sigmoid(0) = 0.5 everywhere, bias 0.25 on experts 1 and 3.
  const std::vector<float> zeros(4, 0.0f), bias = {0.0f, 0.25f, 0.0f, 0.25f};
  const RouterShape r{1, 4, 3, RouterScore::kSigmoid, true, 1.0f};
  std::vector<float> scores(4), gates(3);
  I32 chosen(3);
  moe_route_forward(scores.data(), chosen.data(), gates.data(), zeros.data(), bias.data(), r);
  EXPECT_EQ(chosen, (I32{1, 3, 0}));
  for (float g : gates) EXPECT_FLOAT_EQ(g, 1.0f / 3);  // the bias is not in the gates
}

// A diverged router (NaN logits) still routes every slot to K distinct experts in [0, E), so
// the permutation stays in bounds; the NaN reaches the gates and so the loss.
TEST(kernels_moe_router, NanLogitsStillChooseValidExperts) {
  const float nan = std::numeric_limits<float>::quiet_NaN();
  const std::vector<float> logits = {nan, 1,   nan, 2,   0,  //
                                     nan, nan, nan, nan, nan};
  for (RouterScore score : {RouterScore::kSoftmax, RouterScore::kSigmoid}) {
    SCOPED_TRACE(score_name(score));
    const RouterShape r{2, 5, 3, score, true, 1.0f};
    std::vector<float> scores(10), gates(6);
    I32 chosen(6);
    moe_route_forward(scores.data(), chosen.data(), gates.data(), logits.data(), nullptr, r);
    EXPECT_EQ(I32(chosen.begin() + 3, chosen.end()), (I32{0, 1, 2}));
    if (score == RouterScore::kSigmoid) {  // softmax spreads the NaN over the whole row
      EXPECT_EQ(I32(chosen.begin(), chosen.begin() + 3), (I32{3, 1, 4}));
    }
    for (std::int32_t c : chosen) EXPECT_TRUE(c >= 0 && c < 5);
    EXPECT_TRUE(std::isnan(gates[3]));
  }
}

TEST(kernels_moe_router, BiasChangesTheSelectionNotTheGates) {
  const int N = 6, E = 6, K = 2;
  const auto logits = separated_logits(N, E, 110);
  std::vector<float> bias(E, 0.0f);
  bias[5] = 10.0f;  // expert 5 is always first, whatever its score
  for (RouterScore score : {RouterScore::kSoftmax, RouterScore::kSigmoid}) {
    SCOPED_TRACE(score_name(score));
    const RouterShape r{N, E, K, score, false, 1.0f};
    std::vector<float> s0(N * E), g0(N * K), s1(N * E), g1(N * K);
    I32 c0(N * K), c1(N * K);
    moe_route_forward(s0.data(), c0.data(), g0.data(), logits.data(), nullptr, r);
    moe_route_forward(s1.data(), c1.data(), g1.data(), logits.data(), bias.data(), r);
    EXPECT_EQ(s0, s1);
    int changed = 0;
    for (int t = 0; t < N; ++t) {
      EXPECT_EQ(c1[t * K], 5);
      changed += c1[t * K] != c0[t * K];
      for (int j = 0; j < K; ++j)  // unnormalised, scale 1: the gate is the bare score
        EXPECT_EQ(g1[t * K + j], s1[t * E + c1[t * K + j]]);
    }
    EXPECT_GT(changed, 0);
  }
}

// L = Σ dgates_coef · gates + Σ extra · scores with the selection held constant.
TEST(kernels_moe_router, BackwardMatchesFiniteDifferences) {
  const int N = 5, E = 7, K = 3;
  const auto logits = separated_logits(N, E, 120);
  const auto bias = ref::random_floats(E, 121, -0.005f, 0.005f);
  const auto dg = ref::random_floats(N * K, 122), extra = ref::random_floats(N * E, 123);
  for (RouterScore score : {RouterScore::kSoftmax, RouterScore::kSigmoid})
    for (bool normalize : {true, false})
      for (bool with_extra : {true, false}) {
        SCOPED_TRACE(testing::Message()
                     << score_name(score) << " normalize " << normalize << " extra " << with_extra);
        const RouterShape r{N, E, K, score, normalize, 1.7f};
        std::vector<float> scores(N * E), gates(N * K), dlogits(N * E, 99.0f);
        I32 chosen(N * K);
        moe_route_forward(scores.data(), chosen.data(), gates.data(), logits.data(), bias.data(),
                          r);
        moe_route_backward(dlogits.data(), dg.data(), with_extra ? extra.data() : nullptr,
                           scores.data(), chosen.data(), r);
        // f(logits) = [gates, scores], weighed by [dg, extra or 0]; the reference re-selects
        // and must find the forward's experts at every perturbed point.
        Vec coef = ref::to_double(dg);
        for (int i = 0; i < N * E; ++i) coef.push_back(with_extra ? extra[i] : 0.0);
        const auto f = [&](const Vec& x) {
          const RouteRef o = route_ref(x, &bias, r);
          EXPECT_EQ(o.chosen, chosen);
          Vec v = o.gates;
          v.insert(v.end(), o.scores.begin(), o.scores.end());
          return v;
        };
        ref::expect_close(dlogits, ref::numeric_grad(f, ref::to_double(logits), coef, 1e-4), 1e-4,
                          1e-5, "dlogits");
      }
}

// ---- permutation, gather, combine ---------------------------------------------------------

struct Perm {
  std::vector<std::int64_t> offsets;
  I32 row_of_slot, slot_of_row;
};

Perm permute(const I32& chosen, int N, int E, int K, int capacity = 0) {
  Perm p{std::vector<std::int64_t>(E + 1, -7), I32(N * K, -7), I32(N * K, -7)};
  const std::int64_t dropped = moe_permute(p.offsets.data(), p.row_of_slot.data(),
                                           p.slot_of_row.data(), chosen.data(), N, E, K, capacity);
  EXPECT_EQ(dropped, N * K - p.offsets[E]);
  return p;
}

// ExpertShape::part_offsets of two parts per expert: its rows split after the first `first`
// (an empty second part where it has no more).
std::vector<std::int64_t> two_parts(const std::vector<std::int64_t>& offsets, int E, int first) {
  std::vector<std::int64_t> parts(2 * E + 1);
  for (int e = 0; e < E; ++e) {
    parts[2 * e] = offsets[e];
    parts[2 * e + 1] = std::min(offsets[e] + first, offsets[e + 1]);
  }
  parts[2 * E] = offsets[E];
  return parts;
}

// Offsets are the counts' prefix sums, the two maps are inverse, and each expert's rows hold its
// slots in ascending order.
void expect_valid_permutation(const Perm& p, const I32& chosen, int E) {
  const int S = static_cast<int>(chosen.size());
  std::vector<std::int64_t> want(E + 1, 0);
  for (int i = 0; i < S; ++i) ++want[chosen[i] + 1];
  for (int e = 0; e < E; ++e) want[e + 1] += want[e];
  EXPECT_EQ(p.offsets, want);
  for (int i = 0; i < S; ++i) {
    ASSERT_GE(p.row_of_slot[i], 0);
    ASSERT_LT(p.row_of_slot[i], S);
    EXPECT_EQ(p.slot_of_row[p.row_of_slot[i]], i);
  }
  for (int e = 0; e < E; ++e)
    for (std::int64_t r = p.offsets[e]; r < p.offsets[e + 1]; ++r) {
      EXPECT_EQ(chosen[p.slot_of_row[r]], e) << "row " << r;
      if (r > p.offsets[e]) {
        EXPECT_LT(p.slot_of_row[r - 1], p.slot_of_row[r]) << "row " << r;
      }
    }
}

TEST(kernels_moe_permute, SmallExampleByHand) {
  // Slots 0..5 go to experts 2, 0, 0, 1, 2, 1; expert 3 gets none.
  const I32 chosen = {2, 0, 0, 1, 2, 1};
  const Perm p = permute(chosen, 3, 4, 2);
  EXPECT_EQ(p.offsets, (std::vector<std::int64_t>{0, 2, 4, 6, 6}));
  EXPECT_EQ(p.slot_of_row, (I32{1, 2, 3, 5, 0, 4}));
  EXPECT_EQ(p.row_of_slot, (I32{4, 0, 1, 2, 5, 3}));
}

TEST(kernels_moe_permute, EmptyExpertsAndAllToOne) {
  {  // random pairs from experts {1, 3, 4} of 6: experts 0, 2 and 5 (the last) get nothing
    const int N = 40, K = 2, E = 6;
    std::mt19937 rng(130);
    const int pool[3] = {1, 3, 4};
    I32 chosen(N * K);
    for (int t = 0; t < N; ++t) {
      const int a = rng() % 3, b = (a + 1 + rng() % 2) % 3;
      chosen[t * K] = pool[a], chosen[t * K + 1] = pool[b];
    }
    const Perm p = permute(chosen, N, E, K);
    expect_valid_permutation(p, chosen, E);
    EXPECT_EQ(p.offsets[1], 0);
    EXPECT_EQ(p.offsets[6], p.offsets[5]);
  }
  {  // every token to expert 2 of 4 (K = 1): the identity permutation
    const int N = 17, E = 4;
    const I32 chosen(N, 2);
    const Perm p = permute(chosen, N, E, 1);
    expect_valid_permutation(p, chosen, E);
    EXPECT_EQ(p.offsets, (std::vector<std::int64_t>{0, 0, 0, N, N}));
    for (int i = 0; i < N; ++i) EXPECT_EQ(p.slot_of_row[i], i);
  }
}

TEST(kernels_moe_permute, CapacityRoundsUp) {
  EXPECT_EQ(moe_capacity(0.0, 128, 4, 2), 0);   // dropless
  EXPECT_EQ(moe_capacity(1.0, 128, 4, 2), 64);  // an even share
  EXPECT_EQ(moe_capacity(1.25, 5, 4, 2), 4);    // 3.125 rounded up
  EXPECT_EQ(moe_capacity(1e-6, 5, 4, 2), 1);    // at least one slot
  EXPECT_EQ(moe_capacity(8.0, 10, 4, 1), 20);   // more than any expert can receive: no drop
}

TEST(kernels_moe_permute, CapacityKeepsTheFirstSlotsByHand) {
  // Slots 0..7 go to experts 2, 0 | 0, 1 | 2, 1 | 2, 0; capacity 2: expert 0 keeps slots 1, 2
  // and drops 7; expert 2 keeps 0, 4 and drops 6; expert 1 keeps both; expert 3 gets none.
  const I32 chosen = {2, 0, 0, 1, 2, 1, 2, 0};
  const Perm p = permute(chosen, 4, 4, 2, 2);
  EXPECT_EQ(p.offsets, (std::vector<std::int64_t>{0, 2, 4, 6, 6}));
  EXPECT_EQ(I32(p.slot_of_row.begin(), p.slot_of_row.begin() + 6), (I32{1, 2, 3, 5, 0, 4}));
  EXPECT_EQ(p.row_of_slot, (I32{4, 0, 1, 2, 5, 3, -1, -1}));
  // Capacity 1: the first slot of each expert.
  const Perm q = permute(chosen, 4, 4, 2, 1);
  EXPECT_EQ(q.offsets, (std::vector<std::int64_t>{0, 1, 2, 3, 3}));
  EXPECT_EQ(q.row_of_slot, (I32{2, 0, -1, 1, -1, -1, -1, -1}));
  // A capacity no expert reaches is the dropless permutation.
  const Perm all = permute(chosen, 4, 4, 2), roomy = permute(chosen, 4, 4, 2, 4);
  EXPECT_EQ(all.offsets, roomy.offsets);
  EXPECT_EQ(all.row_of_slot, roomy.row_of_slot);
  EXPECT_EQ(all.slot_of_row, roomy.slot_of_row);
}

TEST(kernels_moe_permute, CapacityMatchesItsDefinition) {
  const int N = 50, E = 6, K = 3;
  std::mt19937 rng(131);
  I32 chosen(N * K);
  for (int t = 0; t < N; ++t) {  // K distinct experts, skewed toward the low ones
    I32 pool(E);
    std::iota(pool.begin(), pool.end(), 0);
    std::shuffle(pool.begin(), pool.end(), rng);
    std::sort(pool.begin(), pool.begin() + K + 1);
    for (int j = 0; j < K; ++j) chosen[t * K + j] = pool[j];
  }
  for (int capacity : {1, 7, 20, 30}) {
    SCOPED_TRACE(testing::Message() << "capacity " << capacity);
    const Perm p = permute(chosen, N, E, K, capacity);
    const std::vector<bool> kept = kept_ref(chosen, E, capacity);
    I32 kept_chosen;  // the kept slots alone form a dropless permutation's input
    for (int i = 0; i < N * K; ++i) {
      EXPECT_EQ(p.row_of_slot[i] >= 0, kept[i]) << "slot " << i;
      if (kept[i]) kept_chosen.push_back(chosen[i]);
    }
    for (int e = 0; e < E; ++e) EXPECT_LE(p.offsets[e + 1] - p.offsets[e], capacity);
    for (std::int64_t r = 0; r < p.offsets[E]; ++r) {
      EXPECT_EQ(p.row_of_slot[p.slot_of_row[r]], r);
      if (r > 0 && chosen[p.slot_of_row[r - 1]] == chosen[p.slot_of_row[r]]) {
        EXPECT_LT(p.slot_of_row[r - 1], p.slot_of_row[r]) << "row " << r;
      }
    }
    EXPECT_EQ(p.offsets[E], static_cast<std::int64_t>(kept_chosen.size()));
  }
}

// Expert parallelism's reorder against a plain reference: element by element, both directions,
// with empty (source, expert) blocks.
TEST(kernels_moe_ep, ReorderBetweenSourceAndExpertMajor) {
  const int P = 3, El = 2, W = 5;
  const I32 counts = {2, 0, 1, 3, 0, 4};  // [s·El + j]
  int rows = 0;
  for (const int c : counts) rows += c;
  std::vector<float> source(static_cast<size_t>(rows * W));
  for (size_t i = 0; i < source.size(); ++i) source[i] = static_cast<float>(i) + 0.5f;
  // Reference: walk the blocks in expert-major order, finding each in source-major order.
  std::vector<float> want;
  for (int j = 0; j < El; ++j)
    for (int s = 0; s < P; ++s) {
      int at = 0;
      for (int i = 0; i < s * El + j; ++i) at += counts[static_cast<size_t>(i)];
      for (int r = 0; r < counts[static_cast<size_t>(s * El + j)]; ++r)
        for (int c = 0; c < W; ++c) want.push_back(source[static_cast<size_t>((at + r) * W + c)]);
    }
  std::vector<std::int64_t> offsets(El + 1), blocks(El * P + 1);
  moe_ep_offsets(offsets.data(), blocks.data(), counts.data(), P, El);
  EXPECT_EQ(offsets, (std::vector<std::int64_t>{0, 3, 10}));
  EXPECT_EQ(blocks, (std::vector<std::int64_t>{0, 2, 3, 3, 3, 6, 10}));
  std::vector<float> expert(source.size(), -1.0f), back(source.size(), -1.0f);
  moe_ep_reorder(expert.data(), source.data(), counts.data(), blocks.data(), P, El, W, true);
  EXPECT_EQ(expert, want);
  moe_ep_reorder(back.data(), expert.data(), counts.data(), blocks.data(), P, El, W, false);
  EXPECT_EQ(back, source);
}

TEST(kernels_moe_combine, GatherAndCombine) {
  const int N = 5, K = 3, C = 7, E = 4;
  const I32 chosen = {0, 1, 3, 3, 0, 2, 1, 3, 0, 2, 1, 0, 3, 2, 1};
  const Perm p = permute(chosen, N, E, K);
  const auto x = ref::random_floats(N * C, 140);
  std::vector<float> rows(N * K * C);
  moe_gather(rows.data(), x.data(), p.slot_of_row.data(), N * K, K, C);
  for (int r = 0; r < N * K; ++r)
    for (int c = 0; c < C; ++c) EXPECT_EQ(rows[r * C + c], x[(p.slot_of_row[r] / K) * C + c]);

  // The combine on rows that differ per slot (gathered rows of one token are all equal).
  rows = ref::random_floats(N * K * C, 143);
  const auto w = ref::random_floats(N * K, 141), prev = ref::random_floats(N * C, 142);
  for (const float* wp : {w.data(), static_cast<const float*>(nullptr)}) {
    // The contract's order: each product rounded to fp32, added for j ascending.
    std::vector<float> want(N * C);
    for (int t = 0; t < N; ++t)
      for (int c = 0; c < C; ++c) {
        float acc = 0;
        for (int j = 0; j < K; ++j) {
          const float prod = (wp ? wp[t * K + j] : 1.0f) * rows[p.row_of_slot[t * K + j] * C + c];
          acc = j == 0 ? prod : acc + prod;
        }
        want[t * C + c] = acc;
      }
    std::vector<float> y(N * C, 99.0f);
    moe_combine(y.data(), rows.data(), wp, p.row_of_slot.data(), N, K, C, Out::kWrite);
    EXPECT_EQ(y, want);
    std::vector<float> acc = prev;
    moe_combine(acc.data(), rows.data(), wp, p.row_of_slot.data(), N, K, C, Out::kAccumulate);
    Vec want_acc(N * C);
    for (int i = 0; i < N * C; ++i) want_acc[i] = double(prev[i]) + want[i];
    ref::expect_close(acc, want_acc, 1e-6, 1e-6, "accumulated");
  }
}

// The combine's bits against its contract written as the scalar loop it was (per element: the
// first kept product, then + each next for j ascending; a token with every slot dropped sums to
// +0; then written or added), with dropped slots, both modes, with and without weights, over a C
// longer than the kernel's chunk and not a multiple of it, onto a y holding -0 and other values.
TEST(kernels_moe_combine, BitsOfTheScalarContract) {
  const int N = 9, K = 3, C = 1100, E = 4;
  I32 chosen(N * K);
  for (int i = 0; i < N * K; ++i) chosen[i] = (i / K + i % K) % E;  // token t: t, t + 1, t + 2
  const Perm p = permute(chosen, N, E, K, /*capacity=*/4);          // drops some slots
  I32 row_of_slot = p.row_of_slot;
  row_of_slot[4 * K + 0] = row_of_slot[4 * K + 1] = row_of_slot[4 * K + 2] = -1;  // all dropped
  const auto rows = ref::random_floats(N * K * C, 144);
  const auto w = ref::random_floats(N * K, 145);
  auto prev = ref::random_floats(N * C, 146);
  for (int i = 0; i < N * C; i += 7) prev[i] = -0.0f;
  for (const float* wp : {w.data(), static_cast<const float*>(nullptr)})
    for (const Out mode : {Out::kWrite, Out::kAccumulate}) {
      std::vector<float> want = prev;
      for (int t = 0; t < N; ++t)
        for (int c = 0; c < C; ++c) {
          float acc = 0.0f;
          bool started = false;
          for (int j = 0; j < K; ++j) {
            const std::int32_t row = row_of_slot[t * K + j];
            if (row < 0) continue;
            const float v = rows[row * C + c];
            const float prod = wp ? wp[t * K + j] * v : v;
            acc = started ? acc + prod : prod;
            started = true;
          }
          want[t * C + c] = mode == Out::kAccumulate ? want[t * C + c] + acc : acc;
        }
      for (const int threads : {1, 2}) {
        std::vector<float> y = prev;
        with_threads(threads, [&] {
          moe_combine(y.data(), rows.data(), wp, row_of_slot.data(), N, K, C, mode);
        });
        ASSERT_EQ(0, std::memcmp(y.data(), want.data(), sizeof(float) * want.size()))
            << (wp ? "weighted" : "unweighted") << (mode == Out::kWrite ? ", written" : ", added")
            << ", " << threads << " threads";
      }
    }
}

// ---- the routed layer ---------------------------------------------------------------------

// out = combine(experts_forward(gather(x)), gates) against layer_ref; the backward (gather of
// dy, experts_backward, combine of dxs with weight 1) against central differences of layer_ref
// in x, the gates and the three weights. Weight gradients accumulate onto 0.5; experts without
// tokens keep exactly that. With a capacity, the reference keeps the slots kept_ref says, and a
// dropped slot's gate gradient is exactly 0 (the caller's zeroed dgates).
void check_routed_layer(const I32& chosen, int N, int E, int K, int C, int Fe, std::uint32_t seed,
                        int capacity = 0) {
  const int S = N * K;
  const Perm p = permute(chosen, N, E, K, capacity);
  const std::vector<bool> kept = kept_ref(chosen, E, capacity);
  const int rows = static_cast<int>(p.offsets[E]);
  const auto x = ref::random_floats(N * C, seed);
  const auto gates = ref::random_floats(S, seed + 1, 0.1f, 1.0f);
  const auto wg = ref::random_floats(E * Fe * C, seed + 2),
             wu = ref::random_floats(E * Fe * C, seed + 3),
             wd = ref::random_floats(E * C * Fe, seed + 4);
  const ExpertShape es{E, C, Fe};

  std::vector<float> xs(S * C), ys(S * C), gate(S * Fe), up(S * Fe), h(S * Fe), out(N * C);
  moe_gather(xs.data(), x.data(), p.slot_of_row.data(), rows, K, C);
  moe_experts_forward(kFp32, ys.data(), {gate.data(), up.data(), h.data()}, xs.data(),
                      {wg.data(), wu.data(), wd.data()}, p.offsets.data(), es);
  moe_combine(out.data(), ys.data(), gates.data(), p.row_of_slot.data(), N, K, C, Out::kWrite);
  const Vec xd = ref::to_double(x), gd = ref::to_double(gates);
  const Weights w{ref::to_double(wg), ref::to_double(wu), ref::to_double(wd)};
  const auto layer = [&](const Vec& xv, const Vec& gv, const Weights& wv) {
    return layer_ref(xv, gv, wv, chosen, N, K, C, Fe, &kept);
  };
  ref::expect_close(out, layer(xd, gd, w), 1e-5, 1e-5, "out");

  const auto dy = ref::random_floats(N * C, seed + 5);
  std::vector<float> dys(S * C), dxs(S * C, 99.0f), dx(N * C, 99.0f);
  // Dropless, every slot's gate gradient is written; with drops the caller zeroes them first.
  std::vector<float> dgates(S, capacity == 0 ? 99.0f : 0.0f);
  std::vector<float> dwg(wg.size(), 0.5f), dwu(wu.size(), 0.5f), dwd(wd.size(), 0.5f);
  std::vector<float> dh(S * Fe), dgate(S * Fe), dup(S * Fe);
  moe_gather(dys.data(), dy.data(), p.slot_of_row.data(), rows, K, C);
  moe_experts_backward(kFp32, dxs.data(), {gates.data(), dgates.data(), p.slot_of_row.data()},
                       {dwg.data(), dwu.data(), dwd.data()}, {dh.data(), dgate.data(), dup.data()},
                       dys.data(), xs.data(), {gate.data(), up.data(), h.data()},
                       {wg.data(), wu.data(), wd.data()}, p.offsets.data(), es);
  moe_combine(dx.data(), dxs.data(), nullptr, p.row_of_slot.data(), N, K, C, Out::kWrite);

  const Vec r = ref::to_double(dy);
  const auto grad = [&](auto&& f, const Vec& at, double acc) {
    Vec g = ref::numeric_grad(f, at, r);
    for (auto& v : g) v += acc;
    return g;
  };
  ref::expect_close(dx, grad([&](const Vec& v) { return layer(v, gd, w); }, xd, 0), 1e-4, 1e-5,
                    "dx");
  ref::expect_close(dgates, grad([&](const Vec& v) { return layer(xd, v, w); }, gd, 0), 1e-4, 1e-5,
                    "dgates");
  for (int i = 0; i < S; ++i) {
    if (!kept[i]) {
      EXPECT_EQ(dgates[i], 0.0f) << "dropped slot " << i;
    }
  }
  const auto with = [&](int which, const Vec& v) {
    Weights ww = w;
    (which == 0 ? ww.wg : which == 1 ? ww.wu : ww.wd) = v;
    return layer(xd, gd, ww);
  };
  ref::expect_close(dwg, grad([&](const Vec& v) { return with(0, v); }, w.wg, 0.5), 1e-4, 1e-5,
                    "dwg");
  ref::expect_close(dwu, grad([&](const Vec& v) { return with(1, v); }, w.wu, 0.5), 1e-4, 1e-5,
                    "dwu");
  ref::expect_close(dwd, grad([&](const Vec& v) { return with(2, v); }, w.wd, 0.5), 1e-4, 1e-5,
                    "dwd");
  for (int e = 0; e < E; ++e) {
    if (p.offsets[e + 1] > p.offsets[e]) continue;
    for (int i = 0; i < Fe * C; ++i) {
      EXPECT_EQ(dwg[e * Fe * C + i], 0.5f) << "expert " << e;
      EXPECT_EQ(dwu[e * Fe * C + i], 0.5f) << "expert " << e;
      EXPECT_EQ(dwd[e * C * Fe + i], 0.5f) << "expert " << e;
    }
  }
}

// for_expert_rows on every machine (gemm_row_bucket pads only on some): the ranges of each expert
// start at its first row, cover its rows once, stay inside the S rows, and take a bounded set of
// lengths; and the rows a padded range computes for the next experts end up as theirs when the
// experts run in ascending order, with a write then an accumulate into the same rows.
TEST(kernels_moe_experts, PaddedRowRangesAreOverwrittenByLaterExperts) {
  std::mt19937 rng(321);
  for (const std::int64_t bucket : {1, 4, 32}) {
    std::vector<std::int64_t> lengths;
    for (int trial = 0; trial < 200; ++trial) {
      const int E = 1 + static_cast<int>(rng() % 9);
      std::vector<std::int64_t> offsets(E + 1, 0);
      for (int e = 0; e < E; ++e)  // a third of the experts idle, the others 1..80 rows
        offsets[e + 1] =
            offsets[e] + (rng() % 3 == 0 ? 0 : 1 + static_cast<std::int64_t>(rng() % 80));
      const std::int64_t S = offsets[E];
      std::vector<int> expert_of(S);
      for (int e = 0; e < E; ++e)
        for (std::int64_t r = offsets[e]; r < offsets[e + 1]; ++r) expert_of[r] = e;
      // A row-wise "GEMM" whose output row depends on the expert and the input row: written,
      // then accumulated, as moe_experts_backward_input's dxs is.
      const auto value = [](int e, std::int64_t r, int pass) {
        return 1000.0f * e + r + 0.25f * pass;
      };
      std::vector<float> out(S, -1.0f);
      for (int e = 0; e < E; ++e) {
        const std::int64_t r0 = offsets[e], rows = offsets[e + 1] - r0;
        if (rows == 0) continue;
        std::int64_t next = r0;
        for_expert_rows(r0, rows, S, bucket, [&](std::int64_t lo, std::int64_t n) {
          ASSERT_EQ(lo, next) << "ranges are contiguous from the expert's first row";
          ASSERT_GE(n, 1);
          ASSERT_LE(lo + n, S) << "a range stays inside the S rows";
          next = lo + n;
          lengths.push_back(n);
          for (std::int64_t r = lo; r < lo + n; ++r) out[r] = value(e, r, 0);
          for (std::int64_t r = lo; r < lo + n; ++r) out[r] += value(e, r, 1);
        });
        ASSERT_GE(next, r0 + rows) << "every row of expert " << e << " covered";
        ASSERT_LT(next - (r0 + rows), bucket) << "padding by less than a bucket";
      }
      for (std::int64_t r = 0; r < S; ++r)
        ASSERT_EQ(out[r], value(expert_of[r], r, 0) + value(expert_of[r], r, 1))
            << "row " << r << " of expert " << expert_of[r] << ", bucket " << bucket;
    }
    std::sort(lengths.begin(), lengths.end());
    lengths.erase(std::unique(lengths.begin(), lengths.end()), lengths.end());
    for (const std::int64_t n : lengths)  // a multiple of the bucket, or a last expert's tail
      EXPECT_TRUE(n % bucket == 0 || n < bucket) << n << " rows, bucket " << bucket;
  }
}

TEST(kernels_moe_experts, LayerWithAnIdleExpertMatchesReference) {
  // Top-2 over experts {0, 1, 3, 4} of 5: expert 2 gets no token; odd C and Fe.
  const int N = 7, E = 5, K = 2;
  const I32 chosen = {0, 1, 3, 0, 1, 4, 4, 3, 0, 3, 1, 0, 3, 4};
  check_routed_layer(chosen, N, E, K, /*C=*/9, /*Fe=*/5, 150);
}

TEST(kernels_moe_experts, AllTokensToOneExpert) {
  const int N = 6, E = 3, K = 1;
  check_routed_layer(I32(N, 1), N, E, K, 8, 6, 160);
}

TEST(kernels_moe_experts, AllTokensShareOneExpertTopThree) {
  // Expert 4 in every token's top 3 (first, middle or last rank), the others spread.
  const int N = 5, E = 6, K = 3;
  const I32 chosen = {4, 0, 1, 2, 4, 5, 0, 3, 4, 4, 5, 2, 1, 4, 0};
  check_routed_layer(chosen, N, E, K, 7, 4, 170);
}

TEST(kernels_moe_experts, CapacityDropsLaterSlots) {
  // The idle-expert routing of LayerWithAnIdleExpertMatchesReference with room for 2 slots per
  // expert: experts 0, 1, 3 and 4 drop their later slots; tokens 4 to 6 lose both experts.
  const int N = 7, E = 5, K = 2;
  const I32 chosen = {0, 1, 3, 0, 1, 4, 4, 3, 0, 3, 1, 0, 3, 4};
  check_routed_layer(chosen, N, E, K, 9, 5, 155, /*capacity=*/2);
  check_routed_layer(chosen, N, E, K, 9, 5, 156, /*capacity=*/3);
}

TEST(kernels_moe_experts, CapacityWithAllTokensToOneExpert) {
  // Every token to expert 1 (K = 1) with room for 2: tokens 0 and 1 computed, 2..5 give 0.
  const int N = 6, E = 3, K = 1;
  check_routed_layer(I32(N, 1), N, E, K, 8, 6, 165, /*capacity=*/2);
  // Top 3 with expert 4 in every token's choice: it keeps its first 2 slots only.
  const I32 chosen = {4, 0, 1, 2, 4, 5, 0, 3, 4, 4, 5, 2, 1, 4, 0};
  check_routed_layer(chosen, 5, 6, 3, 7, 4, 175, /*capacity=*/2);
}

// Under tensor parallelism each rank holds an Fe slice of every expert: the slices' dgates and
// dxs add up to the whole expert's (the caller's all-reduce).
TEST(kernels_moe_experts, FfnSlicesSumToTheWhole) {
  const int N = 6, E = 3, K = 2, C = 5, Fe = 8, half = Fe / 2, S = N * K;
  const I32 chosen = {0, 2, 2, 0, 0, 2, 2, 0, 0, 2, 2, 0};  // expert 1 idle
  const Perm p = permute(chosen, N, E, K);
  const auto xs = ref::random_floats(S * C, 180), dy = ref::random_floats(S * C, 181);
  const auto gates = ref::random_floats(S, 182, 0.1f, 1.0f);
  const auto wg = ref::random_floats(E * Fe * C, 183), wu = ref::random_floats(E * Fe * C, 184),
             wd = ref::random_floats(E * C * Fe, 185);
  struct Grads {
    std::vector<float> dxs, dgates;
  };
  // The experts' backward on Fe columns [f0, f0 + F) of every expert.
  const auto run = [&](int f0, int F) {
    std::vector<float> g(E * F * C), u(E * F * C), d(E * C * F);
    for (int e = 0; e < E; ++e)
      for (int f = 0; f < F; ++f)
        for (int c = 0; c < C; ++c) {
          g[(e * F + f) * C + c] = wg[(e * Fe + f0 + f) * C + c];
          u[(e * F + f) * C + c] = wu[(e * Fe + f0 + f) * C + c];
          d[(e * C + c) * F + f] = wd[(e * C + c) * Fe + f0 + f];
        }
    const ExpertShape es{E, C, F};
    std::vector<float> ys(S * C), gate(S * F), up(S * F), h(S * F), dh(S * F), dg(S * F), du(S * F),
        dys = dy, dwg(g.size()), dwu(u.size()), dwd(d.size());
    moe_experts_forward(kFp32, ys.data(), {gate.data(), up.data(), h.data()}, xs.data(),
                        {g.data(), u.data(), d.data()}, p.offsets.data(), es);
    Grads out{std::vector<float>(S * C), std::vector<float>(S)};
    moe_experts_backward(kFp32, out.dxs.data(),
                         {gates.data(), out.dgates.data(), p.slot_of_row.data()},
                         {dwg.data(), dwu.data(), dwd.data()}, {dh.data(), dg.data(), du.data()},
                         dys.data(), xs.data(), {gate.data(), up.data(), h.data()},
                         {g.data(), u.data(), d.data()}, p.offsets.data(), es);
    return out;
  };
  const Grads whole = run(0, Fe), a = run(0, half), b = run(half, Fe - half);
  Vec dxs(S * C), dgates(S);
  for (int i = 0; i < S * C; ++i) dxs[i] = double(a.dxs[i]) + b.dxs[i];
  for (int i = 0; i < S; ++i) dgates[i] = double(a.dgates[i]) + b.dgates[i];
  ref::expect_close(whole.dxs, dxs, 1e-5, 1e-5, "dxs");
  ref::expect_close(whole.dgates, dgates, 1e-5, 1e-5, "dgates");
}

// The zero-bubble split: moe_experts_backward_input (B) then moe_experts_backward_weight (W) gives
// every output of moe_experts_backward bit for bit, with one GEMM per expert and with the weight
// gradients in parts (expert parallelism's sources); and B alone leaves the weight gradients as
// they were.
TEST(kernels_moe_experts, InputThenWeightIsTheWholeBackward) {
  const int N = 6, E = 3, K = 2, C = 5, Fe = 8, S = N * K;
  const I32 chosen = {0, 2, 2, 0, 0, 2, 2, 0, 0, 2, 1, 0};
  const Perm p = permute(chosen, N, E, K);
  const auto xs = ref::random_floats(S * C, 190), dy = ref::random_floats(S * C, 191);
  const auto gates = ref::random_floats(S, 192, 0.1f, 1.0f);
  const auto wg = ref::random_floats(E * Fe * C, 193), wu = ref::random_floats(E * Fe * C, 194),
             wd = ref::random_floats(E * C * Fe, 195);
  // Two parts per expert: its rows split after the first (an empty part where it has one row).
  const std::vector<std::int64_t> parts = two_parts(p.offsets, E, 1);
  for (const bool in_parts : {false, true}) {
    SCOPED_TRACE(in_parts ? "two parts per expert" : "one GEMM per expert");
    const ExpertShape es =
        in_parts ? ExpertShape{E, C, Fe, 2, parts.data()} : ExpertShape{E, C, Fe};
    std::vector<float> ys(S * C), gate(S * Fe), up(S * Fe), h(S * Fe);
    moe_experts_forward(kFp32, ys.data(), {gate.data(), up.data(), h.data()}, xs.data(),
                        {wg.data(), wu.data(), wd.data()}, p.offsets.data(), es);
    struct Out {
      std::vector<float> dxs, dgates, dwg, dwu, dwd;
    };
    const auto fresh = [&] {
      return Out{std::vector<float>(S * C), std::vector<float>(S),
                 ref::random_floats(E * Fe * C, 196), ref::random_floats(E * Fe * C, 197),
                 ref::random_floats(E * C * Fe, 198)};  // gradients already holding a micro-batch
    };
    std::vector<float> dh(S * Fe), dg(S * Fe), du(S * Fe);
    Out whole = fresh();
    std::vector<float> dys = dy;
    moe_experts_backward(
        kFp32, whole.dxs.data(), {gates.data(), whole.dgates.data(), p.slot_of_row.data()},
        {whole.dwg.data(), whole.dwu.data(), whole.dwd.data()}, {dh.data(), dg.data(), du.data()},
        dys.data(), xs.data(), {gate.data(), up.data(), h.data()},
        {wg.data(), wu.data(), wd.data()}, p.offsets.data(), es);
    Out split = fresh();
    const Out before = fresh();
    std::vector<float> kept_dys = dy, kept_dg(S * Fe), kept_du(S * Fe);
    moe_experts_backward_input(kFp32, split.dxs.data(),
                               {gates.data(), split.dgates.data(), p.slot_of_row.data()},
                               {dh.data(), kept_dg.data(), kept_du.data()}, kept_dys.data(),
                               {gate.data(), up.data(), h.data()},
                               {wg.data(), wu.data(), wd.data()}, p.offsets.data(), es);
    EXPECT_EQ(split.dxs, whole.dxs);
    EXPECT_EQ(split.dgates, whole.dgates);
    EXPECT_EQ(split.dwg, before.dwg);
    EXPECT_EQ(split.dwu, before.dwu);
    EXPECT_EQ(split.dwd, before.dwd);
    moe_experts_backward_weight(kFp32, {split.dwg.data(), split.dwu.data(), split.dwd.data()},
                                kept_dys.data(), {nullptr, kept_dg.data(), kept_du.data()},
                                xs.data(), h.data(), p.offsets.data(), es);
    EXPECT_EQ(split.dwg, whole.dwg);
    EXPECT_EQ(split.dwu, whole.dwu);
    EXPECT_EQ(split.dwd, whole.dwd);
    EXPECT_NE(split.dwd, before.dwd);
  }
}

// The backward's row loop by its contract, bit for bit: with U = dys · wd[e] (the same GEMM),
// dgates[slot] = the sequential double sum over f of U[r, f] · h[r, f], rounded once; then U and
// dys scaled by the row's gate. Row counts that are not multiples of the loop's groups.
TEST(kernels_moe_experts, BackwardRowLoopBits) {
  const int N = 11, E = 3, K = 2, C = 6, Fe = 13, S = N * K;
  const I32 chosen = {0, 2, 2, 0, 0, 2, 2, 0, 0, 2, 1, 0, 1, 2, 0, 1, 2, 1, 0, 1, 2, 0};
  const Perm p = permute(chosen, N, E, K);
  const auto xs = ref::random_floats(S * C, 230), dy = ref::random_floats(S * C, 231);
  const auto gates = ref::random_floats(S, 232, 0.1f, 1.0f);
  const auto wg = ref::random_floats(E * Fe * C, 233), wu = ref::random_floats(E * Fe * C, 234),
             wd = ref::random_floats(E * C * Fe, 235);
  const ExpertShape es{E, C, Fe};
  std::vector<float> ys(S * C), gate(S * Fe), up(S * Fe), h(S * Fe);
  moe_experts_forward(kFp32, ys.data(), {gate.data(), up.data(), h.data()}, xs.data(),
                      {wg.data(), wu.data(), wd.data()}, p.offsets.data(), es);
  std::vector<float> u(S * Fe);
  for (int e = 0; e < E; ++e) {
    const std::int64_t r0 = p.offsets[e], rows = p.offsets[e + 1] - r0;
    if (rows > 0)
      linear_backward_input(kFp32, u.data() + r0 * Fe, dy.data() + r0 * C, wd.data() + e * C * Fe,
                            rows, Fe, C);
  }
  std::vector<float> want_dgates(S), want_dys = dy;
  for (int r = 0; r < S; ++r) {
    double dot = 0.0;
    for (int f = 0; f < Fe; ++f) dot += static_cast<double>(u[r * Fe + f]) * h[r * Fe + f];
    const int slot = p.slot_of_row[r];
    want_dgates[slot] = static_cast<float>(dot);
    for (int c = 0; c < C; ++c) want_dys[r * C + c] *= gates[slot];
  }
  std::vector<float> dxs(S * C), dgates(S), dh(S * Fe), dg(S * Fe), du(S * Fe), dys = dy;
  moe_experts_backward_input(kFp32, dxs.data(), {gates.data(), dgates.data(), p.slot_of_row.data()},
                             {dh.data(), dg.data(), du.data()}, dys.data(),
                             {gate.data(), up.data(), h.data()}, {wg.data(), wu.data(), wd.data()},
                             p.offsets.data(), es);
  EXPECT_EQ(dgates, want_dgates);
  EXPECT_EQ(dys, want_dys);
}

// The fused bf16 SwiGLU of the experts (ExpertCopies, bf16 GEMMs) against the path it replaces:
// the fp32 activations rounded to bf16 and widened again (a bf16-stored block's encode and
// decode), every output bit for bit: the forward's rows and copies, and the backward's dxs,
// dgates, weight gradients and the gated dys, whole and split into B and W (with the weight
// gradients in parts). The fused path reads no float activation: those buffers hold NaN.
TEST(kernels_moe_experts, FusedBf16SwigluIsTheStoredPath) {
  constexpr GemmKind kBf16 = GemmKind::kOneDnnBf16;
  try {
    verify_gemm_kind(kBf16);
  } catch (const UserError& e) {
    GTEST_SKIP() << e.what();
  }
  const int N = 10, E = 3, K = 2, C = 16, Fe = 24, S = N * K;
  I32 chosen(S);
  for (int i = 0; i < S; ++i) chosen[i] = (i / K * 2 + i % K) % E;
  const Perm p = permute(chosen, N, E, K);
  const auto xs = ref::random_floats(S * C, 240), dy = ref::random_floats(S * C, 241);
  const auto gates = ref::random_floats(S, 242, 0.1f, 1.0f);
  const auto wg = ref::random_floats(E * Fe * C, 243), wu = ref::random_floats(E * Fe * C, 244),
             wd = ref::random_floats(E * C * Fe, 245);
  using ref::rounded;
  const auto round_trip = [](const std::vector<float>& x) { return ref::widened(rounded(x)); };
  const float nan = std::numeric_limits<float>::quiet_NaN();
  const std::vector<std::int64_t> parts = two_parts(p.offsets, E, 2);
  for (const bool in_parts : {false, true}) {
    SCOPED_TRACE(in_parts ? "weight gradients in parts, rows rounded already"
                          : "one GEMM per expert");
    const ExpertShape es =
        in_parts ? ExpertShape{E, C, Fe, 2, parts.data()} : ExpertShape{E, C, Fe};
    struct Out {
      std::vector<float> ys, dxs, dgates, dwg, dwu, dwd, dys;
    };
    const auto fresh = [&] {
      return Out{std::vector<float>(S * C),
                 std::vector<float>(S * C),
                 std::vector<float>(S),
                 ref::random_floats(E * Fe * C, 246),
                 ref::random_floats(E * Fe * C, 247),
                 ref::random_floats(E * C * Fe, 248),
                 dy};
    };
    // The stored path: fp32 activations, rounded and widened before the backward.
    Out want = fresh();
    std::vector<float> gate(S * Fe), up(S * Fe), h(S * Fe);
    moe_experts_forward(kBf16, want.ys.data(), {gate.data(), up.data(), h.data()}, xs.data(),
                        {wg.data(), wu.data(), wd.data()}, p.offsets.data(), es);
    auto gate_r = round_trip(gate), up_r = round_trip(up), h_r = round_trip(h);
    std::vector<float> dh(S * Fe), dg(S * Fe), du(S * Fe);
    moe_experts_backward(
        kBf16, want.dxs.data(), {gates.data(), want.dgates.data(), p.slot_of_row.data()},
        {want.dwg.data(), want.dwu.data(), want.dwd.data()}, {dh.data(), dg.data(), du.data()},
        want.dys.data(), xs.data(), {gate_r.data(), up_r.data(), h_r.data()},
        {wg.data(), wu.data(), wd.data()}, p.offsets.data(), es);
    // Fused: the copies only, and (in parts) the rows rounded already.
    std::vector<bf16> gate16(S * Fe), up16(S * Fe), h16(S * Fe);
    const std::vector<bf16> xs16 = rounded(xs);
    const ExpertCopies copies{gate16.data(), up16.data(), h16.data(),
                              in_parts ? xs16.data() : nullptr};
    std::vector<float> fgate(S * Fe), fup(S * Fe), fh(S * Fe, nan);
    Out whole = fresh();
    const std::vector<float> nan_xs(S * C, nan);
    const float* fxs = copies.xs ? nan_xs.data() : xs.data();  // with the rounded rows: not read
    moe_experts_forward(kBf16, whole.ys.data(), {fgate.data(), fup.data(), fh.data()}, fxs,
                        {wg.data(), wu.data(), wd.data()}, p.offsets.data(), es, copies);
    EXPECT_EQ(whole.ys, want.ys);
    EXPECT_EQ(gate16, rounded(gate));
    EXPECT_EQ(up16, rounded(up));
    EXPECT_EQ(h16, rounded(h));
    std::fill(fgate.begin(), fgate.end(), nan);
    std::fill(fup.begin(), fup.end(), nan);
    moe_experts_backward(
        kBf16, whole.dxs.data(), {gates.data(), whole.dgates.data(), p.slot_of_row.data()},
        {whole.dwg.data(), whole.dwu.data(), whole.dwd.data()}, {dh.data(), dg.data(), du.data()},
        whole.dys.data(), fxs, {fgate.data(), fup.data(), fh.data()},
        {wg.data(), wu.data(), wd.data()}, p.offsets.data(), es, copies);
    EXPECT_EQ(whole.dxs, want.dxs);
    EXPECT_EQ(whole.dgates, want.dgates);
    EXPECT_EQ(whole.dwg, want.dwg);
    EXPECT_EQ(whole.dwu, want.dwu);
    EXPECT_EQ(whole.dwd, want.dwd);
    EXPECT_EQ(whole.dys, want.dys);
    // B then W, fused: what B leaves in dgate and dup (their rounded first halves) W reads.
    Out split = fresh();
    std::vector<float> kdg(S * Fe), kdu(S * Fe);
    moe_experts_backward_input(kBf16, split.dxs.data(),
                               {gates.data(), split.dgates.data(), p.slot_of_row.data()},
                               {dh.data(), kdg.data(), kdu.data()}, split.dys.data(),
                               {fgate.data(), fup.data(), fh.data()},
                               {wg.data(), wu.data(), wd.data()}, p.offsets.data(), es, copies);
    moe_experts_backward_weight(kBf16, {split.dwg.data(), split.dwu.data(), split.dwd.data()},
                                split.dys.data(), {nullptr, kdg.data(), kdu.data()}, fxs, fh.data(),
                                p.offsets.data(), es, copies);
    EXPECT_EQ(split.dxs, want.dxs);
    EXPECT_EQ(split.dgates, want.dgates);
    EXPECT_EQ(split.dwg, want.dwg);
    EXPECT_EQ(split.dwu, want.dwu);
    EXPECT_EQ(split.dwd, want.dwd);
  }
}

// ---- counts, auxiliary loss, bias ----------------------------------------------------------

TEST(kernels_moe_balance, CountAccumulates) {
  std::vector<double> counts = {1, 0, 0, 0, 2};
  const I32 chosen = {0, 4, 4, 1, 0, 4};  // N = 3, K = 2
  moe_count(counts.data(), chosen.data(), 3, 5, 2);
  EXPECT_EQ(counts, (std::vector<double>{3, 1, 0, 0, 5}));
}

TEST(kernels_moe_balance, AuxLossByHand) {
  // Softmax, B = 2 sequences of T = 2 tokens, E = 3, K = 2.
  //  sequence 0: chosen {0, 1}, {1, 2}: f = (1, 2, 1) / 4; P = (0.6, 0.9, 0.5) / 2
  //              loss = 3 (0.25 0.3 + 0.5 0.45 + 0.25 0.25) = 3 · 0.3625 = 1.0875
  //  sequence 1: chosen {2, 0}, {0, 2}: f = (2, 0, 2) / 4; P = (0.9, 0.4, 0.7) / 2
  //              loss = 3 (0.5 0.45 + 0 + 0.5 0.35) = 3 · 0.4 = 1.2
  const std::vector<float> s = {0.5f, 0.3f, 0.2f, 0.1f, 0.6f, 0.3f,
                                0.2f, 0.2f, 0.6f, 0.7f, 0.2f, 0.1f};
  const I32 chosen = {0, 1, 1, 2, 2, 0, 0, 2};
  const RouterShape soft{4, 3, 2, RouterScore::kSoftmax, true, 1.0f};
  EXPECT_NEAR(moe_aux_loss(nullptr, s.data(), chosen.data(), 2, 2, soft, 1.0f), 2.2875, 1e-6);
  // Sigmoid, B = 1, T = 2, E = 2, K = 1, both tokens to expert 0: f = (1, 0);
  // p rows (0.6, 0.2) / 0.8 = (0.75, 0.25) and (0.1, 0.4) / 0.5 = (0.2, 0.8);
  // P_0 = (0.75 + 0.2) / 2 = 0.475; loss = 2 · 1 · 0.475 = 0.95.
  const std::vector<float> sg = {0.6f, 0.2f, 0.1f, 0.4f};
  const I32 c2 = {0, 0};
  const RouterShape sig{2, 2, 1, RouterScore::kSigmoid, true, 1.0f};
  EXPECT_NEAR(moe_aux_loss(nullptr, sg.data(), c2.data(), 1, 2, sig, 1.0f), 0.95, 1e-6);
}

TEST(kernels_moe_balance, AuxLossGradientMatchesFiniteDifferences) {
  const int B = 2, T = 5, E = 6, K = 2, N = B * T;
  const float weight = 0.3f;
  for (RouterScore score : {RouterScore::kSoftmax, RouterScore::kSigmoid}) {
    SCOPED_TRACE(score_name(score));
    const RouterShape r{N, E, K, score, true, 1.0f};
    std::vector<float> scores(N * E), gates(N * K), dscores(N * E, 99.0f);
    I32 chosen(N * K);
    moe_route_forward(scores.data(), chosen.data(), gates.data(),
                      ref::random_floats(N * E, 190, -2, 2).data(), nullptr, r);
    const bool sigmoid = score == RouterScore::kSigmoid;
    const double loss = moe_aux_loss(dscores.data(), scores.data(), chosen.data(), B, T, r, weight);
    const Vec sd = ref::to_double(scores);
    EXPECT_NEAR(loss, aux_ref(sd, chosen, B, T, E, K, sigmoid), 1e-6);
    const auto f = [&](const Vec& v) { return Vec{aux_ref(v, chosen, B, T, E, K, sigmoid)}; };
    ref::expect_close(dscores, ref::numeric_grad(f, sd, Vec{weight}), 1e-4, 1e-6, "dscores");
    // The value does not depend on whether the gradient is asked for.
    EXPECT_EQ(moe_aux_loss(nullptr, scores.data(), chosen.data(), B, T, r, weight), loss);
  }
}

TEST(kernels_moe_balance, BiasDeltaBySign) {
  // mean = 8: expert 0 over it (bias down), expert 1 under (up), 2 and 3 at it (unchanged). The
  // delta is written, whatever the buffer held.
  const std::vector<double> counts = {10, 6, 8, 8};
  std::vector<float> delta = {0.1f, -0.2f, 0.3f, 0.0f};
  const float rate = 0.001f;
  moe_bias_delta(delta.data(), counts.data(), 4, rate);
  EXPECT_EQ(delta, (std::vector<float>{-rate, rate, 0.0f, 0.0f}));
}

// ---- threads ------------------------------------------------------------------------------

// Large enough for the threaded row loops (N E and N K C over 64k floats): two threads give the
// one-thread bits for the router, gather and combine.
TEST(kernels_moe_threads, RowLoopsTwoThreadsEqualOne) {
  const int N = 2048, E = 64, K = 4, C = 16;
  const RouterShape r{N, E, K, RouterScore::kSoftmax, true, 1.0f};
  const auto logits = ref::random_floats(N * E, 200, -4, 4);
  const auto dg = ref::random_floats(N * K, 201), x = ref::random_floats(N * C, 202);
  struct Result {
    std::vector<float> scores, gates, dlogits, rows, y;
    I32 chosen;
  };
  const auto run = [&](int threads) {
    Result o{std::vector<float>(N * E),     std::vector<float>(N * K), std::vector<float>(N * E),
             std::vector<float>(N * K * C), std::vector<float>(N * C), I32(N * K)};
    with_threads(threads, [&] {
      moe_route_forward(o.scores.data(), o.chosen.data(), o.gates.data(), logits.data(), nullptr,
                        r);
      moe_route_backward(o.dlogits.data(), dg.data(), nullptr, o.scores.data(), o.chosen.data(), r);
      const Perm p = permute(o.chosen, N, E, K);
      moe_gather(o.rows.data(), x.data(), p.slot_of_row.data(), N * K, K, C);
      moe_combine(o.y.data(), o.rows.data(), o.gates.data(), p.row_of_slot.data(), N, K, C,
                  Out::kWrite);
    });
    return o;
  };
  const Result one = run(1), two = run(2);
  EXPECT_EQ(one.scores, two.scores);
  EXPECT_EQ(one.chosen, two.chosen);
  EXPECT_EQ(one.gates, two.gates);
  EXPECT_EQ(one.dlogits, two.dlogits);
  EXPECT_EQ(one.rows, two.rows);
  EXPECT_EQ(one.y, two.y);
}

}  // namespace
}  // namespace t3d::kernels
