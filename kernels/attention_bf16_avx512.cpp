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

namespace t3d::kernels::detail {
namespace {

using i64 = std::int64_t;
using u32 = std::uint32_t;

inline i64 imin(i64 a, i64 b) { return a < b ? a : b; }
inline i64 imax(i64 a, i64 b) { return a > b ? a : b; }
// Mask of the first n of 16 lanes (none for n <= 0).
inline __mmask16 lanes(i64 n) {
  return n <= 0 ? 0 : n >= 16 ? 0xFFFF : static_cast<__mmask16>((1u << n) - 1);
}

// The first n of 16 floats at p, the rest 0. Full vectors use a plain load: the packing loops
// read q, k, v, out, dout from L3 or memory, and masked loads there measurably cut how many
// misses are in flight.
inline __m512 load_first(const float* p, i64 n) {
  return n >= 16 ? _mm512_loadu_ps(p) : _mm512_maskz_loadu_ps(lanes(n), p);
}

// ---- packing: fp32 -> bf16 pairs -------------------------------------------------------------

// Interleaves [a0..a15 | b0..b15] (16-bit lanes of cvtne2ps(b, a)) into a0 b0 a1 b1 ...
inline __m512i interleave_pairs(__m512 a, __m512 b) {
  alignas(64) static const std::uint16_t kIdx[32] = {0,  16, 1,  17, 2,  18, 3,  19, 4,  20, 5,
                                                     21, 6,  22, 7,  23, 8,  24, 9,  25, 10, 26,
                                                     11, 27, 12, 28, 13, 29, 14, 30, 15, 31};
  return _mm512_permutexvar_epi16(_mm512_load_si512(kIdx), (__m512i)_mm512_cvtne2ps_pbh(b, a));
}

// dst (ceil(rows/2), cols) row pairs of src (rows, cols; row stride ld); a missing last row is 0.
void pack_row_pairs(u32* dst, const float* src, i64 rows, i64 cols, i64 ld) {
  for (i64 p = 0; p < (rows + 1) / 2; ++p) {
    const float* a = src + 2 * p * ld;
    const bool has_b = 2 * p + 1 < rows;
    for (i64 c = 0; c < cols; c += 16) {
      const __mmask16 m = lanes(cols - c);
      const __m512 lo = load_first(a + c, cols - c);
      const __m512 hi = has_b ? load_first(a + ld + c, cols - c) : _mm512_setzero_ps();
      _mm512_mask_storeu_epi32(dst + p * cols + c, m, interleave_pairs(lo, hi));
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
        const __m512 lo = load_first(row, cols - c);
        const __m512 hi = load_first(row + 16, cols - c - 16);
        r[i] = (__m512i)_mm512_cvtne2ps_pbh(hi, lo);
      }
      transpose16(r);
      for (i64 p = 0; p < imin(16, pairs - p0); ++p)
        _mm512_storeu_si512(dst + (p0 + p) * ldk + j0, r[p]);
    }
}

// ---- fused row passes: fp32 tiles -> bf16 operands ---------------------------------------------

inline __m256i to_bf16(__m512 x) { return (__m256i)_mm512_cvtneps_pbh(x); }

// exp(x) for x <= 0: kernels/row_math.h's exp_neg (Cephes polynomial, rel. error ~2e-7) on 16
// lanes, with the 2^n scaling done by vscalefps.
inline __m512 exp_neg16(__m512 x) {
  x = _mm512_max_ps(x, _mm512_set1_ps(-87.0f));
  const __m512 fn = _mm512_roundscale_ps(
      _mm512_fmadd_ps(x, _mm512_set1_ps(1.44269504088896341f), _mm512_set1_ps(0.5f)),
      _MM_FROUND_TO_NEG_INF | _MM_FROUND_NO_EXC);
  __m512 r = _mm512_fnmadd_ps(fn, _mm512_set1_ps(0.693359375f), x);
  r = _mm512_fmadd_ps(fn, _mm512_set1_ps(2.12194440e-4f), r);
  __m512 p = _mm512_set1_ps(1.9875691500e-4f);
  p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(1.3981999507e-3f));
  p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(8.3334519073e-3f));
  p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(4.1665795894e-2f));
  p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(1.6666665459e-1f));
  p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(5.0000001201e-1f));
  p = _mm512_fmadd_ps(p, _mm512_mul_ps(r, r), _mm512_add_ps(r, _mm512_set1_ps(1.0f)));
  return _mm512_scalef_ps(p, fn);
}

