// The rank <-> coordinate math, against the references' golden table (no MPI).
#include <gtest/gtest.h>

#include <map>
#include <set>

#include "kernels/check.h"
#include "parallel/mesh.h"

using t3d::parallel::Coord;
using t3d::parallel::Dim;
using t3d::parallel::MeshShape;

TEST(Mesh, ReferenceExamplePp3Dp4Cp1Tp8) {
  const MeshShape m(3, 4, 1, 8, 1);
  ASSERT_EQ(m.world(), 96);
  EXPECT_EQ(m.group(Dim::tp, 0), (std::vector<int>{0, 1, 2, 3, 4, 5, 6, 7}));
  EXPECT_EQ(m.group(Dim::tp, 13), (std::vector<int>{8, 9, 10, 11, 12, 13, 14, 15}));
  EXPECT_EQ(m.group(Dim::dp, 0), (std::vector<int>{0, 8, 16, 24}));
  EXPECT_EQ(m.group(Dim::dp, 9), (std::vector<int>{1, 9, 17, 25}));
  EXPECT_EQ(m.group(Dim::pp, 0), (std::vector<int>{0, 32, 64}));
  EXPECT_EQ(m.group(Dim::pp, 33), (std::vector<int>{1, 33, 65}));
  EXPECT_EQ(m.group(Dim::cp, 42), (std::vector<int>{42}));
  EXPECT_EQ(m.coord_of(43), (Coord{1, 1, 0, 3}));
  EXPECT_EQ(m.label(43), "[pp1 dp1 tp3]");
}

TEST(Mesh, CpSitsBetweenDpAndTp) {
  // torchtitan's example: pp2, dp8, cp2, tp2 on 64 ranks.
  const MeshShape m(2, 8, 2, 2, 1);
  EXPECT_EQ(m.group(Dim::tp, 0), (std::vector<int>{0, 1}));
  EXPECT_EQ(m.group(Dim::cp, 0), (std::vector<int>{0, 2}));
  EXPECT_EQ(m.group(Dim::dp, 0), (std::vector<int>{0, 4, 8, 12, 16, 20, 24, 28}));
  EXPECT_EQ(m.group(Dim::pp, 5), (std::vector<int>{5, 37}));
  EXPECT_EQ(m.label(7), "[pp0 dp1 cp1 tp1]");
}

TEST(Mesh, RoundTripAndGroupsPartitionTheWorld) {
  for (auto [pp, dp, cp, tp] : std::vector<std::array<int, 4>>{
           {1, 1, 1, 1}, {2, 2, 1, 2}, {3, 4, 1, 8}, {2, 3, 2, 2}, {5, 1, 1, 3}}) {
    const MeshShape m(pp, dp, cp, tp, 1);
    for (int r = 0; r < m.world(); ++r) EXPECT_EQ(m.rank_of(m.coord_of(r)), r);
    for (Dim d : t3d::parallel::kDims) {
      // Every rank is in exactly one group per dimension; colours identify groups one to one.
      std::map<int, std::set<int>> by_colour;
      for (int r = 0; r < m.world(); ++r) {
        const auto g = m.group(d, r);
        EXPECT_EQ(static_cast<int>(g.size()), m.size(d));
        EXPECT_TRUE(std::count(g.begin(), g.end(), r) == 1);
        by_colour[m.group_index(d, r)].insert(r);
      }
      EXPECT_EQ(static_cast<int>(by_colour.size()), m.world() / m.size(d));
      for (const auto& [colour, members] : by_colour) {
        const auto g = m.group(d, *members.begin());
        EXPECT_EQ(std::set<int>(g.begin(), g.end()), members);
      }
    }
  }
}

