// The GEMM behind the linear layers, one of three kinds: OpenBLAS fp32, oneDNN fp32, or oneDNN
// with bf16 inputs and fp32 accumulation and output (mixed precision as PyTorch's autocast does
// it: the fp32 master weights and activations are rounded to bf16 on their way into the GEMM).
//
// Which one is fastest depends on the CPU (a Xeon without AVX512-BF16 runs bf16 dot products at
// half the fp32 rate, Zen 4/5 at twice), so the runtime measures the kinds at the model's shapes
// (measure_gemm_gflops) once per job and hands the chosen kind to every kernel that needs it as an
// argument (the linear ops, attention: kernels/ops.h); nothing in kernels/ holds a kind, so two
// models of one process may run different kinds. Attention's tiles run bf16 (AVX512-BF16) when the
// kind it is given is bf16, else OpenBLAS fp32 (kernels/ops_attention.cpp).
//
// Determinism: for one kind, shapes and thread count the results are bit-identical across runs
// (both libraries split work statically). Threads: every kind runs on the rank's OpenMP pool
// (set_rank_threads): oneDNN by itself, OpenBLAS cut into one single-threaded block of C per
// thread. OpenBLAS's own pool then never wakes, so nothing competes with the OpenMP threads for
// the rank's cores, and those may spin between parallel regions (the launcher's GOMP_SPINCOUNT).
//
// Rounding to bf16: kernels/precision.h's float_to_bf16 (nearest even), both inputs in one
// parallel region. A matrix several GEMMs read is rounded once by the caller
// (float_to_bf16_threads, the same bits) and passed as GemmOperand::rounded.
//
// Workspace: the bf16 copies of the inputs live in a per-thread buffer owned by this file, grown to
// the largest call and kept (like OpenBLAS's and oneDNN's own packing buffers, it is library
// memory outside the arena; gemm_workspace_bytes() reports it).
#pragma once

#include <cstdint>
#include <optional>
#include <string>
#include <string_view>

#include "kernels/blas.h"
#include "kernels/precision.h"

namespace t3d::kernels {

enum class GemmKind { kOpenBlasF32, kOneDnnF32, kOneDnnBf16 };

const char* gemm_kind_name(GemmKind kind);  // "openblas-fp32", "onednn-fp32", "onednn-bf16"
std::optional<GemmKind> parse_gemm_kind(std::string_view name);
inline bool gemm_kind_is_bf16(GemmKind kind) { return kind == GemmKind::kOneDnnBf16; }

// An input matrix of gemm(): fp32 at stride ld, and optionally (bf16 kinds) the same matrix
// already rounded to bf16 and packed (stride = its stored row length), which gemm() then reads
// instead of rounding the floats again. Other kinds ignore `rounded`.
struct GemmOperand {
  const float* data = nullptr;
  std::int64_t ld = 0;
  const bf16* rounded = nullptr;
};

// C (M, N) = op(A) (M, K) · op(B) (K, N), written (accumulate = false) or added to C. Row-major,
// strided as kernels/blas.h's sgemm; fp32 in and out whatever the kind.
void gemm(GemmKind kind, Trans trans_a, Trans trans_b, std::int64_t M, std::int64_t N,
          std::int64_t K, GemmOperand A, GemmOperand B, bool accumulate, float* C,
          std::int64_t ldc);
inline void gemm(GemmKind kind, Trans trans_a, Trans trans_b, std::int64_t M, std::int64_t N,
                 std::int64_t K, const float* A, std::int64_t lda, const float* B, std::int64_t ldb,
                 bool accumulate, float* C, std::int64_t ldc) {
  gemm(kind, trans_a, trans_b, M, N, K, GemmOperand{A, lda}, GemmOperand{B, ldb}, accumulate, C,
       ldc);
}

// What M a GEMM of `kind` whose row count changes from call to call (a mixture of experts'
// rows per expert) is best rounded up to, running the extra rows for nothing: oneDNN compiles a
// primitive per shape (0.3-1 ms each, bench/kernels/bench_expert_rows.cpp), and its AVX-512
// kernels without AMX compute each row of C from that row of op(A) alone, so rows added after the
// real ones change none of their bits. 1 (run M as it is) where either does not hold: OpenBLAS
// compiles nothing, oneDNN's AVX2 kernels (AMD Zen 3) round a row by its place in the GEMM, and
// so do its AMX bf16 kernels for some row counts (measured on an Intel Xeon with AMX). The first
// call for a kind also measures the promise here (a few small GEMMs, ~0.1 s) and answers 1 where
// it fails; a test checks it over more row counts (kernels_gemm, RowBucketKeepsTheRows).
std::int64_t gemm_row_bucket(GemmKind kind);

// The rank's compute threads: the OpenMP pool every kernel runs on, and the count OpenBLAS is
// told (its GEMMs are split over the OpenMP threads: see above).
void set_rank_threads(int n);

// Bytes of the per-thread bf16 input buffers so far (0 until a bf16 GEMM ran).
std::size_t gemm_workspace_bytes();

// Whether this CPU has the AVX512-BF16 dot-product instruction (vdpbf16ps). Without it oneDNN
// emulates bf16 GEMMs with fp32 FMAs: correct, never faster than fp32.
bool cpu_has_bf16_dot();

// "oneDNN 2.6.3 (cpu isa avx512_core_bf16)": what loaded, for logs and cache keys.
std::string onednn_version_string();

// Median GFLOP/s of the three GEMMs of a linear layer on (rows × in) → out — forward x·Wᵀ,
// input gradient dy·W, weight gradient dyᵀ·x accumulated — with `threads` threads (OpenBLAS's
// pool or OpenMP's, restored afterwards). Allocates; call outside the step loop.
double measure_gemm_gflops(GemmKind kind, std::int64_t rows, std::int64_t in, std::int64_t out,
                           int threads, int repeats = 5);

// Runs the kind on odd shapes and every transpose combination against a double-precision
// reference; UserError when the error exceeds what the kind's input precision allows (a broken
// or mis-dispatched library would silently corrupt training). fp32: 1e-4 of the largest |C|;
// bf16: inputs rounded to 8 significant bits (relative error ≤ 2^-8 each, so < 2^-7 per
// product), with random signs summing like a random walk: 1e-2 of the largest |C| is far above
// that and far below any wrong kernel.
void verify_gemm_kind(GemmKind kind);

}  // namespace t3d::kernels