// Keys of a tile visible to its row r: element (r, c) is visible iff c <= r + diag, where diag is
// the query position of row 0 minus the key position of column 0 (causal: key <= query).
inline i64 visible(i64 r, i64 diag, i64 nk) {
  const i64 v = r + diag + 1;
  return v < 0 ? 0 : (v > nk ? nk : v);
}

// Rows [0, n) of src (row stride ld, D columns) in bf16: natural rows nat (n, ceil(D/2)) and,
// when rp is not null, row pairs rp (ceil(n/2), D) (a missing last row is 0). When `other` is not
// null, also dots[r] = sum_d src[r][d] other[r][d] in fp32 (other: row stride ld).
void pack_tile(u32* nat, u32* rp, const float* src, i64 n, i64 D, i64 ld, const float* other,
               float* dots) {
  const i64 dp = (D + 1) / 2;
  for (i64 r = 0; r < n; r += 2) {
    const bool has_b = r + 1 < n;
    const float* a = src + r * ld;
    const float* b = a + ld;
    auto* na = reinterpret_cast<std::uint16_t*>(nat + r * dp);
    auto* nb = na + 2 * dp;
    __m512 da = _mm512_setzero_ps(), db = _mm512_setzero_ps();
    for (i64 c = 0; c < D; c += 16) {
      const __mmask16 m = lanes(D - c), mp = lanes(2 * dp - c);
      const __m512 lo = load_first(a + c, D - c);
      const __m512 hi = has_b ? load_first(b + c, D - c) : _mm512_setzero_ps();
      _mm256_mask_storeu_epi16(na + c, mp, to_bf16(lo));
      if (has_b) _mm256_mask_storeu_epi16(nb + c, mp, to_bf16(hi));
      if (rp != nullptr)
        _mm512_mask_storeu_epi32(rp + (r / 2) * D + c, m, interleave_pairs(lo, hi));
      if (other != nullptr) {
        da = _mm512_fmadd_ps(lo, load_first(other + r * ld + c, D - c), da);
        if (has_b) db = _mm512_fmadd_ps(hi, load_first(other + (r + 1) * ld + c, D - c), db);
      }
    }
    if (other != nullptr) {
      dots[r] = _mm512_reduce_add_ps(da);
      if (has_b) dots[r + 1] = _mm512_reduce_add_ps(db);
    }
  }
}

