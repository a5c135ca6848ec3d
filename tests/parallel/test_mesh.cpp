// The rank <-> coordinate math, against the references' golden table (no MPI).
#include <gtest/gtest.h>

#include <set>

#include "kernels/check.h"
#include "parallel/mesh.h"

using t3d::parallel::Coord;
using t3d::parallel::Dim;
using t3d::parallel::MeshShape;

TEST(Mesh, ReferenceExamplePp3Dp4Cp1Tp8) {
  const MeshShape m(3, 4, 1, 8);
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
  const MeshShape m(2, 8, 2, 2);
  EXPECT_EQ(m.group(Dim::tp, 0), (std::vector<int>{0, 1}));
  EXPECT_EQ(m.group(Dim::cp, 0), (std::vector<int>{0, 2}));
  EXPECT_EQ(m.group(Dim::dp, 0), (std::vector<int>{0, 4, 8, 12, 16, 20, 24, 28}));
  EXPECT_EQ(m.group(Dim::pp, 5), (std::vector<int>{5, 37}));
  EXPECT_EQ(m.label(7), "[pp0 dp1 cp1 tp1]");
}

TEST(Mesh, RoundTripAndGroupsPartitionTheWorld) {
  for (auto [pp, dp, cp, tp] : std::vector<std::array<int, 4>>{
           {1, 1, 1, 1}, {2, 2, 1, 2}, {3, 4, 1, 8}, {2, 3, 2, 2}, {5, 1, 1, 3}}) {
    const MeshShape m(pp, dp, cp, tp);
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

TEST(Mesh, RejectsBadShapesAndRanks) {
  EXPECT_THROW(MeshShape(0, 1, 1, 1), t3d::InternalError);
  const MeshShape m(2, 1, 1, 2);
  EXPECT_THROW(m.coord_of(4), t3d::InternalError);
  EXPECT_THROW(m.coord_of(-1), t3d::InternalError);
}
