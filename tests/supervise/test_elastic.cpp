// Elastic shrink's layout arithmetic (runtime/supervise/elastic.h): the layout a job continues with
// on fewer hosts keeps global_batch and the rows of every micro-batch.
#include <gtest/gtest.h>

#include "runtime/recipe/recipe.h"
#include "runtime/supervise/elastic.h"

using namespace t3d::runtime;

namespace {
Recipe layout(int64_t pp, int64_t dp, int64_t tp, int64_t micro, int64_t global) {
  return parse_recipe("", "r.toml",
                      {{"parallel.pp", std::to_string(pp)},
                       {"parallel.dp", std::to_string(dp)},
                       {"parallel.tp", std::to_string(tp)},
                       {"train.micro_batches", std::to_string(micro)},
                       {"train.global_batch", std::to_string(global)}});
}
}  // namespace

TEST(Elastic, ShrinksDpKeepingTheGlobalBatch) {
  // The two-host test: pp2 × dp2 × tp2 on 4 + 4 slots, host B lost.
  const Recipe r = layout(2, 2, 2, 2, 8);
  const Shrink s = plan_shrink(r, 4);
  ASSERT_TRUE(s.why_not.empty()) << s.why_not;
  EXPECT_EQ(s.dp, 1);
  EXPECT_EQ(s.micro_batches, 4);
  EXPECT_EQ(s.ranks, 4);
  // Rows per micro-batch, global_batch / (dp · micro_batches), as before.
  EXPECT_EQ(s.dp * s.micro_batches, r.parallel.dp * r.train.micro_batches);
}

TEST(Elastic, TakesTheLargestDivisorThatFits) {
  const Recipe r = layout(1, 8, 1, 1, 32);  // 8 replicas of one rank each
  EXPECT_EQ(plan_shrink(r, 7).dp, 4) << "dp must divide 8: 7 and 6 and 5 do not";
  EXPECT_EQ(plan_shrink(r, 7).micro_batches, 2);
  EXPECT_EQ(plan_shrink(r, 2).dp, 2);
  EXPECT_EQ(plan_shrink(r, 100).dp, 4) << "a shrink is smaller than the old dp";
}

// Expert parallelism folds into dp × cp: a shrink keeps ep where it still divides, else takes
// its largest divisor that does (the experts then spread over fewer ranks).
TEST(Elastic, FoldsExpertParallelismIntoTheSmallerDp) {
  Recipe r = parse_recipe(
      "[model]\nn_experts = 8\n[parallel]\ndp = 8\nep = 4\n"
      "[train]\nglobal_batch = 32\n",
      "r.toml");
  EXPECT_EQ(plan_shrink(r, 7).ep, 4);  // dp 4
  EXPECT_EQ(plan_shrink(r, 3).ep, 2);  // dp 2
  EXPECT_EQ(plan_shrink(r, 1).ep, 1);  // dp 1
  r.parallel.ep = 8;
  EXPECT_EQ(plan_shrink(r, 7).ep, 4);
  EXPECT_EQ(describe_layout(r), "pp1 dp8 tp1 ep8 (8 ranks, 1 micro-batch per replica)");
}

TEST(Elastic, SaysWhyItCannotShrink) {
  const Shrink one = plan_shrink(layout(2, 1, 2, 1, 8), 100);
  EXPECT_EQ(one.dp, 0);
  EXPECT_NE(one.why_not.find("dp = 1 has no smaller divisor"), std::string::npos) << one.why_not;
  const Shrink small = plan_shrink(layout(2, 2, 2, 1, 8), 3);
  EXPECT_EQ(small.dp, 0);
  EXPECT_NE(small.why_not.find("pp·cp·tp = 4 ranks"), std::string::npos) << small.why_not;
}

TEST(Elastic, CapacityFromSlotsOrTheHostsShare) {
  const std::vector<HostEntry> all = {{"a", 4, "a slots=4"}, {"b", 2, "b slots=2"}};
  EXPECT_EQ(remaining_capacity(all, {all[0]}, 6), 4);
  const std::vector<HostEntry> bare = {{"a", 0, "a"}, {"b", 0, "b"}, {"c", 0, "c"}};
  EXPECT_EQ(remaining_capacity(bare, {bare[0], bare[2]}, 6), 4);
}

TEST(Elastic, DescribesALayout) {
  EXPECT_EQ(describe_layout(layout(2, 2, 2, 2, 8)),
            "pp2 dp2 tp2 (8 ranks, 2 micro-batches per replica)");
}