// Forward, one score tile S (nq, nk) (row r visible up to column r + diag): online softmax step
// of the running max m (nq) and sum l (nq), writing P = exp(S - m) as bf16 natural rows p
// (nq, ceil(nk/2) pairs; masked entries 0). Only visible entries of S are read. On the first key
// tile m and l are set (the output is then written, not accumulated); on later ones rows of o
// (row stride ld_o, D columns) whose max grew are rescaled.
void softmax_to_bf16(const float* S, i64 nq, i64 nk, i64 diag, float* m, float* l, bool first,
                     u32* p, float* o, i64 ld_o, i64 D) {
  const i64 kp = (nk + 1) / 2;
  const __m512 neg_inf = _mm512_set1_ps(-__builtin_inff());
  for (i64 r = 0; r < nq; ++r) {
    const float* srow = S + r * nk;
    auto* prow = reinterpret_cast<std::uint16_t*>(p + r * kp);
    const i64 nv = visible(r, diag, nk);
    // Two independent chains per pass (32 columns a step); only the last 16 columns are masked.
    __m512 mx0 = neg_inf, mx1 = neg_inf;
    i64 c = 0;
    for (; c + 32 <= nv; c += 32) {
      mx0 = _mm512_max_ps(mx0, _mm512_loadu_ps(srow + c));
      mx1 = _mm512_max_ps(mx1, _mm512_loadu_ps(srow + c + 16));
    }
    for (; c < nv; c += 16)
      mx0 = _mm512_max_ps(mx0, _mm512_mask_loadu_ps(neg_inf, lanes(nv - c), srow + c));
    const float m_old = first ? -__builtin_inff() : m[r];
    const float m_tile = _mm512_reduce_max_ps(_mm512_max_ps(mx0, mx1));
    const float m_new = nv > 0 && m_tile > m_old ? m_tile : m_old;
    const __m512 mv = _mm512_set1_ps(m_new);
    __m512 sum0 = _mm512_setzero_ps(), sum1 = _mm512_setzero_ps();
    for (c = 0; c + 32 <= nv; c += 32) {
      const __m512 e0 = exp_neg16(_mm512_sub_ps(_mm512_loadu_ps(srow + c), mv));
      const __m512 e1 = exp_neg16(_mm512_sub_ps(_mm512_loadu_ps(srow + c + 16), mv));
      sum0 = _mm512_add_ps(sum0, e0);
      sum1 = _mm512_add_ps(sum1, e1);
      _mm512_storeu_si512(prow + c, (__m512i)_mm512_cvtne2ps_pbh(e1, e0));
    }
    for (; c < nv; c += 16) {
      const __mmask16 vis = lanes(nv - c);
      const __m512 e = _mm512_maskz_mov_ps(
          vis, exp_neg16(_mm512_sub_ps(_mm512_maskz_loadu_ps(vis, srow + c), mv)));
      sum0 = _mm512_add_ps(sum0, e);
      _mm256_mask_storeu_epi16(prow + c, lanes(2 * kp - c), to_bf16(e));
    }
    for (; c < 2 * kp; c += 16)  // masked keys, up to the padded pair
      _mm256_mask_storeu_epi16(prow + c, lanes(2 * kp - c), _mm256_setzero_si256());
    const float s = _mm512_reduce_add_ps(_mm512_add_ps(sum0, sum1));
    if (first) {
      m[r] = m_new, l[r] = s;
      continue;
    }
    if (m_new > m_old) {  // the max grew: rescale what was accumulated so far
      const float alpha = m_old == -__builtin_inff() ? 0.0f : __builtin_expf(m_old - m_new);
      l[r] *= alpha;
      float* orow = o + r * ld_o;
      for (i64 d = 0; d < D; d += 16) {
        const __mmask16 md = lanes(D - d);
        _mm512_mask_storeu_ps(
            orow + d, md,
            _mm512_mul_ps(_mm512_maskz_loadu_ps(md, orow + d), _mm512_set1_ps(alpha)));
      }
      m[r] = m_new;
    }
    l[r] += s;
  }
}

