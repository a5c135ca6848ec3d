// Generators and the validator: every table is valid, keeps its memory promise, and the
// validator catches broken tables. Suite names start with `schedule_` for `ctest -R schedule`.
#include <gtest/gtest.h>

#include <algorithm>
#include <tuple>
#include <vector>

#include "kernels/check.h"
#include "parallel/schedule.h"

namespace t3d::parallel {
namespace {

struct Shape {
  ScheduleKind kind;
  int pp, m, v;
};

// Many (pp, m, v) per generator, including m < pp and m = 1.
std::vector<Shape> all_shapes() {
  std::vector<Shape> out;
  for (int pp : {1, 2, 3, 4, 5, 8}) {
    for (int m : {1, 2, 3, 4, 5, 7, 8, 12, 16}) {
      for (ScheduleKind k : {ScheduleKind::kGPipe, ScheduleKind::k1F1B, ScheduleKind::kZBH1})
        out.push_back({k, pp, m, 1});
      for (int v : {1, 2, 3, 4})
        if (m % pp == 0) out.push_back({ScheduleKind::kInterleaved1F1B, pp, m, v});
    }
  }
  return out;
}

std::string name(const Shape& s) {
  return detail::concat(to_string(s.kind), " pp=", s.pp, " m=", s.m, " v=", s.v);
}

TEST(schedule_Generators, AllValid) {
  int checked = 0;
  for (const Shape& sh : all_shapes()) {
    const Schedule s = make_schedule(sh.kind, sh.pp, sh.m, sh.v);
    const auto problems = validate(s);
    EXPECT_TRUE(problems.empty()) << name(sh) << ": " << problems.front();
    ++checked;
  }
  EXPECT_GT(checked, 200);
}

TEST(schedule_Generators, InFlightWithinPromise) {
  for (const Shape& sh : all_shapes()) {
    const Schedule s = make_schedule(sh.kind, sh.pp, sh.m, sh.v);
    const auto peak = peak_in_flight(s);
    for (int st = 0; st < sh.pp; ++st)
      EXPECT_LE(peak[st], promised_in_flight(s, st)) << name(sh) << " stage " << st;
  }
}

TEST(schedule_Generators, InFlightExactForPlainSchedules) {
  for (int pp : {1, 2, 4, 6}) {
    for (int m : {1, 3, 4, 9}) {
      const auto gpipe = peak_in_flight(make_gpipe(pp, m));
      const auto one = peak_in_flight(make_1f1b(pp, m));
      for (int st = 0; st < pp; ++st) {
        EXPECT_EQ(gpipe[st], m);
        EXPECT_EQ(one[st], std::min(pp - st, m)) << "pp " << pp << " m " << m;
      }
      // ZB-H1 never needs more than 1F1B's worst rank.
      const auto zb = peak_in_flight(make_zb_h1(pp, m));
      EXPECT_EQ(*std::max_element(zb.begin(), zb.end()), *std::max_element(one.begin(), one.end()));
    }
  }
}

TEST(schedule_Generators, OneFOneBWarmupIsPpMinusStageMinusOne) {
  const Schedule s = make_1f1b(4, 8);
  for (int st = 0; st < 4; ++st) {
    const auto& r = s.ranks[st];
    const auto first_bw =
        std::find_if(r.begin(), r.end(), [](const Action& a) { return a.op == Op::kBW; });
    // warm-up forwards, then the first steady-state forward, then the first backward.
    EXPECT_EQ(first_bw - r.begin(), 4 - st - 1 + 1) << "stage " << st;
  }
}

TEST(schedule_Generators, InterleavedPlacementIsRoundRobin) {
  const Schedule s = make_interleaved_1f1b(3, 6, 2);
  ASSERT_EQ(s.num_chunks(), 6);
  for (int k = 0; k < 6; ++k) EXPECT_EQ(s.chunk_stage[k], k % 3);
  for (int st = 0; st < 3; ++st)
    for (const Action& a : s.ranks[st]) EXPECT_EQ(a.chunk % 3, st);
}

TEST(schedule_Generators, InterleavedRejectsIndivisibleMicroBatches) {
  try {
    make_interleaved_1f1b(4, 6, 2);
    FAIL();
  } catch (const UserError& e) {
    const std::string msg = e.what();
    EXPECT_NE(msg.find("micro_batches"), std::string::npos) << msg;
    EXPECT_NE(msg.find("multiple of parallel.pp"), std::string::npos) << msg;
  }
  EXPECT_THROW(make_schedule(ScheduleKind::k1F1B, 4, 8, 2), UserError);  // v needs interleaved
  EXPECT_THROW(make_gpipe(0, 4), UserError);
  EXPECT_THROW(make_1f1b(2, 0), UserError);
}

TEST(schedule_Generators, ParseKind) {
  EXPECT_EQ(parse_schedule_kind("gpipe"), ScheduleKind::kGPipe);
  EXPECT_EQ(parse_schedule_kind("1f1b"), ScheduleKind::k1F1B);
  EXPECT_EQ(parse_schedule_kind("interleaved_1f1b"), ScheduleKind::kInterleaved1F1B);
  EXPECT_EQ(parse_schedule_kind("zb_h1"), ScheduleKind::kZBH1);
  EXPECT_THROW(parse_schedule_kind("zb-v"), UserError);
  for (ScheduleKind k : {ScheduleKind::kGPipe, ScheduleKind::k1F1B, ScheduleKind::kInterleaved1F1B,
                         ScheduleKind::kZBH1})
    EXPECT_EQ(parse_schedule_kind(to_string(k)), k);
}

bool mentions(const std::vector<std::string>& problems, const std::string& what) {
  return std::any_of(problems.begin(), problems.end(),
                     [&](const std::string& p) { return p.find(what) != std::string::npos; });
}

TEST(schedule_Validate, CatchesCrossRankDeadlockFromSwap) {
  // 1F1B pp=2 m=3: rank 1 runs F0 BW0 F1 BW1 F2 BW2. Swapping BW0 and F2 makes rank 1 wait for
  // F(2) from rank 0, which runs F2 only after BW(0) of rank 0, which waits for rank 1's BW0.
  Schedule s = make_1f1b(2, 3);
  ASSERT_TRUE(validate(s).empty());
  std::swap(s.ranks[1][1], s.ranks[1][4]);
  const auto problems = validate(s);
  ASSERT_EQ(problems.size(), 1u);
  EXPECT_TRUE(mentions(problems, "deadlock")) << problems[0];
  EXPECT_TRUE(mentions(problems, "rank 1 blocked at F(2,1)")) << problems[0];
  EXPECT_TRUE(mentions(problems, "rank 0 blocked at BW(0,0)")) << problems[0];
}

TEST(schedule_Validate, CatchesLocalOrderViolation) {
  Schedule s = make_gpipe(3, 2);
  std::swap(s.ranks[2][0], s.ranks[2][2]);  // BW(0,2) before its own F(0,2)
  EXPECT_TRUE(mentions(validate(s), "deadlock"));
  Schedule z = make_zb_h1(3, 4);  // W before its B
  auto& r = z.ranks[0];
  const auto b = std::find(r.begin(), r.end(), Action{Op::kB, 0, 0});
  const auto w = std::find(r.begin(), r.end(), Action{Op::kW, 0, 0});
  std::iter_swap(b, w);
  EXPECT_TRUE(mentions(validate(z), "waiting for B(0,0)"));
}

TEST(schedule_Validate, EverySwapOfOneRankIsValidOrDiagnosed) {
  // Exhaustive over one small table: a swap never crashes the validator, and a swap that puts
  // a user before its producer on the same rank is always reported.
  const Schedule base = make_1f1b(3, 4);
  int broken = 0;
  for (size_t i = 0; i < base.ranks[1].size(); ++i) {
    for (size_t j = i + 1; j < base.ranks[1].size(); ++j) {
      Schedule s = base;
      std::swap(s.ranks[1][i], s.ranks[1][j]);
      const auto problems = validate(s);
      const Action& moved = s.ranks[1][i];  // now earlier
      const Action& other = s.ranks[1][j];
      if (moved.op == Op::kBW && other.op == Op::kF && moved.mb == other.mb) {
        EXPECT_FALSE(problems.empty()) << i << "<->" << j;
      }
      broken += !problems.empty();
    }
  }
  EXPECT_GT(broken, 0);
}

TEST(schedule_Validate, CatchesMissingDuplicateAndMisplaced) {
  Schedule s = make_1f1b(2, 2);
  s.ranks[0].pop_back();
  EXPECT_TRUE(mentions(validate(s), "micro-batch 1 chunk 0: 1 F, 0 B, 0 W, 0 BW"));
  Schedule d = make_1f1b(2, 2);
  d.ranks[1].push_back(d.ranks[1].front());
  EXPECT_TRUE(mentions(validate(d), "2 F"));
  Schedule p = make_1f1b(2, 2);
  p.ranks[0].push_back({Op::kF, 0, 1});
  EXPECT_TRUE(mentions(validate(p), "belongs on rank 1"));
  Schedule mixed = make_zb_h1(2, 2);
  mixed.ranks[0].push_back({Op::kBW, 0, 0});
  EXPECT_TRUE(mentions(validate(mixed), "1 BW"));
}

}  // namespace
}  // namespace t3d::parallel
