// The non-GEMM inner loops of attention, SwiGLU, RMSNorm and AdamW, compiled three times (SSE2,
// AVX2+FMA, AVX-512) and picked once at run time by the CPU's features. Internal to kernels/.
//
// The build has no -march (the binary must run on any x86-64), so without this the `omp simd`
// loops are SSE2 width. Each version lives in its own translation unit (simd_rows_<isa>.cpp,
// compiled with that ISA's flags, from simd_rows.inc); everything they define is internal to
// the unit, so no AVX-512 copy of an inline function can leak into baseline code.
#pragma once

#include <cstdint>

#include "kernels/row_math.h"

namespace t3d::kernels::detail {

struct SimdRows {
  const char* isa;
  // Forward, one score tile S (nq, nk) of query rows i0.. and key columns j0.. (causal): online
  // softmax update of the running max m (nq) and sum l (nq), S becomes P (masked entries 0), and
  // rows of the output o (row stride ld_o, D columns) are rescaled when their max grows.
  void (*softmax_tile_fwd)(float* S, std::int64_t nq, std::int64_t nk, std::int64_t i0,
                           std::int64_t j0, float* m, float* l, float* o, std::int64_t ld_o,
                           std::int64_t D);
  // Backward, P (nq, nk) = exp(S - lse[r]) with the causal mask (masked entries 0).
  void (*exp_tile_bwd)(float* P, std::int64_t nq, std::int64_t nk, std::int64_t i0, std::int64_t j0,
                       const float* lse);
  // dS = P * (dP - dvec[r]), in place over dP (nq, nk).
  void (*softmax_grad_tile)(float* dP, const float* P, std::int64_t nq, std::int64_t nk,
                            const float* dvec);
  // dvec[r] = dot(o row r, do row r) over D columns, rows of stride ld.
  void (*row_dots)(float* dvec, const float* o, const float* dout, std::int64_t nq, std::int64_t ld,
                   std::int64_t D);
  // SwiGLU over a range [0, n).
  void (*swiglu_fwd)(float* h, const float* gate, const float* up, std::int64_t n);
  void (*swiglu_bwd)(float* dgate, float* dup, const float* dh, const float* gate, const float* up,
                     std::int64_t n);
  // fp32 <-> bf16 over [0, n), bit-identical to kernels/precision.h's scalar conversions.
  void (*to_bf16)(std::uint16_t* out, const float* in, std::int64_t n);
  void (*from_bf16)(float* out, const std::uint16_t* in, std::int64_t n);
  // RMSNorm over `rows` rows of C (kernels/ops.h): forward writes out and rstd, backward writes
  // dinp or (accumulate) adds its value to it. The row sums run in double in 16 interleaved
  // partial sums joined by a fixed tree, and no FMA contraction: every ISA gives the same bits.
  void (*rmsnorm_fwd)(float* out, float* rstd, const float* inp, const float* weight,
                      std::int64_t rows, std::int64_t C, float eps);
  void (*rmsnorm_bwd)(float* dinp, const float* dout, const float* inp, const float* weight,
                      const float* rstd, std::int64_t rows, std::int64_t C, bool accumulate);
  // dweight[c] += sum over the rows, in order, of dout·inp·rstd, for columns [c0, c0 + 64) ∩ C.
  void (*rmsnorm_dweight)(float* dweight, const float* dout, const float* inp, const float* rstd,
                          std::int64_t rows, std::int64_t C, std::int64_t c0);
  // AdamW over [0, n), each operation in the written order and rounded as written (no FMA
  // contraction): every ISA gives the bits of the scalar loop.
  void (*adamw)(float* params, const float* grads, float* m, float* v, std::int64_t n,
                const AdamWScalars& s);
  // SwiGLU's arithmetic between bf16 copies (kernels/ops.h swiglu_forward_bf16 / _backward_bf16).
  void (*swiglu_fwd_bf16)(std::uint16_t* h16, std::uint16_t* gate16, std::uint16_t* up16,
                          const float* gate, const float* up, std::int64_t n);
  void (*swiglu_bwd_bf16)(std::uint16_t* dgate16, std::uint16_t* dup16, const float* dh,
                          const std::uint16_t* gate16, const std::uint16_t* up16, std::int64_t n);
};

extern const SimdRows kSimdRowsSse2, kSimdRowsAvx2, kSimdRowsAvx512;

// The widest version this CPU runs (AVX-512 F/DQ/BW/VL, else AVX2+FMA, else SSE2).
// T3D_SIMD=sse2|avx2|avx512 forces one (benchmarks, tests of each path).
const SimdRows& simd_rows();

}  // namespace t3d::kernels::detail