// Backward, P = exp(S - lse[r]) (masked entries 0) in place over the visible part of S (nq, nk)
// and P as bf16 row pairs pr (ceil(nq/2), nk) (a missing last row is 0).
void exp_to_bf16_pairs(float* S, i64 nq, i64 nk, i64 diag, const float* lse, u32* pr) {
  for (i64 r = 0; r < nq; r += 2) {
    const bool has_b = r + 1 < nq;
    float* a = S + r * nk;
    float* b = a + nk;
    u32* out = pr + (r / 2) * nk;
    const i64 na = visible(r, diag, nk), nb = has_b ? visible(r + 1, diag, nk) : 0;
    const __m512 la = _mm512_set1_ps(lse[r]), lb = _mm512_set1_ps(has_b ? lse[r + 1] : 0.0f);
    i64 c = 0;
    for (; c + 16 <= na && c + 16 <= nb; c += 16) {  // both rows fully visible: no masks
      const __m512 ea = exp_neg16(_mm512_sub_ps(_mm512_loadu_ps(a + c), la));
      const __m512 eb = exp_neg16(_mm512_sub_ps(_mm512_loadu_ps(b + c), lb));
      _mm512_storeu_ps(a + c, ea);
      _mm512_storeu_ps(b + c, eb);
      _mm512_storeu_si512(out + c, interleave_pairs(ea, eb));
    }
    for (; c < nk; c += 16) {
      const __mmask16 va = lanes(na - c), vb = lanes(nb - c);
      __m512 ea = _mm512_setzero_ps(), eb = _mm512_setzero_ps();
      if (va != 0) {
        ea =
            _mm512_maskz_mov_ps(va, exp_neg16(_mm512_sub_ps(_mm512_maskz_loadu_ps(va, a + c), la)));
        _mm512_mask_storeu_ps(a + c, va, ea);
      }
      if (vb != 0) {
        eb =
            _mm512_maskz_mov_ps(vb, exp_neg16(_mm512_sub_ps(_mm512_maskz_loadu_ps(vb, b + c), lb)));
        _mm512_mask_storeu_ps(b + c, vb, eb);
      }
      _mm512_mask_storeu_epi32(out + c, lanes(nk - c), interleave_pairs(ea, eb));
    }
  }
}

// Backward, dS = P * (dP - dvec[r]) over the visible entries (masked 0) of the tiles P, dP
// (nq, nk), as bf16 natural rows dn (nq, ceil(nk/2) pairs) and row pairs dr (ceil(nq/2), nk).
void ds_to_bf16(const float* dP, const float* P, i64 nq, i64 nk, i64 diag, const float* dvec,
                u32* dn, u32* dr) {
  const i64 kp = (nk + 1) / 2;
  for (i64 r = 0; r < nq; r += 2) {
    const bool has_b = r + 1 < nq;
    const i64 na = visible(r, diag, nk), nb = has_b ? visible(r + 1, diag, nk) : 0;
    const __m512 dva = _mm512_set1_ps(dvec[r]), dvb = _mm512_set1_ps(has_b ? dvec[r + 1] : 0.0f);
    auto* ra = reinterpret_cast<std::uint16_t*>(dn + r * kp);
    auto* rb = ra + 2 * kp;
    u32* out = dr + (r / 2) * nk;
    const float *pa = P + r * nk, *pb = pa + nk, *dpa = dP + r * nk, *dpb = dpa + nk;
    i64 c = 0;
    for (; c + 16 <= na && c + 16 <= nb; c += 16) {  // both rows fully visible: no masks
      const __m512 sa =
          _mm512_mul_ps(_mm512_loadu_ps(pa + c), _mm512_sub_ps(_mm512_loadu_ps(dpa + c), dva));
      const __m512 sb =
          _mm512_mul_ps(_mm512_loadu_ps(pb + c), _mm512_sub_ps(_mm512_loadu_ps(dpb + c), dvb));
      _mm256_storeu_si256(reinterpret_cast<__m256i*>(ra + c), to_bf16(sa));
      _mm256_storeu_si256(reinterpret_cast<__m256i*>(rb + c), to_bf16(sb));
      _mm512_storeu_si512(out + c, interleave_pairs(sa, sb));
    }
    for (; c < 2 * kp; c += 16) {
      const __mmask16 va = lanes(na - c), vb = lanes(nb - c), wide = lanes(2 * kp - c);
      const __m512 sa = _mm512_mul_ps(_mm512_maskz_loadu_ps(va, pa + c),
                                      _mm512_sub_ps(_mm512_maskz_loadu_ps(va, dpa + c), dva));
      const __m512 sb = _mm512_mul_ps(_mm512_maskz_loadu_ps(vb, pb + c),
                                      _mm512_sub_ps(_mm512_maskz_loadu_ps(vb, dpb + c), dvb));
      _mm256_mask_storeu_epi16(ra + c, wide, to_bf16(sa));
      if (has_b) _mm256_mask_storeu_epi16(rb + c, wide, to_bf16(sb));
      _mm512_mask_storeu_epi32(out + c, lanes(nk - c), interleave_pairs(sa, sb));
    }
  }
}

