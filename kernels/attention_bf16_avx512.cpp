// The bf16 attention tiles (kernels/attention_bf16.h). Compiled with AVX-512 F/BW/VL/DQ,
// AVX512-BF16 and FMA (kernels/CMakeLists.txt) and called only where bf16_attention_supported():
// everything here but the two entry points has internal linkage and no library template is
// instantiated, so no AVX-512 code can leak into the baseline build.
//
// Tile products: C (M, N) = or += alpha * A (M, K) B (K, N) with `vdpbf16ps`, which multiplies
// pairs of bf16 along K. Both operands are therefore stored as 32-bit words holding two
// consecutive K elements (low half first): A is broadcast one pair at a time, B is read 16 columns
// at a time. Which tensor needs which layout:
//   natural rows   [r][p] = (x[r][2p], x[r][2p+1])   q, dout, P, dS as A when K runs along rows
//   row pairs      [p][c] = (x[2p][c], x[2p+1][c])   v, k, q, dout as B; P, dS as transposed A
//   column pairs   [p][j] = (x[j][2p], x[j][2p+1])   k, v as B of q k^T and dO v^T (a transpose)
// An odd K is padded with a zero element in every operand that holds it.
// GCC 12 warns about the deliberately undefined vectors inside its own AVX-512 shuffle intrinsics
// (GCC bug 105593, fixed in 13).
#pragma GCC diagnostic ignored "-Wuninitialized"
#pragma GCC diagnostic ignored "-Wmaybe-uninitialized"
#include <immintrin.h>

#include <cstdint>
#include <cstring>

#include "kernels/attention_bf16.h"
#include "kernels/simd_rows.h"

