// Which GEMM kinds a recipe's train.precision and hardware.gemm let the measurement choose from,
// and what a resolved pair means (runtime/stage/gemm_choice.h).
#include <gtest/gtest.h>

#include <vector>

#include "kernels/check.h"
#include "runtime/stage/gemm_choice.h"

namespace t3d::runtime {
namespace {

using kernels::GemmKind;

TEST(GemmChoice, CandidatesFollowPrecisionAndLibrary) {
  const std::vector<GemmKind> all = {GemmKind::kOpenBlasF32, GemmKind::kOneDnnF32,
                                     GemmKind::kOneDnnBf16};
  EXPECT_EQ(gemm_candidates("auto", "auto"), all);
  EXPECT_EQ(gemm_candidates("bf16", "auto"), all);  // bf16 storage may still run fp32 GEMMs
  EXPECT_EQ(gemm_candidates("fp32", "auto"),
            (std::vector<GemmKind>{GemmKind::kOpenBlasF32, GemmKind::kOneDnnF32}));
  EXPECT_EQ(gemm_candidates("fp32", "onednn"), std::vector<GemmKind>{GemmKind::kOneDnnF32});
  EXPECT_EQ(gemm_candidates("bf16", "onednn"), std::vector<GemmKind>{GemmKind::kOneDnnBf16});
  EXPECT_EQ(gemm_candidates("auto", "onednn"),
            (std::vector<GemmKind>{GemmKind::kOneDnnF32, GemmKind::kOneDnnBf16}));
  for (const char* precision : {"fp32", "bf16", "auto"})  // OpenBLAS has fp32 GEMMs only
    EXPECT_EQ(gemm_candidates(precision, "openblas"), std::vector<GemmKind>{GemmKind::kOpenBlasF32});
}

TEST(GemmChoice, ResolvedPairsNameOneKind) {
  EXPECT_EQ(gemm_kind_of("fp32", "openblas"), GemmKind::kOpenBlasF32);
  EXPECT_EQ(gemm_kind_of("bf16", "openblas"), GemmKind::kOpenBlasF32);
  EXPECT_EQ(gemm_kind_of("fp32", "onednn"), GemmKind::kOneDnnF32);
  EXPECT_EQ(gemm_kind_of("bf16", "onednn"), GemmKind::kOneDnnBf16);
  EXPECT_THROW(gemm_kind_of("auto", "onednn"), InternalError);  // a caller's bug, not the user's
  EXPECT_THROW(gemm_kind_of("bf16", "auto"), InternalError);
}

TEST(GemmChoice, UnresolvedRecipeAppliesExactFp32) {
  Recipe r;
  r.train.precision = "auto";
  r.hardware.gemm = "auto";
  EXPECT_EQ(apply_recorded_gemm(r), GemmKind::kOpenBlasF32);
  EXPECT_EQ(kernels::linear_gemm(), GemmKind::kOpenBlasF32);
  r.train.precision = "bf16";
  r.hardware.gemm = "onednn";
  EXPECT_EQ(apply_recorded_gemm(r), GemmKind::kOneDnnBf16);
  EXPECT_EQ(kernels::linear_gemm(), GemmKind::kOneDnnBf16);
  kernels::set_linear_gemm(GemmKind::kOpenBlasF32);
}

}  // namespace
}  // namespace t3d::runtime