// ---- tile products ---------------------------------------------------------------------------

// C (MR, 16 NV) of one register block: A pair (r, p) at a[r * a_rs + p * a_ps], B pair (p, n)
// at b[p * ldb + n]; the last 16 columns are masked by `tail`. C = (or += when accumulate)
// alpha * row_scale[r] * A B, with row_scale null meaning 1.
template <int MR, int NV>
void block(i64 np, const u32* a, i64 a_rs, i64 a_ps, const u32* b, i64 ldb, float* c, i64 ldc,
           float alpha, const float* row_scale, bool accumulate, __mmask16 tail) {
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
#pragma GCC unroll 8
  for (int r = 0; r < MR; ++r) {
    const __m512 al = _mm512_set1_ps(row_scale != nullptr ? alpha * row_scale[r] : alpha);
#pragma GCC unroll 4
    for (int v = 0; v < NV; ++v) {
      const __mmask16 m = v == NV - 1 ? tail : 0xFFFF;
      float* cp = c + r * ldc + 16 * v;
      const __m512 x = accumulate ? _mm512_fmadd_ps(acc[r][v], al, _mm512_maskz_loadu_ps(m, cp))
                                  : _mm512_mul_ps(acc[r][v], al);
      _mm512_mask_storeu_ps(cp, m, x);
    }
  }
}

using BlockFn = void (*)(i64, const u32*, i64, i64, const u32*, i64, float*, i64, float,
                         const float*, bool, __mmask16);
constexpr int kRows = 6;  // 6 x 4 accumulators: enough in flight to hide vdpbf16ps latency

template <int MR>
BlockFn block_for(i64 nv) {
  switch (nv) {
    case 1:
      return block<MR, 1>;
    case 2:
      return block<MR, 2>;
    case 3:
      return block<MR, 3>;
    default:
      return block<MR, 4>;
  }
}

BlockFn block_for(i64 mr, i64 nv) {
  switch (mr) {
    case 1:
      return block_for<1>(nv);
    case 2:
      return block_for<2>(nv);
    case 3:
      return block_for<3>(nv);
    case 4:
      return block_for<4>(nv);
    case 5:
      return block_for<5>(nv);
    default:
      return block_for<6>(nv);
  }
}

// Which part of a causal tile product is computed, with diag as in visible():
//   kColsUpTo    C rows are queries, columns keys: row r needs only columns c <= r + diag (the
//                rest of C is left unwritten);
//   kPairsUpTo   A rows are queries, K keys: A (r, k) is 0 for k > r + diag, so those pairs
//                are skipped;
//   kPairsFrom   A rows are keys, K queries: A (r, k) is 0 for k < r - diag, skipped likewise.
// Skipped products are exact zeros, so only the register blocks' granularity (kRows rows, 16
// columns, 2 keys) decides how much masked work is still done.
enum class Causal { kColsUpTo, kPairsUpTo, kPairsFrom };