// Expert parallelism folded into dp × cp (docs/parallelism.md's table): EP = ep consecutive
// dp_cp ranks, EDP = the dp_cp ranks with the same dp_cp rank mod ep.
TEST(Mesh, ExpertGroupsFoldIntoDpCp) {
  // dp=4, ep=2: dp_cp = {0,1,2,3}; EP {0,1} {2,3}; EDP {0,2} {1,3}.
  const MeshShape dp4(1, 4, 1, 1, 2);
  EXPECT_EQ(dp4.ep_group(0), (std::vector<int>{0, 1}));
  EXPECT_EQ(dp4.ep_group(3), (std::vector<int>{2, 3}));
  EXPECT_EQ(dp4.edp_group(0), (std::vector<int>{0, 2}));
  EXPECT_EQ(dp4.edp_group(3), (std::vector<int>{1, 3}));
  // pp=2, dp=4, ep=2: each stage folds its own dp ranks (stage 1 is ranks 4..7).
  const MeshShape pp2(2, 4, 1, 1, 2);
  EXPECT_EQ(pp2.ep_group(5), (std::vector<int>{4, 5}));
  EXPECT_EQ(pp2.edp_group(5), (std::vector<int>{5, 7}));
  // dp=4, tp=2, ep=2: dp neighbours are 2 ranks apart; each tp rank has its own groups.
  const MeshShape tp2(1, 4, 1, 2, 2);
  EXPECT_EQ(tp2.ep_group(0), (std::vector<int>{0, 2}));
  EXPECT_EQ(tp2.ep_group(7), (std::vector<int>{5, 7}));
  EXPECT_EQ(tp2.edp_group(1), (std::vector<int>{1, 5}));
  EXPECT_EQ(tp2.edp_group(2), (std::vector<int>{2, 6}));
  // dp=2, cp=2, tp=2, ep=4: dp_cp (cp-major) = {0,4,2,6} for tp rank 0; one EP group of them all.
  const MeshShape cp2(1, 2, 2, 2, 4);
  EXPECT_EQ(cp2.dp_cp_group(2), (std::vector<int>{0, 4, 2, 6}));
  EXPECT_EQ(cp2.ep_group(6), (std::vector<int>{0, 4, 2, 6}));
  EXPECT_EQ(cp2.edp_group(6), (std::vector<int>{6}));
  EXPECT_EQ(cp2.ep_group(3), (std::vector<int>{1, 5, 3, 7}));
  // dp=2, cp=2, ep=2: EP pairs the dp ranks of one cp rank.
  const MeshShape cp2ep2(1, 2, 2, 1, 2);
  EXPECT_EQ(cp2ep2.ep_group(2), (std::vector<int>{0, 2}));  // ranks 0, 2 are cp 0 (dp 0, 1)
  EXPECT_EQ(cp2ep2.ep_group(1), (std::vector<int>{1, 3}));
  EXPECT_EQ(cp2ep2.edp_group(0), (std::vector<int>{0, 1}));
  // ep = 1: EP is the rank alone, EDP is dp_cp.
  const MeshShape ep1(2, 2, 2, 2, 1);
  for (int r = 0; r < ep1.world(); ++r) {
    EXPECT_EQ(ep1.ep_group(r), (std::vector<int>{r}));
    EXPECT_EQ(ep1.edp_group(r), ep1.dp_cp_group(r));
  }
}

TEST(Mesh, ExpertGroupsPartitionEveryDpCpGroup) {
  for (auto [pp, dp, cp, tp, ep] : std::vector<std::array<int, 5>>{
           {1, 4, 1, 1, 2}, {2, 4, 1, 2, 4}, {1, 6, 2, 1, 3}, {2, 2, 2, 2, 2}, {1, 8, 1, 1, 8}}) {
    const MeshShape m(pp, dp, cp, tp, ep);
    std::map<int, std::set<int>> ep_by_colour, edp_by_colour;
    for (int r = 0; r < m.world(); ++r) {
      const auto e = m.ep_group(r), d = m.edp_group(r), flat = m.dp_cp_group(r);
      EXPECT_EQ(static_cast<int>(e.size()), ep);
      EXPECT_EQ(static_cast<int>(d.size()), dp * cp / ep);
      // This rank's place in each group is the key the Mesh splits with.
      EXPECT_EQ(e.at(m.dp_cp_rank(r) % ep), r);
      EXPECT_EQ(d.at(m.dp_cp_rank(r) / ep), r);
      EXPECT_EQ(flat.at(m.dp_cp_rank(r)), r);
      // EP and EDP meet in this rank alone, and both lie inside its dp_cp group.
      std::set<int> common;
      for (int x : e)
        if (std::count(d.begin(), d.end(), x)) common.insert(x);
      EXPECT_EQ(common, std::set<int>{r});
      for (int x : e) EXPECT_TRUE(std::count(flat.begin(), flat.end(), x));
      for (int x : d) EXPECT_TRUE(std::count(flat.begin(), flat.end(), x));
      ep_by_colour[m.ep_group_index(r)].insert(r);
      edp_by_colour[m.edp_group_index(r)].insert(r);
    }
    // Colours identify groups one to one.
    EXPECT_EQ(static_cast<int>(ep_by_colour.size()), m.world() / ep);
    EXPECT_EQ(static_cast<int>(edp_by_colour.size()), m.world() / (dp * cp / ep));
    for (const auto& [colour, members] : ep_by_colour) {
      const auto g = m.ep_group(*members.begin());
      EXPECT_EQ(std::set<int>(g.begin(), g.end()), members);
    }
    for (const auto& [colour, members] : edp_by_colour) {
      const auto g = m.edp_group(*members.begin());
      EXPECT_EQ(std::set<int>(g.begin(), g.end()), members);
    }
  }
}

TEST(Mesh, RejectsBadShapesAndRanks) {
  EXPECT_THROW(MeshShape(0, 1, 1, 1, 1), t3d::InternalError);
  EXPECT_THROW(MeshShape(1, 4, 1, 1, 0), t3d::InternalError);
  EXPECT_THROW(MeshShape(1, 4, 1, 1, 3), t3d::InternalError);  // ep must divide dp·cp
  EXPECT_THROW(MeshShape(2, 1, 1, 2, 2), t3d::InternalError);  // pp and tp do not count
  const MeshShape m(2, 1, 1, 2, 1);
  EXPECT_THROW(m.coord_of(4), t3d::InternalError);
  EXPECT_THROW(m.coord_of(-1), t3d::InternalError);
}
