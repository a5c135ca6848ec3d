// The tensor-core fragment maps (kernels/cuda/mma_layout.h) on the CPU: host code, runs everywhere.
// Pinned against the PTX ISA's figures for mma.m16n8k16 with .bf16 operands (a lane's groupID =
// lane / 4 and threadID_in_group = lane % 4), and each map covers its tile exactly once.
#include <gtest/gtest.h>

#include <cstdint>
#include <random>
#include <vector>

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

TEST(MmaLayout, TwoCBlocksAreOneAFragment) {
  for (int lane = 0; lane < 32; ++lane)
    for (int i = 0; i < 8; ++i) {
      const RowCol c = c_elem(lane, a_c_elem(i));
      EXPECT_TRUE(same(a_elem(lane, i), c.row, c.col + 8 * a_c_block(i))) << lane << " " << i;
    }
}

// ---- an emulated warp: the fragment loads of the bf16 attention kernel, on the CPU --------------

float low(std::uint32_t w) { return detail::float_of(static_cast<std::uint16_t>(w & 0xFFFFu)); }
float high(std::uint32_t w) { return detail::float_of(static_cast<std::uint16_t>(w >> 16)); }

// What mma.m16n8k16 computes from the 32 lanes' registers: d += A B, each lane's elements placed
// by the ISA's maps (a register's low half the even element), the sum exact (double).
void mma_warp(float (&d)[32][4], const std::uint32_t (&a)[32][4], const std::uint32_t (&b)[32][2]) {
  double A[16][16], B[16][8];
  for (int lane = 0; lane < 32; ++lane) {
    for (int i = 0; i < 8; ++i)
      A[a_elem(lane, i).row][a_elem(lane, i).col] =
          i % 2 ? high(a[lane][i / 2]) : low(a[lane][i / 2]);
    for (int i = 0; i < 4; ++i)
      B[b_elem(lane, i).row][b_elem(lane, i).col] =
          i % 2 ? high(b[lane][i / 2]) : low(b[lane][i / 2]);
  }
  for (int lane = 0; lane < 32; ++lane)
    for (int i = 0; i < 4; ++i) {
      const RowCol e = c_elem(lane, i);
      double sum = d[lane][i];
      for (int k = 0; k < 16; ++k) sum += A[e.row][k] * B[k][e.col];
      d[lane][i] = static_cast<float>(sum);
    }
}

// A bf16 tile of `rows` x `cols` values (bf16-exact, small integers / 8) with padded rows.
struct HostTile {
  int rows, cols, stride;
  std::vector<std::uint16_t> data;
  HostTile(int r, int c, std::mt19937& rng) : rows(r), cols(c), stride(c + 8), data(r * (c + 8)) {
    std::uniform_int_distribution<int> dist(-16, 16);
    for (int i = 0; i < r; ++i)
      for (int j = 0; j < c; ++j) data[i * stride + j] = detail::bf16_of(dist(rng) / 8.0f);
  }
  Bf16Tile tile() { return {data.data(), stride}; }
  float at(int r, int c) const { return detail::float_of(data[r * stride + c]); }
};

