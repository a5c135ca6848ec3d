// Which cuBLASLt algorithm each GEMM shape runs on a Stream, and the table's text form (what
// gemm_choice.json records and a resumed run installs again). Host code: no CUDA type here.
//
// Why a table: cuBLASLt repeats its bits for one algorithm, shape, GPU model and library version,
// but which algorithm its heuristic or a measurement picks may change with the library, and a
// measurement may pick differently on two ranks or two runs. So a job measures once (rank 0), every
// rank installs the same table, and resume installs the table the run recorded: the same algorithm
// for the same shape everywhere, the same bits. A shape the table lacks runs cuBLASLt's first
// heuristic answer (a function of the shape, GPU model, library and workspace: the same on every
// rank), not kept in the table: the answer for its row bucket's shape (gemm_bucket_shape), so
// that a mixture of experts' GEMMs, which meet a new row count at nearly every call, ask the
// heuristic once per bucket instead of once per call.
//
// The algorithm is cuBLASLt's `cublasLtMatmulAlgo_t`, which its documentation says "can be
// trivially serialized and later restored for use with the same version of cuBLAS library": the
// table names that library and GPU (`library`), and is used only where both match.
#pragma once

#include <array>
#include <cstdint>
#include <map>
#include <optional>
#include <string>
#include <string_view>
#include <tuple>

namespace t3d::kernels::cuda {

// GEMM inputs: fp32 (TF32 off, as precision = fp32 promises) or rounded to bf16 with fp32
// accumulation and output (precision = bf16, PyTorch's autocast).
enum class GemmPrecision { kFp32, kBf16 };

// A GEMM as ops_linear.cu runs it: row-major C (M, N) = (or += when `accumulate`) op(A) (M, K) ·
// op(B) (K, N), leading dimensions lda, ldb, ldc, in `precision`. `align` is the smallest
// alignment of the three pointers in bytes, capped at kGemmAlignCap: algorithms are picked for it
// (cuBLASLt refuses or excludes the ones that need more).
struct GemmShape {
  std::int64_t M = 0, N = 0, K = 0, lda = 0, ldb = 0, ldc = 0;
  bool trans_a = false, trans_b = false, accumulate = false;
  GemmPrecision precision = GemmPrecision::kFp32;
  std::uint32_t align = 0;
  auto key() const {
    return std::tie(M, N, K, lda, ldb, ldc, trans_a, trans_b, accumulate, precision, align);
  }
  bool operator<(const GemmShape& o) const { return key() < o.key(); }
  bool operator==(const GemmShape& o) const { return key() == o.key(); }
};

// Alignments above this add nothing to the choice: every arena tensor starts on 64 bytes
// (kernels/arena.h), and Hopper's TMA needs 16.
inline constexpr std::uint32_t kGemmAlignCap = 64;
// The alignment class of three addresses: the largest power of two ≤ kGemmAlignCap dividing each.
std::uint32_t gemm_alignment(const void* a, const void* b, const void* c);

// cuBLASLt's algorithm descriptor, as its bytes.
struct GemmAlgorithm {
  std::array<std::uint64_t, 8> words{};
  bool operator==(const GemmAlgorithm& o) const { return words == o.words; }
};

struct GemmTable {
  // "cuBLASLt 130100 on NVIDIA H200 (sm_90)": the library and GPU the algorithms hold for.
  std::string library;
  std::map<GemmShape, GemmAlgorithm> algorithms;
  // How the algorithms were picked: "heuristic" (cuBLASLt's first answer per shape), "measured"
  // (tune_gemms), or where a recorded table came from.
  std::string source = "heuristic";
};

// Text form: a header line `t3d-gemm-table 1`, `library <library>`, `source <source>`, then one
// line per shape: `M N K lda ldb ldc trans_a trans_b accumulate fp32|bf16 align` and the
// algorithm's eight words in hex. Parsing refuses anything else, naming the line.
std::string gemm_table_text(const GemmTable& table);
std::optional<GemmTable> parse_gemm_table(std::string_view text, std::string* why);

// The shape whose heuristic answer a shape outside the table runs: its free row counts rounded up
// to kGemmRowBucketMin, or above it to a quarter of their power of two (at most 25 % more rows).
// Free means no operand's leading dimension bounds it: M when A is stored (M, K), i.e. not
// transposed (the linear layers' forward and input gradient, M = the batch rows), and K when A is
// stored (K, M) and B (K, N) (the weight gradient, K = the batch rows). The algorithm is then a
// function of the shape alone, as the table's promise needs; ops_linear.cu checks it supports the
// exact shape (cublasLtMatmulAlgoCheck) and otherwise asks the heuristic for the exact shape.
inline constexpr std::int64_t kGemmRowBucketMin = 64;
std::int64_t gemm_row_bucket(std::int64_t rows);
GemmShape gemm_bucket_shape(const GemmShape& shape);

// Whether `challenger`'s times (seconds, one per timed round) beat `incumbent`'s clearly enough
// to replace it: its slowest round faster than the incumbent's fastest by kGemmAlgorithmMargin.
// Algorithms whose times overlap within the noise keep the earlier one (cuBLASLt's heuristic
// order), so measuring again picks the same algorithm and only a clear gain changes bits.
inline constexpr double kGemmAlgorithmMargin = 1.05;
bool beats_clearly(const std::array<double, 2>& challenger_fastest_slowest,
                   const std::array<double, 2>& incumbent_fastest_slowest);

}  // namespace t3d::kernels::cuda