namespace t3d::kernels::detail {
namespace {

using i64 = std::int64_t;
using u32 = std::uint32_t;

inline i64 imin(i64 a, i64 b) { return a < b ? a : b; }
// Mask of the first n of 16 lanes (none for n <= 0).
inline __mmask16 lanes(i64 n) {
  return n <= 0 ? 0 : n >= 16 ? 0xFFFF : static_cast<__mmask16>((1u << n) - 1);
}

// ---- packing: fp32 -> bf16 pairs -------------------------------------------------------------

// dst (rows, ceil(cols/2)) natural rows of src (rows, cols; row stride ld).
void pack_natural(u32* dst, const float* src, i64 rows, i64 cols, i64 ld) {
  const i64 pairs = (cols + 1) / 2;
  for (i64 r = 0; r < rows; ++r) {
    auto* d = reinterpret_cast<std::uint16_t*>(dst + r * pairs);
    for (i64 c = 0; c < 2 * pairs; c += 16) {
      const __m512 x = _mm512_maskz_loadu_ps(lanes(cols - c), src + r * ld + c);
      _mm256_mask_storeu_epi16(d + c, lanes(2 * pairs - c), (__m256i)_mm512_cvtneps_pbh(x));
    }
  }
}

// dst (ceil(rows/2), cols) row pairs of src (rows, cols; row stride ld); a missing last row is 0.
void pack_row_pairs(u32* dst, const float* src, i64 rows, i64 cols, i64 ld) {
  // Interleaves [a0..a15 | b0..b15] (16-bit lanes) into a0 b0 a1 b1 ...
  alignas(64) static const std::uint16_t kIdx[32] = {0, 16, 1, 17, 2,  18, 3,  19, 4,  20, 5,
                                                     21, 6, 22, 7, 23, 8,  24, 9,  25, 10, 26,
                                                     11, 27, 12, 28, 13, 29, 14, 30, 15, 31};
  const __m512i idx = _mm512_load_si512(kIdx);
  for (i64 p = 0; p < (rows + 1) / 2; ++p) {
    const float* a = src + 2 * p * ld;
    const bool has_b = 2 * p + 1 < rows;
    for (i64 c = 0; c < cols; c += 16) {
      const __mmask16 m = lanes(cols - c);
      const __m512 lo = _mm512_maskz_loadu_ps(m, a + c);
      const __m512 hi = has_b ? _mm512_maskz_loadu_ps(m, a + ld + c) : _mm512_setzero_ps();
      const __m512i x = _mm512_permutexvar_epi16(idx, (__m512i)_mm512_cvtne2ps_pbh(hi, lo));
      _mm512_mask_storeu_epi32(dst + p * cols + c, m, x);
    }
  }
}

// In place: r[i] (16 dwords of row i) becomes column i.
void transpose16(__m512i r[16]) {
  __m512i t[16], u[16];
  for (int i = 0; i < 16; i += 2) {
    t[i] = _mm512_unpacklo_epi32(r[i], r[i + 1]);
    t[i + 1] = _mm512_unpackhi_epi32(r[i], r[i + 1]);
  }
  // u[4g + e], 128-bit lane k: rows 4g..4g+3 of column 4k + e.
  for (int g = 0; g < 16; g += 4) {
    u[g] = _mm512_unpacklo_epi64(t[g], t[g + 2]);
    u[g + 1] = _mm512_unpackhi_epi64(t[g], t[g + 2]);
    u[g + 2] = _mm512_unpacklo_epi64(t[g + 1], t[g + 3]);
    u[g + 3] = _mm512_unpackhi_epi64(t[g + 1], t[g + 3]);
  }
  for (int e = 0; e < 4; ++e) {
    const __m512i v0 = _mm512_shuffle_i32x4(u[e], u[4 + e], 0x88);
    const __m512i w0 = _mm512_shuffle_i32x4(u[e], u[4 + e], 0xDD);
    const __m512i v1 = _mm512_shuffle_i32x4(u[8 + e], u[12 + e], 0x88);
    const __m512i w1 = _mm512_shuffle_i32x4(u[8 + e], u[12 + e], 0xDD);
    r[e] = _mm512_shuffle_i32x4(v0, v1, 0x88);
    r[4 + e] = _mm512_shuffle_i32x4(w0, w1, 0x88);
    r[8 + e] = _mm512_shuffle_i32x4(v0, v1, 0xDD);
    r[12 + e] = _mm512_shuffle_i32x4(w0, w1, 0xDD);
  }
}

// dst (ceil(cols/2), ldk) column pairs of src (rows, cols; row stride ld), in blocks of 16 rows
// (rows up to the next multiple of 16 are written as 0; ldk >= that).
void pack_col_pairs(u32* dst, const float* src, i64 rows, i64 cols, i64 ld, i64 ldk) {
  const i64 pairs = (cols + 1) / 2;
  for (i64 j0 = 0; j0 < rows; j0 += 16)
    for (i64 p0 = 0; p0 < pairs; p0 += 16) {
      __m512i r[16];
      const i64 c = 2 * p0;
      for (i64 i = 0; i < 16; ++i) {
        if (j0 + i >= rows) {
          r[i] = _mm512_setzero_si512();
          continue;
        }
        const float* row = src + (j0 + i) * ld + c;
        const __m512 lo = _mm512_maskz_loadu_ps(lanes(cols - c), row);
        const __m512 hi = _mm512_maskz_loadu_ps(lanes(cols - c - 16), row + 16);
        r[i] = (__m512i)_mm512_cvtne2ps_pbh(hi, lo);
      }
      transpose16(r);
      for (i64 p = 0; p < imin(16, pairs - p0); ++p)
        _mm512_storeu_si512(dst + (p0 + p) * ldk + j0, r[p]);
    }
}

// ---- tile products ---------------------------------------------------------------------------

// C (MR, 16 NV) of one register block: A pair (r, p) at a[r * a_rs + p * a_ps], B pair (p, n)
// at b[p * ldb + n]; the last 16 columns are masked by `tail`.
template <int MR, int NV>
void block(i64 np, const u32* a, i64 a_rs, i64 a_ps, const u32* b, i64 ldb, float* c, i64 ldc,
           float alpha, bool accumulate, __mmask16 tail) {
  // Fully unrolled, so that the accumulators live in registers (GCC -O2 keeps them on the stack
  // otherwise).
  __m512 acc[MR][NV];
#pragma GCC unroll 8
  for (int r = 0; r < MR; ++r)
#pragma GCC unroll 4
    for (int v = 0; v < NV; ++v) acc[r][v] = _mm512_setzero_ps();
  for (i64 p = 0; p < np; ++p) {
    __m512bh bv[NV];
#pragma GCC unroll 4
    for (int v = 0; v < NV; ++v)
      bv[v] = (__m512bh)_mm512_maskz_loadu_epi32(v == NV - 1 ? tail : 0xFFFF, b + p * ldb + 16 * v);
#pragma GCC unroll 8
    for (int r = 0; r < MR; ++r) {
      const __m512bh av = (__m512bh)_mm512_set1_epi32(static_cast<int>(a[r * a_rs + p * a_ps]));
#pragma GCC unroll 4
      for (int v = 0; v < NV; ++v) acc[r][v] = _mm512_dpbf16_ps(acc[r][v], av, bv[v]);
    }
  }
  const __m512 al = _mm512_set1_ps(alpha);
#pragma GCC unroll 8
  for (int r = 0; r < MR; ++r)
#pragma GCC unroll 4
    for (int v = 0; v < NV; ++v) {
      const __mmask16 m = v == NV - 1 ? tail : 0xFFFF;
      float* cp = c + r * ldc + 16 * v;
      const __m512 x = accumulate ? _mm512_fmadd_ps(acc[r][v], al, _mm512_maskz_loadu_ps(m, cp))
                                  : _mm512_mul_ps(acc[r][v], al);
      _mm512_mask_storeu_ps(cp, m, x);
    }
}

using BlockFn = void (*)(i64, const u32*, i64, i64, const u32*, i64, float*, i64, float, bool,
                         __mmask16);
constexpr int kRows = 6;  // 6 x 4 accumulators: enough in flight to hide vdpbf16ps latency

template <int MR>
BlockFn block_for(i64 nv) {
  switch (nv) {
    case 1: return block<MR, 1>;
    case 2: return block<MR, 2>;
    case 3: return block<MR, 3>;
    default: return block<MR, 4>;
  }
}

BlockFn block_for(i64 mr, i64 nv) {
  switch (mr) {
    case 1: return block_for<1>(nv);
    case 2: return block_for<2>(nv);
    case 3: return block_for<3>(nv);
    case 4: return block_for<4>(nv);
    case 5: return block_for<5>(nv);
    default: return block_for<6>(nv);
  }
}

// C (M, N) (=, or += when accumulate) alpha * A (M, 2 np) B (2 np, N) in blocks of kRows x 64.
void product(i64 M, i64 N, i64 np, const u32* a, i64 a_rs, i64 a_ps, const u32* b, i64 ldb,
             float* c, i64 ldc, float alpha, bool accumulate) {
  for (i64 n0 = 0; n0 < N; n0 += 64) {
    const i64 nn = imin(64, N - n0), nv = (nn + 15) / 16;
    const __mmask16 tail = lanes(nn - 16 * (nv - 1));
    const BlockFn full = block_for(kRows, nv);
    i64 r0 = 0;
    for (; r0 + kRows <= M; r0 += kRows)
      full(np, a + r0 * a_rs, a_rs, a_ps, b + n0, ldb, c + r0 * ldc + n0, ldc, alpha, accumulate,
           tail);
    if (r0 < M)
      block_for(M - r0, nv)(np, a + r0 * a_rs, a_rs, a_ps, b + n0, ldb, c + r0 * ldc + n0, ldc,
                            alpha, accumulate, tail);
  }
}

// ---- one item --------------------------------------------------------------------------------

struct Head {
  i64 T, D, dp, keys, used, ld_q, ld_kv, group;  // dp: pairs of D; used: keys the mask reaches
  float scale;
};

Head head_of(const AttentionShape& s) {
  Head hd;
  hd.T = s.T, hd.D = s.head_dim, hd.dp = (s.head_dim + 1) / 2;
  hd.keys = s.kv_len > 0 ? s.kv_len : s.T;
  hd.used = s.q_pos + s.T;
  hd.ld_q = s.n_heads * s.head_dim, hd.ld_kv = s.n_kv_heads * s.head_dim;
  hd.group = s.n_heads / s.n_kv_heads;
  hd.scale = 1.0f / __builtin_sqrtf(static_cast<float>(s.head_dim));
  return hd;
}

}  // namespace

void attention_forward_head_bf16(float* out, float* lse, const float* q, const float* k,
                                 const float* v, const Bf16AttentionBuffers& buf,
                                 const AttentionShape& s, i64 b, i64 h) {
  const Head hd = head_of(s);
  const i64 tq = s.tile, tk = buf.key_tile, D = hd.D;
  const float* qh = q + b * hd.T * hd.ld_q + h * D;                      // (T, D) stride ld_q
  const float* kh = k + b * hd.keys * hd.ld_kv + (h / hd.group) * D;    // (keys, D) stride ld_kv
  const float* vh = v + b * hd.keys * hd.ld_kv + (h / hd.group) * D;    // (keys, D) stride ld_kv
  float* oh = out + b * hd.T * hd.ld_q + h * D;                          // (T, D) stride ld_q
  float* lse_h = lse + (b * s.n_heads + h) * hd.T;                       // (T)
  pack_col_pairs(buf.k_cols, kh, hd.used, D, hd.ld_kv, buf.ldk);
  pack_row_pairs(buf.v_rows, vh, hd.used, D, hd.ld_kv);
  const SimdRows& rows = simd_rows();
  for (i64 i0 = 0; i0 < hd.T; i0 += tq) {
    const i64 nq = imin(tq, hd.T - i0), p0 = s.q_pos + i0;
    float* oi = oh + i0 * hd.ld_q;
    pack_natural(buf.q_nat, qh + i0 * hd.ld_q, nq, D, hd.ld_q);
    for (i64 r = 0; r < nq; ++r) {
      buf.m[r] = -__builtin_inff();
      buf.l[r] = 0.0f;
      std::memset(oi + r * hd.ld_q, 0, static_cast<std::size_t>(D) * sizeof(float));
    }
    for (i64 j0 = 0; j0 < p0 + nq; j0 += tk) {  // key tiles up to the diagonal
      const i64 nk = imin(tk, p0 + nq - j0), kp = (nk + 1) / 2;
      // S (nq, nk) = scale q_i k_j^T
      product(nq, nk, hd.dp, buf.q_nat, hd.dp, 1, buf.k_cols + j0, buf.ldk, buf.s, nk, hd.scale,
              false);
      rows.softmax_tile_fwd(buf.s, nq, nk, p0, j0, buf.m, buf.l, oi, hd.ld_q, D);
      // o_i (nq, D) += P (nq, nk) v_j (nk, D)
      pack_natural(buf.p_nat, buf.s, nq, nk, nk);
      product(nq, D, kp, buf.p_nat, kp, 1, buf.v_rows + (j0 / 2) * D, D, oi, hd.ld_q, 1.0f, true);
    }
    for (i64 r = 0; r < nq; ++r) {
      const float inv = 1.0f / buf.l[r];
      float* orow = oi + r * hd.ld_q;
      for (i64 d = 0; d < D; ++d) orow[d] *= inv;
      lse_h[i0 + r] = buf.m[r] + __builtin_logf(buf.l[r]);
    }
  }
}

void attention_backward_group_bf16(float* dq, float* dk, float* dv, const float* dout,
                                   const float* q, const float* k, const float* v,
                                   const float* out, const float* lse,
                                   const Bf16AttentionBuffers& buf, const AttentionShape& s, i64 b,
                                   i64 kvh) {
  const Head hd = head_of(s);
  const i64 tq = s.tile, tk = buf.key_tile, D = hd.D, kv_off = b * hd.keys * hd.ld_kv + kvh * D;
  pack_col_pairs(buf.k_cols, k + kv_off, hd.used, D, hd.ld_kv, buf.ldk);
  pack_row_pairs(buf.k_rows, k + kv_off, hd.used, D, hd.ld_kv);
  pack_col_pairs(buf.v_cols, v + kv_off, hd.used, D, hd.ld_kv, buf.ldk);
  float* dkh = dk + kv_off;  // (keys, D) stride ld_kv
  float* dvh = dv + kv_off;  // (keys, D) stride ld_kv
  const SimdRows& rows = simd_rows();
  for (i64 h = kvh * hd.group; h < (kvh + 1) * hd.group; ++h) {
    const i64 q_off = b * hd.T * hd.ld_q + h * D;
    const float* lse_h = lse + (b * s.n_heads + h) * hd.T;  // (T)
    for (i64 i0 = 0; i0 < hd.T; i0 += tq) {
      const i64 nq = imin(tq, hd.T - i0), qp = (nq + 1) / 2, p0 = s.q_pos + i0;
      const i64 at = q_off + i0 * hd.ld_q;  // row i0 of this head in q, out, dout, dq
      rows.row_dots(buf.m, out + at, dout + at, nq, hd.ld_q, D);  // rowsum(dO * O)
      pack_natural(buf.q_nat, q + at, nq, D, hd.ld_q);
      pack_natural(buf.do_nat, dout + at, nq, D, hd.ld_q);
      pack_row_pairs(buf.q_rows, q + at, nq, D, hd.ld_q);
      pack_row_pairs(buf.do_rows, dout + at, nq, D, hd.ld_q);
      for (i64 j0 = 0; j0 < p0 + nq; j0 += tk) {
        const i64 nk = imin(tk, p0 + nq - j0), kp = (nk + 1) / 2;
        float* dkj = dkh + j0 * hd.ld_kv;
        // P (nq, nk) = exp(scale q_i k_j^T - lse)
        product(nq, nk, hd.dp, buf.q_nat, hd.dp, 1, buf.k_cols + j0, buf.ldk, buf.s, nk,
                hd.scale, false);
        rows.exp_tile_bwd(buf.s, nq, nk, p0, j0, lse_h + i0);
        // dv_j (nk, D) += P^T (nk, nq) do_i (nq, D)
        pack_row_pairs(buf.p_rows, buf.s, nq, nk, nk);
        product(nk, D, qp, buf.p_rows, 1, nk, buf.do_rows, D, dvh + j0 * hd.ld_kv, hd.ld_kv, 1.0f,
                true);
        // dP (nq, nk) = do_i v_j^T, then dS = P * (dP - rowsum(dO * O))
        product(nq, nk, hd.dp, buf.do_nat, hd.dp, 1, buf.v_cols + j0, buf.ldk, buf.dp, nk, 1.0f,
                false);
        rows.softmax_grad_tile(buf.dp, buf.s, nq, nk, buf.m);
        // dq_i (nq, D) += scale dS k_j;  dk_j (nk, D) += scale dS^T q_i
        pack_natural(buf.p_nat, buf.dp, nq, nk, nk);
        pack_row_pairs(buf.p_rows, buf.dp, nq, nk, nk);
        product(nq, D, kp, buf.p_nat, kp, 1, buf.k_rows + (j0 / 2) * D, D, dq + at, hd.ld_q,
                hd.scale, true);
        product(nk, D, qp, buf.p_rows, 1, nk, buf.q_rows, D, dkj, hd.ld_kv, hd.scale, true);
      }
    }
  }
}

}  // namespace t3d::kernels::detail
