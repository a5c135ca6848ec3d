#include "kernels/cuda/gemm_table.h"

#include <algorithm>
#include <cinttypes>
#include <cstdio>
#include <sstream>

namespace t3d::kernels::cuda {

namespace {

constexpr std::string_view kHeader = "t3d-gemm-table 1";

std::uint32_t alignment_of(const void* p) {
  const auto address = reinterpret_cast<std::uintptr_t>(p);
  std::uint32_t align = kGemmAlignCap;
  while (align > 1 && address % align != 0) align /= 2;
  return align;
}

// One shape line; false when it is not one.
bool parse_shape_line(const std::string& line, GemmShape* shape, GemmAlgorithm* algorithm) {
  std::istringstream in(line);
  int ta = -1, tb = -1, acc = -1;
  std::string precision;
  in >> shape->M >> shape->N >> shape->K >> shape->lda >> shape->ldb >> shape->ldc >> ta >> tb >>
      acc >> precision >> shape->align;
  if (!in || (ta != 0 && ta != 1) || (tb != 0 && tb != 1) || (acc != 0 && acc != 1)) return false;
  if (precision != "fp32" && precision != "bf16") return false;
  if (shape->M < 1 || shape->N < 1 || shape->K < 1 || shape->align < 1 ||
      shape->align > kGemmAlignCap || (shape->align & (shape->align - 1)) != 0)
    return false;
  shape->trans_a = ta == 1;
  shape->trans_b = tb == 1;
  shape->accumulate = acc == 1;
  shape->precision = precision == "bf16" ? GemmPrecision::kBf16 : GemmPrecision::kFp32;
  for (std::uint64_t& w : algorithm->words) {
    std::string hex;
    if (!(in >> hex) || hex.size() != 16 ||
        hex.find_first_not_of("0123456789abcdef") != std::string::npos)
      return false;
    w = std::stoull(hex, nullptr, 16);
  }
  std::string rest;
  return !(in >> rest);
}

}  // namespace

std::uint32_t gemm_alignment(const void* a, const void* b, const void* c) {
  return std::min({alignment_of(a), alignment_of(b), alignment_of(c)});
}

std::int64_t gemm_row_bucket(std::int64_t rows) {
  if (rows <= kGemmRowBucketMin) return kGemmRowBucketMin;
  std::int64_t power = 1;  // the largest power of two below rows
  while (power * 2 < rows) power *= 2;
  const std::int64_t step = power / 4;
  return (rows + step - 1) / step * step;
}

GemmShape gemm_bucket_shape(const GemmShape& shape) {
  GemmShape bucket = shape;
  if (!shape.trans_a) bucket.M = gemm_row_bucket(shape.M);
  if (shape.trans_a && !shape.trans_b) bucket.K = gemm_row_bucket(shape.K);
  return bucket;
}

std::string gemm_table_text(const GemmTable& table) {
  std::string out =
      std::string(kHeader) + "\nlibrary " + table.library + "\nsource " + table.source + "\n";
  for (const auto& [s, algorithm] : table.algorithms) {
    char line[160];
    std::snprintf(
        line, sizeof line,
        "%" PRId64 " %" PRId64 " %" PRId64 " %" PRId64 " %" PRId64 " %" PRId64 " %d %d %d %s %u",
        s.M, s.N, s.K, s.lda, s.ldb, s.ldc, s.trans_a ? 1 : 0, s.trans_b ? 1 : 0,
        s.accumulate ? 1 : 0, s.precision == GemmPrecision::kBf16 ? "bf16" : "fp32", s.align);
    out += line;
    for (const std::uint64_t w : algorithm.words) {
      std::snprintf(line, sizeof line, " %016" PRIx64, w);
      out += line;
    }
    out += '\n';
  }
  return out;
}

std::optional<GemmTable> parse_gemm_table(std::string_view text, std::string* why) {
  const auto fail = [&](int line_no, std::string_view what) -> std::optional<GemmTable> {
    if (why) *why = "GEMM table line " + std::to_string(line_no) + ": " + std::string(what);
    return std::nullopt;
  };
  std::istringstream in{std::string(text)};
  std::string line;
  GemmTable table;
  int line_no = 0;
  const auto next = [&] { return static_cast<bool>(std::getline(in, line)) && (++line_no, true); };
  if (!next() || line != kHeader)
    return fail(1, "not a GEMM table (expected \"t3d-gemm-table 1\")");
  if (!next() || line.rfind("library ", 0) != 0) return fail(2, "expected \"library <name>\"");
  table.library = line.substr(8);
  if (!next() || line.rfind("source ", 0) != 0) return fail(3, "expected \"source <how>\"");
  table.source = line.substr(7);
  while (next()) {
    if (line.empty()) continue;
    GemmShape shape;
    GemmAlgorithm algorithm;
    if (!parse_shape_line(line, &shape, &algorithm))
      return fail(line_no,
                  "expected \"M N K lda ldb ldc trans_a trans_b accumulate fp32|bf16 "
                  "align\" and 8 hex words, got \"" +
                      line + "\"");
    if (!table.algorithms.emplace(shape, algorithm).second)
      return fail(line_no, "a shape listed twice");
  }
  return table;
}

bool beats_clearly(const std::array<double, 2>& challenger_fastest_slowest,
                   const std::array<double, 2>& incumbent_fastest_slowest) {
  return challenger_fastest_slowest[1] * kGemmAlgorithmMargin < incumbent_fastest_slowest[0];
}

}  // namespace t3d::kernels::cuda
