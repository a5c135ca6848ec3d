// Which GEMM kinds a recipe's train.precision and hardware.gemm let the measurement choose from,
// and what a resolved pair means (runtime/stage/gemm_choice.h).
#include <gtest/gtest.h>

#include <vector>

#include "kernels/check.h"
#include "runtime/stage/gemm_choice.h"

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
    EXPECT_EQ(gemm_candidates(precision, L::kOpenBlas), std::vector<GemmKind>{GemmKind::kOpenBlasF32});
}

TEST(GemmChoice, ResolvedPairsNameOneKind) {
  EXPECT_EQ(gemm_kind_of(P::kFp32, L::kOpenBlas), GemmKind::kOpenBlasF32);
  EXPECT_EQ(gemm_kind_of(P::kBf16, L::kOpenBlas), GemmKind::kOpenBlasF32);
  EXPECT_EQ(gemm_kind_of(P::kFp32, L::kOneDnn), GemmKind::kOneDnnF32);
  EXPECT_EQ(gemm_kind_of(P::kBf16, L::kOneDnn), GemmKind::kOneDnnBf16);
  EXPECT_THROW(gemm_kind_of(P::kAuto, L::kOneDnn), InternalError);  // a caller's bug, not the user's
  EXPECT_THROW(gemm_kind_of(P::kBf16, L::kAuto), InternalError);
}

TEST(GemmChoice, UnresolvedRecipeAppliesExactFp32) {
  Recipe r;
  r.train.precision = P::kAuto;
  r.hardware.gemm = L::kAuto;
  EXPECT_EQ(apply_recorded_gemm(r), GemmKind::kOpenBlasF32);
  EXPECT_EQ(kernels::linear_gemm(), GemmKind::kOpenBlasF32);
  r.train.precision = P::kBf16;
  r.hardware.gemm = L::kOneDnn;
  EXPECT_EQ(apply_recorded_gemm(r), GemmKind::kOneDnnBf16);
  EXPECT_EQ(kernels::linear_gemm(), GemmKind::kOneDnnBf16);
  kernels::set_linear_gemm(GemmKind::kOpenBlasF32);
}

}  // namespace
}  // namespace t3d::runtime
