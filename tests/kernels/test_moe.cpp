// Mixture-of-experts operators: the router against a double reference and central differences,
// the permutation's invariants, gather and combine, the auxiliary loss and the bias rule against
// hand computations (the routed experts' grouped pass: test_moe_experts.cpp).
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
#include "kernels/ops.h"
#include "kernels/ops_moe.h"
#include "moe_reference.h"
#include "reference.h"

namespace t3d::kernels {
namespace {

using ref::Vec;
using ref::with_threads;
using I32 = std::vector<std::int32_t>;
using moe_test::kept_ref;
using moe_test::Perm;
using moe_test::permute;

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
          moe_route_forward(kCpu, scores.data(), chosen.data(), gates.data(), logits.data(),
                            b ? b->data() : nullptr, r);
          const RouteRef want = route_ref(ref::to_double(logits), b, r);
          ref::expect_close(scores, want.scores, 1e-6, 1e-7, "scores");
          EXPECT_EQ(chosen, want.chosen);
          ref::expect_close(gates, want.gates, 1e-6, 1e-7, "gates");

          // In place (scores over the logits), as the model may call it: the same bits.
          std::vector<float> inplace = logits, gates2(N * K);
          I32 chosen2(N * K);
          moe_route_forward(kCpu, inplace.data(), chosen2.data(), gates2.data(), inplace.data(),
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
    moe_route_forward(kCpu, scores.data(), chosen.data(), gates.data(), logits.data(), nullptr, r);
    EXPECT_EQ(chosen, (I32{0, 1, 2, 1, 2, 4, 4, 0, 1}));
    for (int j = 0; j < K; ++j) EXPECT_EQ(gates[j], gates[0]);  // equal scores, equal gates
  }
  // Ties made by the bias: sigmoid(0) = 0.5 everywhere, bias 0.25 on experts 1 and 3.
  const std::vector<float> zeros(4, 0.0f), bias = {0.0f, 0.25f, 0.0f, 0.25f};
  const RouterShape r{1, 4, 3, RouterScore::kSigmoid, true, 1.0f};
  std::vector<float> scores(4), gates(3);
  I32 chosen(3);
  moe_route_forward(kCpu, scores.data(), chosen.data(), gates.data(), zeros.data(), bias.data(), r);
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
    moe_route_forward(kCpu, scores.data(), chosen.data(), gates.data(), logits.data(), nullptr, r);
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
    moe_route_forward(kCpu, s0.data(), c0.data(), g0.data(), logits.data(), nullptr, r);
    moe_route_forward(kCpu, s1.data(), c1.data(), g1.data(), logits.data(), bias.data(), r);
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
        moe_route_forward(kCpu, scores.data(), chosen.data(), gates.data(), logits.data(),
                          bias.data(), r);
        moe_route_backward(kCpu, dlogits.data(), dg.data(), with_extra ? extra.data() : nullptr,
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
  moe_ep_reorder(kCpu, expert.data(), source.data(), counts.data(), blocks.data(), P, El, W, true);
  EXPECT_EQ(expert, want);
  moe_ep_reorder(kCpu, back.data(), expert.data(), counts.data(), blocks.data(), P, El, W, false);
  EXPECT_EQ(back, source);
}

TEST(kernels_moe_combine, GatherAndCombine) {
  const int N = 5, K = 3, C = 7, E = 4;
  const I32 chosen = {0, 1, 3, 3, 0, 2, 1, 3, 0, 2, 1, 0, 3, 2, 1};
  const Perm p = permute(chosen, N, E, K);
  const auto x = ref::random_floats(N * C, 140);
  std::vector<float> rows(N * K * C);
  moe_gather(kCpu, rows.data(), x.data(), p.slot_of_row.data(), N * K, K, C);
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
    moe_combine(kCpu, y.data(), rows.data(), wp, p.row_of_slot.data(), N, K, C, Out::kWrite);
    EXPECT_EQ(y, want);
    std::vector<float> acc = prev;
    moe_combine(kCpu, acc.data(), rows.data(), wp, p.row_of_slot.data(), N, K, C, Out::kAccumulate);
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
          moe_combine(kCpu, y.data(), rows.data(), wp, row_of_slot.data(), N, K, C, mode);
        });
        ASSERT_EQ(0, std::memcmp(y.data(), want.data(), sizeof(float) * want.size()))
            << (wp ? "weighted" : "unweighted") << (mode == Out::kWrite ? ", written" : ", added")
            << ", " << threads << " threads";
      }
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
  EXPECT_NEAR(moe_aux_loss(kCpu, nullptr, s.data(), chosen.data(), 2, 2, soft, 1.0f), 2.2875, 1e-6);
  // Sigmoid, B = 1, T = 2, E = 2, K = 1, both tokens to expert 0: f = (1, 0);
  // p rows (0.6, 0.2) / 0.8 = (0.75, 0.25) and (0.1, 0.4) / 0.5 = (0.2, 0.8);
  // P_0 = (0.75 + 0.2) / 2 = 0.475; loss = 2 · 1 · 0.475 = 0.95.
  const std::vector<float> sg = {0.6f, 0.2f, 0.1f, 0.4f};
  const I32 c2 = {0, 0};
  const RouterShape sig{2, 2, 1, RouterScore::kSigmoid, true, 1.0f};
  EXPECT_NEAR(moe_aux_loss(kCpu, nullptr, sg.data(), c2.data(), 1, 2, sig, 1.0f), 0.95, 1e-6);
}

