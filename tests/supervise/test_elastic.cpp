// Elastic shrink's layout arithmetic (runtime/supervise/elastic.h): the layout a job continues with
// on fewer hosts keeps global_batch and the rows of every micro-batch; a mixture of experts'
// shrink is priced by the cost model's planned_rank_bytes, as titan3d's supervisor prices it.
#include <fmt/format.h>
#include <gtest/gtest.h>

#include <string>

#include "runtime/cost/planner.h"
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

// A mixture of experts whose routed experts are most of a rank's memory (about 0.4 GiB of
// weights, gradients and moments per MoE block on one rank), one pipeline stage.
Recipe moe(int64_t dp, int64_t ep, int64_t global, int64_t zero = 0) {
  return parse_recipe(
      "[model]\ndim = 256\nn_layers = 2\nn_heads = 4\nseq_len = 32\nn_experts = 8\n"
      "moe_ffn_dim = 4096\n[hardware]\nhbm_gib = 4\n",
      "moe.toml",
      {{"parallel.dp", std::to_string(dp)},
       {"parallel.ep", std::to_string(ep)},
       {"parallel.zero", std::to_string(zero)},
       {"train.global_batch", std::to_string(global)}});
}

double rank_gib(const Recipe& r) { return planned_rank_bytes(r).value() / kGiB; }

// `r` as plan_shrink would leave it at dp (and ep).
Recipe at(const Recipe& r, int64_t dp, int64_t ep) {
  Shrink s;
  s.dp = dp, s.ep = ep, s.micro_batches = r.train.micro_batches * (r.parallel.dp / dp);
  return shrunk_recipe(r, s);
}

