// Which GEMM kinds a recipe's train.precision and hardware.gemm let the measurement choose from,
// and what a resolved pair means (runtime/machine/gemm_choice.h).
#include <gtest/gtest.h>

#include <vector>

#include "kernels/check.h"
#include "runtime/machine/gemm_choice.h"

namespace t3d::runtime {
namespace {

using kernels::GemmKind;
using P = TrainPrecision;
using L = GemmLibrary;

TEST(GemmChoice, CandidatesFollowPrecisionAndLibrary) {
  const std::vector<GemmKind> all = {GemmKind::kOpenBlasF32, GemmKind::kOneDnnF32,
                                     GemmKind::kOneDnnBf16};
  EXPECT_EQ(gemm_candidates(P::kAuto, L::kAuto), all);
  EXPECT_EQ(gemm_candidates(P::kBf16, L::kAuto), all);  // bf16 storage may still run fp32 GEMMs
  EXPECT_EQ(gemm_candidates(P::kFp32, L::kAuto),
            (std::vector<GemmKind>{GemmKind::kOpenBlasF32, GemmKind::kOneDnnF32}));
  EXPECT_EQ(gemm_candidates(P::kFp32, L::kOneDnn), std::vector<GemmKind>{GemmKind::kOneDnnF32});
  EXPECT_EQ(gemm_candidates(P::kBf16, L::kOneDnn), std::vector<GemmKind>{GemmKind::kOneDnnBf16});
  EXPECT_EQ(gemm_candidates(P::kAuto, L::kOneDnn),
            (std::vector<GemmKind>{GemmKind::kOneDnnF32, GemmKind::kOneDnnBf16}));
  for (const P precision : {P::kFp32, P::kBf16, P::kAuto})  // OpenBLAS has fp32 GEMMs only
    EXPECT_EQ(gemm_candidates(precision, L::kOpenBlas),
              std::vector<GemmKind>{GemmKind::kOpenBlasF32});
}

TEST(GemmChoice, ResolvedPairsNameOneKind) {
  EXPECT_EQ(gemm_kind_of(P::kFp32, L::kOpenBlas), GemmKind::kOpenBlasF32);
  EXPECT_EQ(gemm_kind_of(P::kBf16, L::kOpenBlas), GemmKind::kOpenBlasF32);
  EXPECT_EQ(gemm_kind_of(P::kFp32, L::kOneDnn), GemmKind::kOneDnnF32);
  EXPECT_EQ(gemm_kind_of(P::kBf16, L::kOneDnn), GemmKind::kOneDnnBf16);
  EXPECT_THROW(gemm_kind_of(P::kAuto, L::kOneDnn),
               InternalError);  // a caller's bug, not the user's
  EXPECT_THROW(gemm_kind_of(P::kBf16, L::kAuto), InternalError);
}

TEST(GemmChoice, UnresolvedRecipeAppliesExactFp32) {
  Recipe r;
  r.train.precision = P::kAuto;
  r.hardware.gemm = L::kAuto;
  EXPECT_EQ(recorded_precision(r).gemm, GemmKind::kOpenBlasF32);
  EXPECT_EQ(recorded_precision(r).train, P::kFp32);
  r.train.precision = P::kBf16;
  r.hardware.gemm = L::kOneDnn;
  EXPECT_EQ(recorded_precision(r).gemm, GemmKind::kOneDnnBf16);
  EXPECT_EQ(recorded_precision(r).train, P::kBf16);
}

// Rates measured on AMD EPYC Zen 3 (fp32 OpenBLAS and oneDNN within noise of each other at a
// small model's shapes): overlapping rounds keep the earlier candidate whatever the fastest
// rounds say, so a re-measurement cannot flip the choice; a clear speed-up still wins.
TEST(GemmChoice, OverlappingRatesKeepThePreferredKind) {
  using M = MeasuredGemm;
  EXPECT_EQ(preferred_gemm({M{GemmKind::kOpenBlasF32, 85, 73}, M{GemmKind::kOneDnnF32, 98, 81}}),
            0u);
  EXPECT_EQ(preferred_gemm({M{GemmKind::kOpenBlasF32, 80, 79}, M{GemmKind::kOneDnnF32, 83, 82}}),
            0u);
  EXPECT_EQ(preferred_gemm({M{GemmKind::kOpenBlasF32, 80, 70}, M{GemmKind::kOneDnnF32, 98, 90}}),
            1u);
  // bf16 at twice the fp32 rate wins over both fp32 kinds, measured in any round.
  EXPECT_EQ(preferred_gemm({M{GemmKind::kOpenBlasF32, 100, 90}, M{GemmKind::kOneDnnF32, 104, 95},
                            M{GemmKind::kOneDnnBf16, 210, 180}}),
            2u);
  // A kind that could not run (rate 0) never wins.
  EXPECT_EQ(preferred_gemm({M{GemmKind::kOpenBlasF32, 50, 40}, M{GemmKind::kOneDnnBf16, 0, 0}}),
            0u);
  EXPECT_EQ(preferred_gemm({M{GemmKind::kOneDnnF32, 50, 40}}), 0u);
}

// Load from elsewhere while measuring: on a busy 2-core machine oneDNN fp32 measured 0.5 GFLOP/s
// in every round (195 idle), and the choice flipped to OpenBLAS, and with it a fresh run's last
// bits. A disturbed measurement keeps the choice the rates cached for this CPU make, or without
// them the first candidate that runs; an undisturbed one decides as preferred_gemm.
TEST(GemmChoice, ADisturbedMeasurementKeepsTheCachedChoice) {
  using M = MeasuredGemm;
  const GemmKind blas = GemmKind::kOpenBlasF32, dnn = GemmKind::kOneDnnF32;
  const std::vector<M> idle = {M{blas, 150, 140}, M{dnn, 195, 185}};  // cached: oneDNN wins
  // Far below the cached rate in every round: the cached choice, not the flip.
  const std::vector<M> busy = {M{blas, 100, 95}, M{dnn, 0.5, 0.5}};
  ASSERT_EQ(preferred_gemm(busy), 0u);
  GemmDecision d = decide_gemm(busy, idle);
  EXPECT_EQ(d.winner, 1u);
  EXPECT_NE(d.interference.find("onednn-fp32 reached 0.5 GFLOP/s per rank, 195.0 cached"),
            std::string::npos)
      << d.interference;
  // Rounds that disagree widely: the cached choice (OpenBLAS, the rates overlapping) again.
  const std::vector<M> close = {M{blas, 100, 95}, M{dnn, 98, 92}};
  const std::vector<M> spread = {M{blas, 100, 30}, M{dnn, 120, 115}};
  ASSERT_EQ(preferred_gemm(spread), 1u);
  d = decide_gemm(spread, close);
  EXPECT_EQ(d.winner, 0u);
  EXPECT_NE(d.interference.find("openblas-fp32's rounds ranged from 30.0 to 100.0"),
            std::string::npos)
      << d.interference;
  // Nothing cached to compare with (or figures of other candidates): the first candidate that
  // runs here.
  EXPECT_EQ(decide_gemm({M{blas, 100, 20}, M{dnn, 150, 140}}, {}).winner, 0u);
  EXPECT_EQ(decide_gemm({M{blas, 100, 20}, M{dnn, 150, 140}}, {M{dnn, 1, 1}, M{blas, 1, 1}}).winner,
            0u);
  EXPECT_EQ(decide_gemm({M{dnn, 0, 0}, M{GemmKind::kOneDnnBf16, 100, 20}}, {}).winner, 1u);
  // Undisturbed: slower than the cached figures (other shapes) but within kGemmCachedDrop, rounds
  // that agree: the measurement decides, said by no interference.
  d = decide_gemm({M{blas, 80, 75}, M{dnn, 100, 92}}, idle);
  EXPECT_EQ(d.winner, 1u);
  EXPECT_EQ(d.interference, "");
  d = decide_gemm({M{blas, 80, 75}, M{dnn, 82, 78}}, {});
  EXPECT_EQ(d.winner, 0u);
  EXPECT_EQ(d.interference, "");
  // A kind that cannot run here (rate 0) is no sign of load.
  EXPECT_EQ(decide_gemm({M{blas, 80, 75}, M{GemmKind::kOneDnnBf16, 0, 0}}, {}).interference, "");
}

}  // namespace
}  // namespace t3d::runtime