TEST(kernels_moe_balance, AuxLossGradientMatchesFiniteDifferences) {
  const int B = 2, T = 5, E = 6, K = 2, N = B * T;
  const float weight = 0.3f;
  for (RouterScore score : {RouterScore::kSoftmax, RouterScore::kSigmoid}) {
    SCOPED_TRACE(score_name(score));
    const RouterShape r{N, E, K, score, true, 1.0f};
    std::vector<float> scores(N * E), gates(N * K), dscores(N * E, 99.0f);
    I32 chosen(N * K);
    moe_route_forward(kCpu, scores.data(), chosen.data(), gates.data(),
                      ref::random_floats(N * E, 190, -2, 2).data(), nullptr, r);
    const bool sigmoid = score == RouterScore::kSigmoid;
    const double loss =
        moe_aux_loss(kCpu, dscores.data(), scores.data(), chosen.data(), B, T, r, weight);
    const Vec sd = ref::to_double(scores);
    EXPECT_NEAR(loss, aux_ref(sd, chosen, B, T, E, K, sigmoid), 1e-6);
    const auto f = [&](const Vec& v) { return Vec{aux_ref(v, chosen, B, T, E, K, sigmoid)}; };
    ref::expect_close(dscores, ref::numeric_grad(f, sd, Vec{weight}), 1e-4, 1e-6, "dscores");
    // The value does not depend on whether the gradient is asked for; it is a host wait.
    const std::int64_t waits = host_waits();
    EXPECT_EQ(moe_aux_loss(kCpu, nullptr, scores.data(), chosen.data(), B, T, r, weight), loss);
    EXPECT_EQ(host_waits(), waits + 1);
    // The gradient alone: the same bits, and no wait.
    std::vector<float> alone(N * E, 99.0f);
    moe_aux_loss_backward(kCpu, alone.data(), scores.data(), chosen.data(), B, T, r, weight);
    EXPECT_EQ(host_waits(), waits + 1);
    EXPECT_EQ(alone, dscores);
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
      moe_route_forward(kCpu, o.scores.data(), o.chosen.data(), o.gates.data(), logits.data(),
                        nullptr, r);
      moe_route_backward(kCpu, o.dlogits.data(), dg.data(), nullptr, o.scores.data(),
                         o.chosen.data(), r);
      const Perm p = permute(o.chosen, N, E, K);
      moe_gather(kCpu, o.rows.data(), x.data(), p.slot_of_row.data(), N * K, K, C);
      moe_combine(kCpu, o.y.data(), o.rows.data(), o.gates.data(), p.row_of_slot.data(), N, K, C,
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
