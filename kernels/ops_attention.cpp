// Causal grouped-query attention, tiled with an online softmax (flash-attention 2 on a CPU).
//
// Per (batch, query head) the T x T score matrix is never formed: for each query tile of `tile`
// rows we stream over key tiles up to the diagonal, keep a running row max m and row sum l, and
// rescale the partial output when m grows. Forward saves only out and lse = m + log(l); backward
// recomputes P = exp(S - lse) tile by tile. Tile products are sgemm calls on strided views of
// q/k/v (a head is D columns of a (T, heads * D) matrix), so nothing is copied.
#include <algorithm>
#include <bit>
#include <cmath>
#include <cstring>
#include <limits>

#include "kernels/blas.h"
#include "kernels/check.h"
#include "kernels/ops.h"

namespace t3d::kernels {
namespace {

constexpr float kNegInf = -std::numeric_limits<float>::infinity();

// exp for x <= 0 (scores minus their max), branch-free so the row loops vectorise; libm's expf
// does not, and the T^2/2 exponentials would otherwise cost more than the GEMMs.
// Cephes expf polynomial: rel. error ~2e-7 on the range used here; exp(-inf) -> ~1e-38, which
// callers never rely on (masked entries are set to 0 explicitly).
inline float exp_neg(float x) {
  x = x > -87.0f ? x : -87.0f;
  // floor(x log2 e + 0.5) via truncation of a positive number (cvttps vectorises on SSE2).
  const float fn = static_cast<float>(static_cast<int>(x * 1.44269504088896341f + 128.5f)) - 128.0f;
  const float r = x - fn * 0.693359375f + fn * 2.12194440e-4f;
  float p = 1.9875691500e-4f;
  p = p * r + 1.3981999507e-3f;
  p = p * r + 8.3334519073e-3f;
  p = p * r + 4.1665795894e-2f;
  p = p * r + 1.6666665459e-1f;
  p = p * r + 5.0000001201e-1f;
  p = p * r * r + r + 1.0f;
  // 2^fn built in the exponent field; bit_cast (not memcpy) keeps the loop vectorisable.
  return p * std::bit_cast<float>((static_cast<std::int32_t>(fn) + 127) << 23);
}

// The row loops below are the non-GEMM cost of attention (T^2/2 exponentials per head).
// `omp simd` (-fopenmp-simd: SIMD only, no OpenMP runtime or threads) lets the float reductions
// vectorise, and -fno-trapping-math lets the clamp in exp_neg become a select. The build has no
// -march=native, so this is SSE2 width; GCC 12's target_clones did not vectorise exp_neg in the
// AVX clones (measured), so wider dispatch is left for later.

float row_max(const float* x, std::int64_t n) {
  float m = kNegInf;
#pragma omp simd reduction(max : m)
  for (std::int64_t c = 0; c < n; ++c) m = std::max(m, x[c]);
  return m;
}

// x = exp(x - sub), returns the sum of the new x.
float exp_sub_sum(float* x, std::int64_t n, float sub) {
  float sum = 0.0f;
#pragma omp simd reduction(+ : sum)
  for (std::int64_t c = 0; c < n; ++c) {
    x[c] = exp_neg(x[c] - sub);
    sum += x[c];
  }
  return sum;
}

void exp_sub(float* x, std::int64_t n, float sub) {
#pragma omp simd
  for (std::int64_t c = 0; c < n; ++c) x[c] = exp_neg(x[c] - sub);
}

// ds = p * (dp - dvec), in place over dp.
void softmax_grad_row(float* dp, const float* p, std::int64_t n, float dvec) {
#pragma omp simd
  for (std::int64_t c = 0; c < n; ++c) dp[c] = p[c] * (dp[c] - dvec);
}

float dot(const float* a, const float* b, std::int64_t n) {
  float s = 0.0f;
#pragma omp simd reduction(+ : s)
  for (std::int64_t c = 0; c < n; ++c) s += a[c] * b[c];
  return s;
}

// Number of keys of tile [j0, j0 + nk) visible to query position tq (causal: key <= query).
inline std::int64_t visible(std::int64_t tq, std::int64_t j0, std::int64_t nk) {
  return std::clamp<std::int64_t>(tq - j0 + 1, 0, nk);
}

// Strided views of one (batch, head): base pointers and row strides.
struct HeadView {
  std::int64_t q_off, kv_off, ld_q, ld_kv;
};

void check_shape(const AttentionShape& s) {
  T3D_USER_CHECK(s.n_kv_heads > 0 && s.n_heads % s.n_kv_heads == 0, "n_heads (", s.n_heads,
                 ") must be a positive multiple of n_kv_heads (", s.n_kv_heads, ")");
  T3D_ASSERT(s.B > 0 && s.T > 0 && s.head_dim > 0 && s.tile > 0, "attention shape B=", s.B,
             " T=", s.T, " D=", s.head_dim, " tile=", s.tile);
}

HeadView head_view(const AttentionShape& s, std::int64_t b, std::int64_t h) {
  const std::int64_t group = s.n_heads / s.n_kv_heads;
  const std::int64_t ld_q = s.n_heads * s.head_dim, ld_kv = s.n_kv_heads * s.head_dim;
  return {b * s.T * ld_q + h * s.head_dim, b * s.T * ld_kv + (h / group) * s.head_dim, ld_q, ld_kv};
}

}  // namespace

std::int64_t attention_scratch_floats(const AttentionShape& s) {
  // forward: S (tile, tile), m (tile), l (tile); backward: P, dP (tile, tile), Dvec (tile).
  return 2 * s.tile * s.tile + 2 * s.tile;
}

void attention_forward(float* out, float* lse, const float* q, const float* k, const float* v,
                       float* scratch, const AttentionShape& s) {
  check_shape(s);
  const std::int64_t T = s.T, D = s.head_dim, tile = s.tile;
  const float sm_scale = 1.0f / std::sqrt(static_cast<float>(D));
  float* S = scratch;          // S (tile, tile): scores, then probabilities
  float* m = S + tile * tile;  // m (tile): running row max
  float* l = m + tile;         // l (tile): running row sum of exp(S - m)
  for (std::int64_t b = 0; b < s.B; ++b) {
    for (std::int64_t h = 0; h < s.n_heads; ++h) {
      const HeadView hv = head_view(s, b, h);
      const float* qh = q + hv.q_off;                // qh (T, D), row stride ld_q
      const float* kh = k + hv.kv_off;               // kh (T, D), row stride ld_kv
      const float* vh = v + hv.kv_off;               // vh (T, D), row stride ld_kv
      float* oh = out + hv.q_off;                    // oh (T, D), row stride ld_q
      float* lse_h = lse + (b * s.n_heads + h) * T;  // lse_h (T)
      for (std::int64_t i0 = 0; i0 < T; i0 += tile) {
        const std::int64_t nq = std::min(tile, T - i0);
        for (std::int64_t r = 0; r < nq; ++r) {
          m[r] = kNegInf;
          l[r] = 0.0f;
          std::memset(oh + (i0 + r) * hv.ld_q, 0, static_cast<std::size_t>(D) * sizeof(float));
        }
        for (std::int64_t j0 = 0; j0 < i0 + nq; j0 += tile) {  // key tiles up to the diagonal
          const std::int64_t nk = std::min(tile, T - j0);
          // S (nq, nk) = scale * q_i (nq, D) k_j^T (D, nk)
          sgemm(Trans::kNo, Trans::kYes, nq, nk, D, sm_scale, qh + i0 * hv.ld_q, hv.ld_q,
                kh + j0 * hv.ld_kv, hv.ld_kv, 0.0f, S, nk);
          for (std::int64_t r = 0; r < nq; ++r) {
            float* srow = S + r * nk;
            const std::int64_t nv = visible(i0 + r, j0, nk);
            const float m_new = std::max(m[r], row_max(srow, nv));
            const float sum = exp_sub_sum(srow, nv, m_new);
            for (std::int64_t c = nv; c < nk; ++c) srow[c] = 0.0f;  // causal mask
            if (m_new > m[r]) {  // the max grew: rescale what was accumulated so far
              const float alpha = m[r] == kNegInf ? 0.0f : exp_neg(m[r] - m_new);
              l[r] *= alpha;
              float* orow = oh + (i0 + r) * hv.ld_q;
              for (std::int64_t d = 0; d < D; ++d) orow[d] *= alpha;
              m[r] = m_new;
            }
            l[r] += sum;
          }
          // o_i (nq, D) += P (nq, nk) v_j (nk, D)
          sgemm(Trans::kNo, Trans::kNo, nq, D, nk, 1.0f, S, nk, vh + j0 * hv.ld_kv, hv.ld_kv, 1.0f,
                oh + i0 * hv.ld_q, hv.ld_q);
        }
        for (std::int64_t r = 0; r < nq; ++r) {
          const float inv = 1.0f / l[r];
          float* orow = oh + (i0 + r) * hv.ld_q;
          for (std::int64_t d = 0; d < D; ++d) orow[d] *= inv;
          lse_h[i0 + r] = m[r] + std::log(l[r]);
        }
      }
    }
  }
}

// With P = softmax(S), O = P V and S = scale q k^T:
//   dV = P^T dO,  dP = dO V^T,  dS = P * (dP - rowsum(dO * O)),  dQ = scale dS K,  dK = scale dS^T
//   Q.
// Query heads of one group share k and v, so their dK, dV accumulate into the same rows.
void attention_backward(float* dq, float* dk, float* dv, const float* dout, const float* q,
                        const float* k, const float* v, const float* out, const float* lse,
                        float* scratch, const AttentionShape& s) {
  check_shape(s);
  const std::int64_t T = s.T, D = s.head_dim, tile = s.tile;
  const float sm_scale = 1.0f / std::sqrt(static_cast<float>(D));
  // Activation gradients are written (=), but the tiles accumulate into them: zero first.
  zero(dq, s.B * T * s.n_heads * D);
  zero(dk, s.B * T * s.n_kv_heads * D);
  zero(dv, s.B * T * s.n_kv_heads * D);
  float* P = scratch;              // P (tile, tile)
  float* dP = P + tile * tile;     // dP (tile, tile), becomes dS
  float* Dvec = dP + tile * tile;  // Dvec (tile): rowsum(dO * O)
  for (std::int64_t b = 0; b < s.B; ++b) {
    for (std::int64_t h = 0; h < s.n_heads; ++h) {
      const HeadView hv = head_view(s, b, h);
      const float* qh = q + hv.q_off;                      // (T, D) stride ld_q
      const float* kh = k + hv.kv_off;                     // (T, D) stride ld_kv
      const float* vh = v + hv.kv_off;                     // (T, D) stride ld_kv
      const float* oh = out + hv.q_off;                    // (T, D) stride ld_q
      const float* doh = dout + hv.q_off;                  // (T, D) stride ld_q
      float* dqh = dq + hv.q_off;                          // (T, D) stride ld_q
      float* dkh = dk + hv.kv_off;                         // (T, D) stride ld_kv
      float* dvh = dv + hv.kv_off;                         // (T, D) stride ld_kv
      const float* lse_h = lse + (b * s.n_heads + h) * T;  // (T)
      for (std::int64_t i0 = 0; i0 < T; i0 += tile) {
        const std::int64_t nq = std::min(tile, T - i0);
        for (std::int64_t r = 0; r < nq; ++r) {
          const float* o = oh + (i0 + r) * hv.ld_q;
          const float* d = doh + (i0 + r) * hv.ld_q;
          Dvec[r] = dot(o, d, D);
        }
        for (std::int64_t j0 = 0; j0 < i0 + nq; j0 += tile) {
          const std::int64_t nk = std::min(tile, T - j0);
          const float* qi = qh + i0 * hv.ld_q;
          const float* doi = doh + i0 * hv.ld_q;
          const float* kj = kh + j0 * hv.ld_kv;
          const float* vj = vh + j0 * hv.ld_kv;
          // P (nq, nk) = exp(scale q_i k_j^T - lse)
          sgemm(Trans::kNo, Trans::kYes, nq, nk, D, sm_scale, qi, hv.ld_q, kj, hv.ld_kv, 0.0f, P,
                nk);
          for (std::int64_t r = 0; r < nq; ++r) {
            float* prow = P + r * nk;
            const std::int64_t nv = visible(i0 + r, j0, nk);
            exp_sub(prow, nv, lse_h[i0 + r]);
            for (std::int64_t c = nv; c < nk; ++c) prow[c] = 0.0f;
          }
          // dv_j (nk, D) += P^T (nk, nq) do_i (nq, D)
          sgemm(Trans::kYes, Trans::kNo, nk, D, nq, 1.0f, P, nk, doi, hv.ld_q, 1.0f,
                dvh + j0 * hv.ld_kv, hv.ld_kv);
          // dP (nq, nk) = do_i (nq, D) v_j^T (D, nk)
          sgemm(Trans::kNo, Trans::kYes, nq, nk, D, 1.0f, doi, hv.ld_q, vj, hv.ld_kv, 0.0f, dP, nk);
          for (std::int64_t r = 0; r < nq; ++r) {  // dS = P * (dP - Dvec); masked P are 0
            softmax_grad_row(dP + r * nk, P + r * nk, nk, Dvec[r]);
          }
          // dq_i (nq, D) += scale dS (nq, nk) k_j (nk, D)
          sgemm(Trans::kNo, Trans::kNo, nq, D, nk, sm_scale, dP, nk, kj, hv.ld_kv, 1.0f,
                dqh + i0 * hv.ld_q, hv.ld_q);
          // dk_j (nk, D) += scale dS^T (nk, nq) q_i (nq, D)
          sgemm(Trans::kYes, Trans::kNo, nk, D, nq, sm_scale, dP, nk, qi, hv.ld_q, 1.0f,
                dkh + j0 * hv.ld_kv, hv.ld_kv);
        }
      }
    }
  }
}

}  // namespace t3d::kernels
