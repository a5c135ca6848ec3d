// The GEMM algorithm table (kernels/cuda/gemm_table.h): its text form and the margin rule run
// everywhere (host code); installing, measuring and the bits it promises need a GPU.
#include <gtest/gtest.h>

#include <algorithm>
#include <string>
#include <vector>

#include "kernels/cuda/cuda_ops.h"
#include "kernels/cuda/gemm_table.h"
#include "tests/kernels/gpu_compare.h"
#include "tests/kernels/reference.h"
#include "tests/kernels/the_gpu.h"

namespace t3d::kernels::cuda {
namespace {

using testing::Dev;
using testing::expect_same_bits;
using testing::S;

GemmTable two_shapes() {
  GemmTable t;
  t.library = "cuBLASLt 130100 on NVIDIA H200 (sm_90)";
  t.source = "measured";
  t.algorithms[GemmShape{4096, 2048, 2048, 2048, 2048, 2048, false, true, false,
                         GemmPrecision::kBf16, 64}] =
      GemmAlgorithm{{1, 2, 3, 0xffffffffffffffffull, 0, 7, 8, 0x0123456789abcdefull}};
  t.algorithms[GemmShape{2048, 2048, 4096, 2048, 2048, 2048, true, false, true,
                         GemmPrecision::kFp32, 16}] = GemmAlgorithm{{9, 9, 9, 9, 9, 9, 9, 9}};
  return t;
}

TEST(GemmTable, TextRoundTrips) {  // host code: runs everywhere
  const GemmTable t = two_shapes();
  const std::string text = gemm_table_text(t);
  std::string why;
  const auto back = parse_gemm_table(text, &why);
  ASSERT_TRUE(back) << why;
  EXPECT_EQ(back->library, t.library);
  EXPECT_EQ(back->source, "measured");
  ASSERT_EQ(back->algorithms.size(), 2u);
  for (const auto& [shape, algorithm] : t.algorithms) {
    const auto found = back->algorithms.find(shape);
    ASSERT_NE(found, back->algorithms.end());
    EXPECT_EQ(found->second, algorithm);
  }
  EXPECT_EQ(gemm_table_text(*back), text);
  // Empty tables too: a GPU's table before any GEMM ran.
  GemmTable empty;
  empty.library = "cuBLASLt 1 on X (sm_80)";
  const auto e = parse_gemm_table(gemm_table_text(empty), &why);
  ASSERT_TRUE(e) << why;
  EXPECT_TRUE(e->algorithms.empty());
  EXPECT_EQ(e->library, empty.library);
}

TEST(GemmTable, MalformedTextIsRefusedNamingTheLine) {  // host code: runs everywhere
  const std::string good = gemm_table_text(two_shapes());
  std::string why;
  EXPECT_FALSE(parse_gemm_table("hello\n", &why));
  EXPECT_NE(why.find("line 1"), std::string::npos) << why;
  // The bf16 shape's line is line 5 (shapes are listed in order: M 2048 before 4096). A word too
  // few, a bad precision, a bad alignment, a short hex word.
  const std::vector<std::pair<std::string, std::string>> swaps = {
      {" 64 ", " "}, {"bf16", "fp16"}, {" 64 ", " 48 "}, {"0123456789abcdef", "0123"}};
  for (const auto& [from, to] : swaps) {
    std::string bad = good;
    bad.replace(bad.find(from), from.size(), to);
    EXPECT_FALSE(parse_gemm_table(bad, &why)) << from << " -> " << to;
    EXPECT_NE(why.find("line 5"), std::string::npos) << why;
  }
  // The same shape twice.
  const std::size_t start = good.find("\n4096 2048") + 1;
  const std::string line = good.substr(start, good.find('\n', start) + 1 - start);
  EXPECT_FALSE(parse_gemm_table(good + line, &why));
  EXPECT_NE(why.find("twice"), std::string::npos) << why;
}

TEST(GemmTable, AlignmentIsTheLargestPowerOfTwoUpToTheCap) {  // host code: runs everywhere
  alignas(256) static char block[1024];
  EXPECT_EQ(gemm_alignment(block, block + 256, block + 512), kGemmAlignCap);
  EXPECT_EQ(gemm_alignment(block, block + 32, block + 512), 32u);
  EXPECT_EQ(gemm_alignment(block + 4, block, block), 4u);
  EXPECT_EQ(gemm_alignment(block, block, block + 2), 2u);
}

TEST(GemmTable, OnlyAClearGainReplacesTheHeuristicsFirstAnswer) {  // host code
  // Rounds overlapping within the margin keep the incumbent: measuring again picks the same.
  EXPECT_FALSE(beats_clearly({0.90, 1.00}, {1.00, 1.10}));
  EXPECT_FALSE(beats_clearly({0.96, 0.97}, {1.00, 1.01}));
  EXPECT_TRUE(beats_clearly({0.80, 0.90}, {1.00, 1.10}));
}

TEST(GemmTable, RowBucketsRoundUpByAtMostAQuarter) {  // host code
  EXPECT_EQ(gemm_row_bucket(1), kGemmRowBucketMin);
  EXPECT_EQ(gemm_row_bucket(64), 64);
  EXPECT_EQ(gemm_row_bucket(65), 80);
  EXPECT_EQ(gemm_row_bucket(128), 128);
  EXPECT_EQ(gemm_row_bucket(129), 160);
  EXPECT_EQ(gemm_row_bucket(1000), 1024);
  EXPECT_EQ(gemm_row_bucket(1025), 1280);
  for (std::int64_t rows = 1; rows < 5000; ++rows) {
    const std::int64_t b = gemm_row_bucket(rows);
    ASSERT_GE(b, rows);
    ASSERT_EQ(gemm_row_bucket(b), b) << rows;  // a bucket is its own bucket
    if (rows > kGemmRowBucketMin) {
      ASSERT_LE(b * 4, rows * 5) << rows;
    }
  }
}

// Each linear GEMM's bucket shape rounds up its batch rows, and only them: the weights' extents
// and the leading dimensions stay, and every operand still fits its leading dimension (a layout
// cuBLASLt accepts).
TEST(GemmTable, ABucketShapeRoundsOnlyTheBatchRows) {  // host code
  const std::int64_t in = 384, out = 200;
  for (const std::int64_t rows : {1, 37, 64, 100, 777, 4096})
    for (const auto p : {GemmPrecision::kFp32, GemmPrecision::kBf16}) {
      const auto shapes = linear_gemm_shapes(p, rows, in, out, 16);
      for (std::size_t i = 0; i < shapes.size(); ++i) {
        const GemmShape& s = shapes[i];
        const GemmShape b = gemm_bucket_shape(s);
        GemmShape expected = s;
        (i == 2 ? expected.K : expected.M) = gemm_row_bucket(rows);  // dw: K; the others: M
        EXPECT_EQ(b, expected) << "GEMM " << i << ", " << rows << " rows";
        EXPECT_GE(b.lda, b.trans_a ? b.M : b.K);
        EXPECT_GE(b.ldb, b.trans_b ? b.K : b.N);
        EXPECT_GE(b.ldc, b.N);
      }
    }
}

// ---- on a GPU
// ------------------------------------------------------------------------------------

// A linear layer's four GEMMs on stream `s` into fresh outputs (the operands copied in on the
// test binary's stream first): forward, input and weight gradients, the forward with a residual.
std::vector<std::vector<float>> run_layer(GemmPrecision p, int N, int in, int out,
                                          const Stream& s = S()) {
  const auto x = ref::random_floats(static_cast<std::size_t>(N) * in, 31);
  const auto w = ref::random_floats(static_cast<std::size_t>(out) * in, 32);
  const auto dy = ref::random_floats(static_cast<std::size_t>(N) * out, 33);
  Dev<float> gx(x), gw(w), gdy(dy), gy(static_cast<std::size_t>(N) * out), gdx(x.size()),
      gdw(w.size()), gyr(static_cast<std::size_t>(N) * out);
  S().synchronize();
  linear_forward(s, p, gy.p(), gx.p(), gw.p(), N, in, out);
  linear_backward_input(s, p, gdx.p(), gdy.p(), gw.p(), N, in, out);
  linear_backward_weight(s, p, gdw.p(), gdy.p(), gx.p(), N, in, out);
  linear_forward(s, p, gyr.p(), gx.p(), gw.p(), N, in, out, Out::kWrite, nullptr, nullptr, gdy.p());
  s.synchronize();
  return {gy.host(), gdx.host(), gdw.host(), gyr.host()};
}

TEST(GemmTable, TheLayersShapesAreTheOnesItsGemmsRun) {
  REQUIRE_GPU();
  const int N = 256, in = 384, out = 128;
  for (const auto p : {GemmPrecision::kFp32, GemmPrecision::kBf16}) {
    const std::vector<GemmShape> before = gemm_shapes_planned(S());
    run_layer(p, N, in, out);
    const std::vector<GemmShape> after = gemm_shapes_planned(S());
    for (const GemmShape& s : linear_gemm_shapes(p, N, in, out))
      EXPECT_EQ(std::count(after.begin(), after.end(), s), 1)
          << "a shape linear_gemm_shapes lists that the GEMMs did not run: " << s.M << "x" << s.N
          << "x" << s.K << " (tuning it would be wasted)";
    EXPECT_EQ(after.size(), before.size() + 4);
  }
}

TEST(GemmTable, AMeasuredTableGivesTheSameBitsOnAnotherStream) {
  REQUIRE_GPU();
  const int N = 512, in = 256, out = 384;
  for (const auto p : {GemmPrecision::kFp32, GemmPrecision::kBf16}) {
    const auto shapes = linear_gemm_shapes(p, N, in, out);
    const GemmTable measured =
        tune_gemms(S(), std::vector<GemmShape>(shapes.begin(), shapes.end()), 8, 3);
    EXPECT_EQ(measured.source, "measured");
    const auto first = run_layer(p, N, in, out);
    const auto again = run_layer(p, N, in, out);
    for (std::size_t i = 0; i < first.size(); ++i)
      expect_same_bits(first[i], again[i], "the same stream twice");
    // A second stream given the text of the table (a resumed run) runs the same algorithms.
    std::string why;
    const auto parsed = parse_gemm_table(gemm_table_text(measured), &why);
    ASSERT_TRUE(parsed) << why;
    Stream other(0);
    EXPECT_EQ(use_gemm_table(other, *parsed), "");
    EXPECT_EQ(gemm_table(other).algorithms, parsed->algorithms);
    const auto there = run_layer(p, N, in, out, other);
    for (std::size_t i = 0; i < first.size(); ++i)
      expect_same_bits(first[i], there[i], "another stream, the table");
  }
}

// A shape outside the table (an expert's rows) runs its row bucket's algorithm: the same bits
// on a fresh stream as after other row counts of its bucket planned theirs first.
TEST(GemmTable, AnUntabledShapesBitsDoNotDependOnWhatRanBefore) {
  REQUIRE_GPU();
  const int in = 256, out = 384;
  for (const auto p : {GemmPrecision::kFp32, GemmPrecision::kBf16}) {
    Stream fresh(0), used(0);
    const auto alone = run_layer(p, 70, in, out, fresh);
    run_layer(p, 80, in, out, used);
    run_layer(p, 66, in, out, used);
    const auto after = run_layer(p, 70, in, out, used);
    for (std::size_t i = 0; i < alone.size(); ++i)
      expect_same_bits(alone[i], after[i], "after rows 80 and 66");
  }
}

TEST(GemmTable, ATableOfAnotherLibraryIsRefused) {
  REQUIRE_GPU();
  GemmTable foreign = two_shapes();
  foreign.library = "cuBLASLt 1 on another GPU (sm_70)";
  const GemmTable before = gemm_table(S());
  EXPECT_NE(use_gemm_table(S(), foreign), "");
  EXPECT_EQ(gemm_table(S()).algorithms, before.algorithms);  // kept its own
  EXPECT_NE(gemm_library(S()).find("cuBLASLt"), std::string::npos);
}

}  // namespace
}  // namespace t3d::kernels::cuda
