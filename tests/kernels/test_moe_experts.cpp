// The routed experts' grouped pass (kernels/ops_moe.h moe_experts_*): the routed layer (gather,
// experts, combine) against a per-token reference and its central differences, the padded row
// ranges, tp slices, the zero-bubble split and the fused bf16 SwiGLU, bit for bit where stated.
#include <gtest/gtest.h>

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <limits>
#include <vector>

#include "kernels/blas.h"
#include "kernels/check.h"
#include "kernels/ops_moe.h"
#include "moe_reference.h"
#include "reference.h"

namespace t3d::kernels {
namespace {

using moe_test::I32;
using moe_test::kept_ref;
using moe_test::layer_ref;
using moe_test::Perm;
using moe_test::permute;
using moe_test::two_parts;
using moe_test::Weights;
using ref::kFp32;
using ref::Vec;
using ref::with_threads;

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
  moe_gather(kCpu, xs.data(), x.data(), p.slot_of_row.data(), rows, K, C);
  moe_experts_forward(kFp32, ys.data(), {gate.data(), up.data(), h.data()}, xs.data(),
                      {wg.data(), wu.data(), wd.data()}, p.offsets.data(), es);
  moe_combine(kCpu, out.data(), ys.data(), gates.data(), p.row_of_slot.data(), N, K, C,
              Out::kWrite);
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
  moe_gather(kCpu, dys.data(), dy.data(), p.slot_of_row.data(), rows, K, C);
  moe_experts_backward(kFp32, dxs.data(), {gates.data(), dgates.data(), p.slot_of_row.data()},
                       {dwg.data(), dwu.data(), dwd.data()}, {dh.data(), dgate.data(), dup.data()},
                       dys.data(), xs.data(), {gate.data(), up.data(), h.data()},
                       {wg.data(), wu.data(), wd.data()}, p.offsets.data(), es);
  moe_combine(kCpu, dx.data(), dxs.data(), nullptr, p.row_of_slot.data(), N, K, C, Out::kWrite);

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

}  // namespace
}  // namespace t3d::kernels