// C (M, N) (=, or += when accumulate) alpha * A (M, 2 np) B (2 np, N) in blocks of kRows x 64;
// row_scale (M), when not null, scales the rows of the product.
void product(i64 M, i64 N, i64 np, const u32* a, i64 a_rs, i64 a_ps, const u32* b, i64 ldb,
             float* c, i64 ldc, float alpha, bool accumulate, Causal causal, i64 diag,
             const float* row_scale = nullptr) {
  for (i64 n0 = 0; n0 < N; n0 += 64) {
    for (i64 r0 = 0; r0 < M; r0 += kRows) {
      const i64 mr = imin(kRows, M - r0), last = r0 + mr - 1;
      i64 n_end = N, p_beg = 0, p_end = np;
      if (causal == Causal::kColsUpTo) n_end = imin(N, last + diag + 1);
      if (causal == Causal::kPairsUpTo) p_end = imin(np, (last + diag + 2) / 2);
      if (causal == Causal::kPairsFrom && r0 > diag) p_beg = imin(np, (r0 - diag) / 2);
      const i64 nn = imin(64, n_end - n0);
      if (nn <= 0) continue;
      if (p_end <= p_beg && accumulate) continue;
      const i64 nv = (nn + 15) / 16;
      block_for(mr, nv)(imax(0, p_end - p_beg), a + r0 * a_rs + p_beg * a_ps, a_rs, a_ps,
                        b + p_beg * ldb + n0, ldb, c + r0 * ldc + n0, ldc, alpha,
                        row_scale != nullptr ? row_scale + r0 : nullptr, accumulate,
                        lanes(nn - 16 * (nv - 1)));
    }
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
  const float* qh = q + b * hd.T * hd.ld_q + h * D;                   // (T, D) stride ld_q
  const float* kh = k + b * hd.keys * hd.ld_kv + (h / hd.group) * D;  // (keys, D) stride ld_kv
  const float* vh = v + b * hd.keys * hd.ld_kv + (h / hd.group) * D;  // (keys, D) stride ld_kv
  float* oh = out + b * hd.T * hd.ld_q + h * D;                       // (T, D) stride ld_q
  float* lse_h = lse + (b * s.n_heads + h) * hd.T;                    // (T)
  pack_col_pairs(buf.k_cols, kh, hd.used, D, hd.ld_kv, buf.ldk);
  pack_row_pairs(buf.v_rows, vh, hd.used, D, hd.ld_kv);
  for (i64 i0 = 0; i0 < hd.T; i0 += tq) {
    const i64 nq = imin(tq, hd.T - i0), p0 = s.q_pos + i0;
    float* oi = oh + i0 * hd.ld_q;
    pack_tile(buf.q_nat, nullptr, qh + i0 * hd.ld_q, nq, D, hd.ld_q, nullptr, nullptr);
    for (i64 j0 = 0; j0 < p0 + nq; j0 += tk) {  // key tiles up to the diagonal
      const i64 nk = imin(tk, p0 + nq - j0), kp = (nk + 1) / 2, diag = p0 - j0;
      // S (nq, nk) = scale q_i k_j^T
      product(nq, nk, hd.dp, buf.q_nat, hd.dp, 1, buf.k_cols + j0, buf.ldk, buf.s, nk, hd.scale,
              false, Causal::kColsUpTo, diag);
      softmax_to_bf16(buf.s, nq, nk, diag, buf.m, buf.l, j0 == 0, buf.p_nat, oi, hd.ld_q, D);
      const bool last = j0 + nk == p0 + nq, only = last && j0 == 0;
      if (last) {  // l is final
        for (i64 r = 0; r < nq; ++r) {
          lse_h[i0 + r] = buf.m[r] + __builtin_logf(buf.l[r]);
          buf.l[r] = 1.0f / buf.l[r];
        }
      }
      // o_i (nq, D) (= on the first key tile, else +=) P (nq, nk) v_j (nk, D); an only key tile
      // stores o_i / l directly
      product(nq, D, kp, buf.p_nat, kp, 1, buf.v_rows + (j0 / 2) * D, D, oi, hd.ld_q, 1.0f, j0 > 0,
              Causal::kPairsUpTo, diag, only ? buf.l : nullptr);
      if (!last || only) continue;
      for (i64 r = 0; r < nq; ++r) {  // o_i /= l
        const __m512 inv = _mm512_set1_ps(buf.l[r]);
        float* orow = oi + r * hd.ld_q;
        for (i64 d = 0; d < D; d += 16) {
          const __mmask16 md = lanes(D - d);
          _mm512_mask_storeu_ps(orow + d, md,
                                _mm512_mul_ps(_mm512_maskz_loadu_ps(md, orow + d), inv));
        }
      }
    }
  }
}

void attention_backward_group_bf16(float* dq, float* dk, float* dv, const float* dout,
                                   const float* q, const float* k, const float* v, const float* out,
                                   const float* lse, const Bf16AttentionBuffers& buf,
                                   const AttentionShape& s, i64 b, i64 kvh) {
  const Head hd = head_of(s);
  const i64 tq = s.tile, tk = buf.key_tile, D = hd.D, kv_off = b * hd.keys * hd.ld_kv + kvh * D;
  pack_col_pairs(buf.k_cols, k + kv_off, hd.used, D, hd.ld_kv, buf.ldk);
  pack_row_pairs(buf.k_rows, k + kv_off, hd.used, D, hd.ld_kv);
  pack_col_pairs(buf.v_cols, v + kv_off, hd.used, D, hd.ld_kv, buf.ldk);
  float* dkh = dk + kv_off;            // (keys, D) stride ld_kv
  float* dvh = dv + kv_off;            // (keys, D) stride ld_kv
  for (i64 j = 0; j < hd.keys; ++j) {  // accumulated below; rows past `used` stay 0
    std::memset(dkh + j * hd.ld_kv, 0, static_cast<std::size_t>(D) * sizeof(float));
    std::memset(dvh + j * hd.ld_kv, 0, static_cast<std::size_t>(D) * sizeof(float));
  }
  for (i64 h = kvh * hd.group; h < (kvh + 1) * hd.group; ++h) {
    const i64 q_off = b * hd.T * hd.ld_q + h * D;
    const float* lse_h = lse + (b * s.n_heads + h) * hd.T;  // (T)
    for (i64 i0 = 0; i0 < hd.T; i0 += tq) {
      const i64 nq = imin(tq, hd.T - i0), qp = (nq + 1) / 2, p0 = s.q_pos + i0;
      const i64 at = q_off + i0 * hd.ld_q;  // row i0 of this head in q, out, dout, dq
      pack_tile(buf.q_nat, buf.q_rows, q + at, nq, D, hd.ld_q, nullptr, nullptr);
      // dout tile, and buf.m = rowsum(dO * O)
      pack_tile(buf.do_nat, buf.do_rows, dout + at, nq, D, hd.ld_q, out + at, buf.m);
      for (i64 j0 = 0; j0 < p0 + nq; j0 += tk) {
        const i64 nk = imin(tk, p0 + nq - j0), kp = (nk + 1) / 2, diag = p0 - j0;
        float* dkj = dkh + j0 * hd.ld_kv;
        // P (nq, nk) = exp(scale q_i k_j^T - lse)
        product(nq, nk, hd.dp, buf.q_nat, hd.dp, 1, buf.k_cols + j0, buf.ldk, buf.s, nk, hd.scale,
                false, Causal::kColsUpTo, diag);
        exp_to_bf16_pairs(buf.s, nq, nk, diag, lse_h + i0, buf.p_rows);
        // dv_j (nk, D) += P^T (nk, nq) do_i (nq, D)
        product(nk, D, qp, buf.p_rows, 1, nk, buf.do_rows, D, dvh + j0 * hd.ld_kv, hd.ld_kv, 1.0f,
                true, Causal::kPairsFrom, diag);
        // dP (nq, nk) = do_i v_j^T, then dS = P * (dP - rowsum(dO * O))
        product(nq, nk, hd.dp, buf.do_nat, hd.dp, 1, buf.v_cols + j0, buf.ldk, buf.dp, nk, 1.0f,
                false, Causal::kColsUpTo, diag);
        ds_to_bf16(buf.dp, buf.s, nq, nk, diag, buf.m, buf.p_nat, buf.p_rows);
        // dq_i (nq, D) (= on the first key tile, else +=) scale dS k_j;  dk_j (nk, D) += scale
        // dS^T q_i
        product(nq, D, kp, buf.p_nat, kp, 1, buf.k_rows + (j0 / 2) * D, D, dq + at, hd.ld_q,
                hd.scale, j0 > 0, Causal::kPairsUpTo, diag);
        product(nk, D, qp, buf.p_rows, 1, nk, buf.q_rows, D, dkj, hd.ld_kv, hd.scale, true,
                Causal::kPairsFrom, diag);
      }
    }
  }
}

}  // namespace t3d::kernels::detail
