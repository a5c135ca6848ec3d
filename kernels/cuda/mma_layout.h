// Fragment maps of mma.sync.aligned.m16n8k16.row.col.f32.bf16.bf16.f32 (PTX ISA, "Matrix
// fragments for mma.m16n8k16"): which (row, col) of a tile a lane's register element holds.
// Host-includable so the CPU tests check them (emulated warp); the bf16 attention kernel is to
// load and store every fragment through these. groupID = lane >> 2, tig = lane & 3.
// Not yet used by a kernel (the bf16 tensor-core attention is still to be written); tested on
// the CPU against the ISA's figures (tests/kernels/test_mma_layout.cpp).
#pragma once

#include "kernels/row_math.h"  // T3D_HD

namespace t3d::kernels::mma {

struct RowCol {
  int row;
  int col;
};

T3D_HD constexpr int group_id(int lane) { return lane >> 2; }
T3D_HD constexpr int thread_in_group(int lane) { return lane & 3; }

// A (16 x 16, row-major operand), element i in 0..7 of a lane (a0..a7, two bf16 per register):
// rows groupID (i in {0,1,4,5}) or groupID + 8 (i in {2,3,6,7}); cols 2*tig + (i & 1), + 8 for
// i >= 4.
T3D_HD constexpr RowCol a_elem(int lane, int i) {
  return {group_id(lane) + ((i >> 1) & 1) * 8, 2 * thread_in_group(lane) + (i & 1) + (i >> 2) * 8};
}

// B (16 x 8, k x n, column operand), element i in 0..3 (b0..b3): k = 2*tig + (i & 1), + 8 for
// i >= 2; n = groupID.
T3D_HD constexpr RowCol b_elem(int lane, int i) {
  return {2 * thread_in_group(lane) + (i & 1) + (i >> 1) * 8, group_id(lane)};
}

// C/D (16 x 8, fp32), element i in 0..3 (c0..c3): row groupID, + 8 for i >= 2; col 2*tig + (i & 1).
T3D_HD constexpr RowCol c_elem(int lane, int i) {
  return {group_id(lane) + (i >> 1) * 8, 2 * thread_in_group(lane) + (i & 1)};
}

}  // namespace t3d::kernels::mma
