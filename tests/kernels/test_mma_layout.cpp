// The tensor-core fragment maps (kernels/cuda/mma_layout.h) on the CPU: host code, runs everywhere.
// Pinned against the PTX ISA's figures for mma.m16n8k16 with .bf16 operands (a lane's groupID =
// lane / 4 and threadID_in_group = lane % 4), and each map covers its tile exactly once.
#include <gtest/gtest.h>

#include "kernels/cuda/mma_layout.h"

namespace t3d::kernels::mma {
namespace {

bool same(RowCol a, int row, int col) { return a.row == row && a.col == col; }

TEST(MmaLayout, LanesHoldTheIsasElements) {
  // Lane 5: groupID 1, threadID_in_group 1. A: a0,a1 row 1 cols 2,3; a2,a3 row 9; a4..a7 cols +8.
  EXPECT_TRUE(same(a_elem(5, 0), 1, 2));
  EXPECT_TRUE(same(a_elem(5, 1), 1, 3));
  EXPECT_TRUE(same(a_elem(5, 2), 9, 2));
  EXPECT_TRUE(same(a_elem(5, 3), 9, 3));
  EXPECT_TRUE(same(a_elem(5, 4), 1, 10));
  EXPECT_TRUE(same(a_elem(5, 7), 9, 11));
  // B (k x n): b0,b1 rows k 2,3 and b2,b3 rows 10,11, column n = groupID 1.
  EXPECT_TRUE(same(b_elem(5, 0), 2, 1));
  EXPECT_TRUE(same(b_elem(5, 1), 3, 1));
  EXPECT_TRUE(same(b_elem(5, 2), 10, 1));
  EXPECT_TRUE(same(b_elem(5, 3), 11, 1));
  // C: c0,c1 row 1 cols 2,3; c2,c3 row 9. Lane 31: groupID 7, threadID_in_group 3.
  EXPECT_TRUE(same(c_elem(5, 0), 1, 2));
  EXPECT_TRUE(same(c_elem(5, 3), 9, 3));
  EXPECT_TRUE(same(c_elem(31, 3), 15, 7));
  EXPECT_TRUE(same(a_elem(31, 7), 15, 15));
  EXPECT_TRUE(same(b_elem(31, 3), 15, 7));
}

TEST(MmaLayout, EachMapCoversItsTileOnce) {
  int a[16][16] = {}, b[16][8] = {}, c[16][8] = {};
  for (int lane = 0; lane < 32; ++lane) {
    for (int i = 0; i < 8; ++i) ++a[a_elem(lane, i).row][a_elem(lane, i).col];
    for (int i = 0; i < 4; ++i) {
      ++b[b_elem(lane, i).row][b_elem(lane, i).col];
      ++c[c_elem(lane, i).row][c_elem(lane, i).col];
    }
  }
  for (int r = 0; r < 16; ++r) {
    for (int k = 0; k < 16; ++k) EXPECT_EQ(a[r][k], 1) << r << "," << k;
    for (int n = 0; n < 8; ++n) {
      EXPECT_EQ(b[r][n], 1) << r << "," << n;
      EXPECT_EQ(c[r][n], 1) << r << "," << n;
    }
  }
}

}  // namespace
}  // namespace t3d::kernels::mma
