// Generators and the validator: every table is valid, keeps its memory promise, and the
// validator catches broken tables. Suite names start with `schedule_` for `ctest -R schedule`.
#include <gtest/gtest.h>

#include <algorithm>
#include <numeric>
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
      if (pp > 1) out.push_back({ScheduleKind::kZBV, pp, m, 2});  // any m, pp = 1 refused
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
  EXPECT_GT(checked, 250);
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
  EXPECT_EQ(parse_schedule_kind("zb_v"), ScheduleKind::kZBV);
  EXPECT_THROW(parse_schedule_kind("zb-v"), UserError);
  for (ScheduleKind k : {ScheduleKind::kGPipe, ScheduleKind::k1F1B, ScheduleKind::kInterleaved1F1B,
                         ScheduleKind::kZBH1, ScheduleKind::kZBV})
    EXPECT_EQ(parse_schedule_kind(to_string(k)), k);
}

bool mentions(const std::vector<std::string>& problems, const std::string& what) {
  return std::any_of(problems.begin(), problems.end(),
                     [&](const std::string& p) { return p.find(what) != std::string::npos; });
}

// ZB-V. Micro-batches alive per chunk of `stage`: the executor allocates each chunk its own peak.
std::vector<int> per_chunk_peaks(const Schedule& s, int stage) {
  std::vector<int> alive(s.num_chunks(), 0), peak(s.num_chunks(), 0);
  for (const Action& a : s.ranks[stage]) {
    if (a.op == Op::kF) peak[a.chunk] = std::max(peak[a.chunk], ++alive[a.chunk]);
    if (a.op == Op::kW || a.op == Op::kBW) --alive[a.chunk];
  }
  return peak;
}

TEST(schedule_ZbV, VShapedPlacement) {
  for (int pp : {2, 3, 4, 8}) {
    const Schedule s = make_zb_v(pp, 2 * pp);
    ASSERT_EQ(s.v, 2);
    ASSERT_EQ(s.num_chunks(), 2 * pp);
    for (int k = 0; k < 2 * pp; ++k) EXPECT_EQ(s.chunk_stage[k], k < pp ? k : 2 * pp - 1 - k);
    // Stage 0 holds the first chunk (embedding) and the last (LM head and loss).
    EXPECT_EQ(s.chunk_stage.front(), 0);
    EXPECT_EQ(s.chunk_stage.back(), 0);
    for (int st = 0; st < pp; ++st)
      for (const Action& a : s.ranks[st]) {
        EXPECT_TRUE(a.chunk == st || a.chunk == 2 * pp - 1 - st) << to_string(a);
        EXPECT_NE(a.op, Op::kBW) << "ZB-V splits every backward";
      }
  }
}

TEST(schedule_ZbV, MemoryIsOneFOneBPeak) {
  // Qi et al.: ZB-V keeps 1F1B's peak activation memory, pp micro-batches of a whole stage =
  // 2 pp chunks, on every rank; with fewer micro-batches, all of them. The executor gives each
  // chunk its own slots, so the sum of the per-chunk peaks must keep the promise too.
  for (int pp : {2, 3, 4, 5, 8}) {
    for (int m : {1, 2, 3, pp - 1, pp, pp + 1, 2 * pp, 2 * pp + 3, 24}) {
      if (m < 1) continue;
      const Schedule s = make_zb_v(pp, m);
      const auto peak = peak_in_flight(s);
      const int one_f_one_b = std::min(pp, m);  // 1F1B's stage 0, micro-batches
      EXPECT_EQ(*std::max_element(peak.begin(), peak.end()), 2 * one_f_one_b) << pp << " " << m;
      for (int st = 0; st < pp; ++st) {
        EXPECT_EQ(promised_in_flight(s, st), 2 * one_f_one_b);
        EXPECT_LE(peak[st], promised_in_flight(s, st)) << pp << " " << m << " stage " << st;
        const auto chunks = per_chunk_peaks(s, st);
        EXPECT_LE(std::accumulate(chunks.begin(), chunks.end(), 0), promised_in_flight(s, st))
            << pp << " " << m << " stage " << st;
      }
    }
  }
}

TEST(schedule_ZbV, RefusesWhatMakesNoSense) {
  try {
    make_zb_v(1, 4);
    FAIL() << "pp = 1 accepted";
  } catch (const UserError& e) {
    EXPECT_NE(std::string(e.what()).find("parallel.pp"), std::string::npos) << e.what();
  }
  try {
    make_schedule(ScheduleKind::kZBV, 4, 8, 3);
    FAIL() << "v = 3 accepted";
  } catch (const UserError& e) {
    EXPECT_NE(std::string(e.what()).find("parallel.virtual_stages = 3"), std::string::npos)
        << e.what();
  }
  EXPECT_THROW(make_schedule(ScheduleKind::kZBV, 4, 8, 1), UserError);
  EXPECT_THROW(make_zb_v(2, 0), UserError);
  EXPECT_NO_THROW(make_schedule(ScheduleKind::kZBV, 4, 8, 2));
}

TEST(schedule_ZbV, ValidatorSeesTheLocalHandOver) {
  // On stage pp-1 chunk pp follows chunk pp-1 on the same rank: running F(0, pp) first waits
  // for an input nobody will produce.
  Schedule s = make_zb_v(3, 4);
  ASSERT_TRUE(validate(s).empty());
  auto& r = s.ranks[2];
  const auto f2 = std::find(r.begin(), r.end(), Action{Op::kF, 0, 2});
  const auto f3 = std::find(r.begin(), r.end(), Action{Op::kF, 0, 3});
  ASSERT_LT(f2, f3);
  std::iter_swap(f2, f3);
  const auto problems = validate(s);
  EXPECT_TRUE(mentions(problems, "rank 2 blocked at F(0,3)")) << problems.front();
  EXPECT_TRUE(mentions(problems, "waiting for F(0,2) on rank 2")) << problems.front();
  Schedule w = make_zb_v(2, 2);  // a W before its B
  auto& r0 = w.ranks[0];
  std::iter_swap(std::find(r0.begin(), r0.end(), Action{Op::kB, 1, 3}),
                 std::find(r0.begin(), r0.end(), Action{Op::kW, 1, 3}));
  EXPECT_TRUE(mentions(validate(w), "waiting for B(1,3)"));
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