// The forward's two products for 16 query rows, as the kernel chains them: S = Q Kᵀ (A from Q's
// rows, B from K's rows), then O = bf16(S) V with S's C fragments turned into A fragments in
// registers and B as load_b reads it from Vᵀ's rows (the kernel reads V's rows through
// ldmatrix.trans: the next test shows the two give the same registers); against the same
// products written out.
TEST(MmaLayout, AnEmulatedWarpChainsTheAttentionProducts) {
  std::mt19937 rng(5);
  constexpr int D = 32, keys = 16;
  HostTile q(16, D, rng), k(keys, D, rng), vt(D, keys, rng);  // vt(d, key) = V[key][d]
  float s[keys / 8][32][4] = {};
  for (int kk = 0; kk < D / 16; ++kk) {
    std::uint32_t a[32][4];
    for (int lane = 0; lane < 32; ++lane) load_a(a[lane], q.tile(), 0, 16 * kk, lane);
    for (int n = 0; n < keys / 8; ++n) {
      std::uint32_t b[32][2];
      for (int lane = 0; lane < 32; ++lane) load_b(b[lane], k.tile(), 8 * n, 16 * kk, lane);
      mma_warp(s[n], a, b);
    }
  }
  double S[16][keys];
  for (int r = 0; r < 16; ++r)
    for (int j = 0; j < keys; ++j) {
      S[r][j] = 0;
      for (int d = 0; d < D; ++d) S[r][j] += double{q.at(r, d)} * k.at(j, d);
    }
  for (int n = 0; n < keys / 8; ++n)
    for (int lane = 0; lane < 32; ++lane)
      for (int i = 0; i < 4; ++i) {
        const RowCol e = c_elem(lane, i);
        ASSERT_EQ(s[n][lane][i], S[e.row][8 * n + e.col])
            << "S at " << e.row << "," << 8 * n + e.col;
      }
  float o[D / 8][32][4] = {};
  std::uint32_t a[32][4];
  for (int lane = 0; lane < 32; ++lane) a_from_c(a[lane], s[0][lane], s[1][lane]);
  for (int n = 0; n < D / 8; ++n) {
    std::uint32_t b[32][2];
    for (int lane = 0; lane < 32; ++lane) load_b(b[lane], vt.tile(), 8 * n, 0, lane);
    mma_warp(o[n], a, b);
  }
  for (int n = 0; n < D / 8; ++n)
    for (int lane = 0; lane < 32; ++lane)
      for (int i = 0; i < 4; ++i) {
        const RowCol e = c_elem(lane, i);
        double want = 0;
        for (int j = 0; j < keys; ++j)
          want += double{detail::float_of(detail::bf16_of(static_cast<float>(S[e.row][j])))} *
                  vt.at(8 * n + e.col, j);
        ASSERT_EQ(o[n][lane][i], static_cast<float>(want))
            << "O at " << e.row << "," << 8 * n + e.col;
      }
}

// ldmatrix.sync.aligned.m8n8.x4.trans.shared.b16 as the PTX ISA defines it: matrix i's row r is at
// the address lane 8i + r gives; transposed, lane l's register i holds matrix i's elements
// (row 2 (l % 4), column l / 4) in its low half and (row 2 (l % 4) + 1, column l / 4) in its high.
void ldmatrix_x4_trans(std::uint32_t (&regs)[32][4], const std::uint16_t* const (&addr)[32]) {
  for (int lane = 0; lane < 32; ++lane)
    for (int i = 0; i < 4; ++i) {
      const std::uint16_t* lo = addr[8 * i + 2 * (lane % 4)];
      const std::uint16_t* hi = addr[8 * i + 2 * (lane % 4) + 1];
      regs[lane][i] =
          static_cast<std::uint32_t>(lo[lane / 4]) | static_cast<std::uint32_t>(hi[lane / 4]) << 16;
    }
}

// The kernel reads B = X (k x n, row-major: V for P V, K for dS K) through ldmatrix.trans at the
// addresses ldmatrix_b_source names: the registers must be load_b's fragments of X's transpose
// (the layout load_b reads), for both 8-column blocks.
TEST(MmaLayout, LdmatrixTransGivesTheBFragmentsOfARowMajorTile) {
  std::mt19937 rng(9);
  HostTile x(32, 32, rng);  // x(k, n)
  std::vector<std::uint16_t> t(32 * 40);
  const Bf16Tile xt{t.data(), 40};  // xt(n, k) = x(k, n)
  for (int k = 0; k < 32; ++k)
    for (int n = 0; n < 32; ++n) t[n * 40 + k] = x.data[k * x.stride + n];
  for (int k0 : {0, 16})
    for (int n0 : {0, 16}) {
      const std::uint16_t* addr[32];
      for (int lane = 0; lane < 32; ++lane) {
        const RowCol e = ldmatrix_b_source(lane);
        addr[lane] = x.data.data() + (k0 + e.row) * x.stride + n0 + e.col;
      }
      std::uint32_t regs[32][4];
      ldmatrix_x4_trans(regs, addr);
      for (int lane = 0; lane < 32; ++lane) {
        std::uint32_t b0[2], b1[2];
        load_b(b0, xt, n0, k0, lane);
        load_b(b1, xt, n0 + 8, k0, lane);
        EXPECT_EQ(regs[lane][0], b0[0]) << "lane " << lane << " at " << k0 << "," << n0;
        EXPECT_EQ(regs[lane][1], b0[1]) << "lane " << lane << " at " << k0 << "," << n0;
        EXPECT_EQ(regs[lane][2], b1[0]) << "lane " << lane << " at " << k0 << "," << n0;
        EXPECT_EQ(regs[lane][3], b1[1]) << "lane " << lane << " at " << k0 << "," << n0;
      }
    }
}

}  // namespace
}  // namespace t3d::kernels::mma
