// Fragment maps of mma.sync.aligned.m16n8k16.row.col.f32.bf16.bf16.f32 (PTX ISA, "Matrix
// fragments for mma.m16n8k16"): which (row, col) of a tile a lane's register element holds.
// Host-includable, so the CPU tests check them and the fragment loads below (an emulated warp,
// tests/kernels/test_mma_layout.cpp); the bf16 attention kernel (ops_attention_bf16.cu) loads
// every fragment through these. groupID = lane >> 2, tig = lane & 3.
#pragma once

#include <cstdint>

#include "kernels/row_math.h"  // T3D_HD, T3D_UNROLL (fragments stay in registers), bf16_of

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

// Two C fragments side by side (columns 0..7 of block 0, 8..15 of block 1) hold the elements of
// one A fragment of their 16 columns, in the same lanes: A element i is C element
// a_c_elem(i) of block a_c_block(i). So flash attention's P and dS pass from one product's output
// to the next product's input in registers.
T3D_HD constexpr int a_c_block(int i) { return i >> 2; }
T3D_HD constexpr int a_c_elem(int i) { return i & 3; }

// Two bf16 in one register as mma reads them: the lower-numbered element in the low half.
T3D_HD inline std::uint32_t pack_bf16(float lo, float hi) {
  return static_cast<std::uint32_t>(detail::bf16_of(lo)) |
         static_cast<std::uint32_t>(detail::bf16_of(hi)) << 16;
}

// A tile of bf16 values (shared memory on the GPU), row-major with `stride` elements per row.
// stride and every column asked for are even, so a pair of columns is one aligned 32-bit word.
struct Bf16Tile {
  std::uint16_t* p;
  int stride;
  T3D_HD std::uint32_t pair(int r, int c) const {
    return *reinterpret_cast<const std::uint32_t*>(p + r * stride + c);
  }
  T3D_HD void set_pair(int r, int c, std::uint32_t w) const {
    *reinterpret_cast<std::uint32_t*>(p + r * stride + c) = w;
  }
};

// A fragment (16 x 16) of lane `lane`: rows r0.., columns k0.. of a row-major tile.
T3D_HD inline void load_a(std::uint32_t (&a)[4], const Bf16Tile& t, int r0, int k0, int lane) {
  T3D_UNROLL
  for (int j = 0; j < 4; ++j) {
    const RowCol e = a_elem(lane, 2 * j);  // elements 2j and 2j + 1: one register
    a[j] = t.pair(r0 + e.row, k0 + e.col);
  }
}

// B fragment (16 x 8, k x n) of lane `lane` with B[k][n] = t(n0 + n, k0 + k): the tile holds B's
// columns as its rows (K for Q Kᵀ; Vᵀ for P V), so a register's two k are adjacent in a row.
T3D_HD inline void load_b(std::uint32_t (&b)[2], const Bf16Tile& t, int n0, int k0, int lane) {
  T3D_UNROLL
  for (int j = 0; j < 2; ++j) {
    const RowCol e = b_elem(lane, 2 * j);  // elements 2j and 2j + 1: k and k + 1
    b[j] = t.pair(n0 + e.col, k0 + e.row);
  }
}

// ldmatrix.sync.aligned.m8n8.x4.trans.shared.b16 as the B fragments of two 8-column blocks of
// B[k][n] = X(k0 + k, n0 + n), X a row-major tile (no transposed copy needed): lane l gives the
// address of row k0 + (l & 15), columns n0 + 8 (l >> 4) .. + 7 (16 bytes, 16-byte aligned), so
// matrices 0..3 are rows k0..k0+7 and k0+8..k0+15 of columns n0.. then of n0 + 8..; transposed,
// registers 0, 1 are the B fragment (b0 b1, b2 b3) of columns n0..n0+7, registers 2, 3 of
// n0+8..n0+15.
T3D_HD constexpr RowCol ldmatrix_b_source(int lane) { return {lane & 15, 8 * (lane >> 4)}; }

// The A fragment of 16 columns from the fp32 C fragments of its two 8-column blocks, rounded to
// bf16 (ties to even, as the CPU rounds).
T3D_HD inline void a_from_c(std::uint32_t (&a)[4], const float (&c0)[4], const float (&c1)[4]) {
  T3D_UNROLL
  for (int j = 0; j < 4; ++j) {
    const float* c = a_c_block(2 * j) == 0 ? c0 : c1;
    a[j] = pack_bf16(c[a_c_elem(2 * j)], c[a_c_elem(2 * j + 1)]);
  }
}

}  // namespace t3d::kernels::mma