bool has(const std::string& text, const std::string& part) {
  return text.find(part) != std::string::npos;
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

// A mixture of experts' shrink that fits: ep folds (4 -> 2), each rank holds twice the experts,
// and the priced layout is still within hardware.hbm_gib.
TEST(Elastic, MoeShrinkThatFitsFoldsEp) {
  const Recipe r = moe(4, 4, 8);
  const Shrink s = plan_shrink(r, 2, planned_rank_bytes);
  ASSERT_TRUE(s.why_not.empty()) << s.why_not;
  EXPECT_EQ(s.dp, 2);
  EXPECT_EQ(s.ep, 2);
  EXPECT_TRUE(s.note.empty()) << s.note;
  EXPECT_GT(rank_gib(shrunk_recipe(r, s)), rank_gib(r) + 0.1) << "twice the experts per rank";
  EXPECT_LT(rank_gib(shrunk_recipe(r, s)), r.hardware.hbm_gib);
}

// The folded experts do not fit: no layout, and why_not names ep, the experts per rank, the GiB
// and the key, with what to do.
TEST(Elastic, MoeShrinkWhoseExpertsDoNotFitSaysWhy) {
  Recipe r = moe(2, 2, 8);
  const double before = rank_gib(r), after = rank_gib(at(r, 1, 1));
  ASSERT_GT(after, before + 0.1);
  r.hardware.hbm_gib = (before + after) / 2;
  EXPECT_EQ(plan_shrink(r, 1).dp, 1) << "unpriced, the shrink would be taken";
  const Shrink s = plan_shrink(r, 1, planned_rank_bytes);
  EXPECT_EQ(s.dp, 0);
  const std::string& w = s.why_not;
  EXPECT_TRUE(has(w,
                  "ep would fall from 2 to 1, each rank holding 8 of the 8 routed experts of "
                  "every MoE block (4 now)"))
      << w;
  EXPECT_TRUE(
      has(w, "pp1 dp1 tp1 (1 rank, 2 micro-batches per replica) needs about " +
                 fmt::format("{:.3g} GiB per rank ({:.3g} in the present layout", after, before)))
      << w;
  EXPECT_TRUE(has(w, fmt::format("against hardware.hbm_gib = {:g}", r.hardware.hbm_gib))) << w;
  EXPECT_TRUE(has(w, "it is the only smaller layout")) << w;
  EXPECT_TRUE(has(w, "Raise hardware.hbm_gib to at least ")) << w;
  const double least = std::stod(w.substr(w.find("at least ") + 9));
  EXPECT_GE(least, after) << "enough for the shrunk layout";
  EXPECT_LT(least, after * 1.01) << "rounded up to 3 digits";
  EXPECT_TRUE(has(w, "bring back the lost hosts")) << w;
}

// The experts per rank stay (ep kept), but with ZeRO-1 each rank's shard of the optimizer state
// doubles as dp halves: the part beside the experts' own no longer fits, also a why_not.
TEST(Elastic, MoeShrinkWhoseOtherStateDoesNotFitSaysWhy) {
  Recipe r = moe(4, 2, 8, /*zero=*/1);
  const double before = rank_gib(r), after = rank_gib(at(r, 2, 2));
  ASSERT_GT(after, before);
  r.hardware.hbm_gib = (before + after) / 2;
  const Shrink s = plan_shrink(r, 2, planned_rank_bytes);
  EXPECT_EQ(s.dp, 0);
  EXPECT_TRUE(has(s.why_not, "ep stays 2 (each rank keeps its 4 of the 8 routed experts"))
      << s.why_not;
  EXPECT_TRUE(has(s.why_not, "dp would fall from 4 to 2")) << s.why_not;
  EXPECT_TRUE(has(s.why_not, "no smaller dp fits either (1 tried)")) << s.why_not;
}

// Memory is not monotone in dp: from dp 12 ep 4 on 6 ranks, dp 6 keeps only ep 2 (4 experts per
// rank) where dp 4 keeps ep 4 (2 per rank). When dp 6 does not fit, dp 4 is taken, and the log
// line's note says why dp 6 was passed over.
TEST(Elastic, TakesASmallerDpThatHoldsFewerExperts) {
  Recipe r = moe(12, 4, 12);
  const double six = rank_gib(at(r, 6, 2)), four = rank_gib(at(r, 4, 4));
  ASSERT_GT(six, four + 0.1);
  ASSERT_LE(rank_gib(r), four);
  r.hardware.hbm_gib = (six + four) / 2;
  EXPECT_EQ(plan_shrink(r, 6).dp, 6) << "unpriced, the largest dp";
  const Shrink s = plan_shrink(r, 6, planned_rank_bytes);
  ASSERT_TRUE(s.why_not.empty()) << s.why_not;
  EXPECT_EQ(s.dp, 4);
  EXPECT_EQ(s.ep, 4);
  EXPECT_EQ(s.micro_batches, 3);
  EXPECT_TRUE(has(s.note, "dp 6 passed over: ep would fall from 4 to 2")) << s.note;
}

// A dense shrink is not priced: the same layout as before, even where the estimate is far above
// hardware.hbm_gib.
// A dense model's shrink is priced too: ZeRO-3 on dp 4 keeps a quarter of the state per rank,
// dp 2 a half. With hardware.hbm_gib between the two, no shrink fits and the job says why.
TEST(Elastic, DenseShrinkWhoseShardsDoNotFitSaysWhy) {
  Recipe r =
      parse_recipe("[model]\ndim = 1024\nn_layers = 8\nn_heads = 8\nseq_len = 32\n", "dense.toml",
                   {{"parallel.dp", "4"}, {"parallel.zero", "3"}, {"train.global_batch", "8"}});
  const double before = rank_gib(r), after = rank_gib(at(r, 2, 1));
  ASSERT_GT(after, before * 1.2);
  r.hardware.hbm_gib = (before + after) / 2;
  const Shrink s = plan_shrink(r, 2, planned_rank_bytes);
  EXPECT_EQ(s.dp, 0);
  EXPECT_TRUE(has(s.why_not, "dp would fall from 4 to 2, and ZeRO's shards")) << s.why_not;
  EXPECT_FALSE(has(s.why_not, "expert")) << s.why_not;
  EXPECT_TRUE(has(s.why_not, "Raise hardware.hbm_gib to at least")) << s.why_not;
  r.hardware.hbm_gib = after * 1.01;
  EXPECT_EQ(plan_shrink(r, 2, planned_rank_bytes).dp, 2) << "with room it shrinks";
}

// A dense recipe the estimate already puts above hardware.hbm_gib shrinks unpriced, as before.
TEST(Elastic, DenseShrinkUnchanged) {
  Recipe r = layout(2, 2, 2, 2, 8);
  r.hardware.hbm_gib = 1e-4;
  ASSERT_GT(rank_gib(at(r, 1, 1)), r.hardware.hbm_gib);
  const Shrink s = plan_shrink(r, 4, planned_rank_bytes);
  ASSERT_TRUE(s.why_not.empty()) << s.why_not;
  EXPECT_EQ(s.dp, 1);
  EXPECT_EQ(s.micro_batches, 4);
  EXPECT_EQ(s.ep, 1);
  EXPECT_TRUE(s.note.empty()) << s.note;
}

// Where the estimate already puts the present layout above hardware.hbm_gib it overprices
// the recipe and decides nothing; with cp > 1 there is no estimate (the cost model has no cp).
TEST(Elastic, UnpricedWhereTheEstimateCannotTell) {
  Recipe r = moe(2, 2, 8);
  r.hardware.hbm_gib = rank_gib(r) / 2;
  EXPECT_EQ(plan_shrink(r, 1, planned_rank_bytes).dp, 1);
  Recipe cp = moe(2, 2, 8);
  cp.parallel.cp = 2;
  EXPECT_FALSE(planned_rank_bytes(cp).has_value());
  cp.hardware.hbm_gib = 1e-4;
  EXPECT_EQ(plan_shrink(cp, 2, planned_rank_bytes).dp, 1);
}
