// The linear layers' GEMMs through cuBLASLt, each shape with the algorithm of the stream's table
// (kernels/cuda/gemm_table.h). Row-major C (M, N) = op(A) op(B) is column-major C^T = op(B)^T
// op(A)^T, so cuBLASLt's "A" is our B and its "B" our A, with the transposes unchanged.
#include <algorithm>
#include <cstring>
#include <memory>
#include <vector>

#include "kernels/cuda/cuda_internal.cuh"

namespace t3d::kernels::cuda {

// cuBLASLt's descriptors of one shape (column-major views of the row-major operands), freed on
// every path, and the algorithm it runs. fp32 inputs sum in fp32 (CUBLAS_COMPUTE_32F: no TF32,
// which only _FAST_TF32 allows); bf16 inputs sum in fp32 into fp32 output.
struct GemmPlan {
  cublasLtMatmulDesc_t op = nullptr;
  cublasLtMatrixLayout_t a = nullptr, b = nullptr, c = nullptr;
  cublasLtMatmulPreference_t preference = nullptr;
  explicit GemmPlan(const GemmShape& s) {
    const cudaDataType_t in = s.precision == GemmPrecision::kBf16 ? CUDA_R_16BF : CUDA_R_32F;
    const cublasOperation_t op_a = s.trans_b ? CUBLAS_OP_T : CUBLAS_OP_N;  // Lt's A = our B
    const cublasOperation_t op_b = s.trans_a ? CUBLAS_OP_T : CUBLAS_OP_N;  // Lt's B = our A
    T3D_CUBLAS_CHECK(cublasLtMatmulDescCreate(&op, CUBLAS_COMPUTE_32F, CUDA_R_32F));
    T3D_CUBLAS_CHECK(
        cublasLtMatmulDescSetAttribute(op, CUBLASLT_MATMUL_DESC_TRANSA, &op_a, sizeof op_a));
    T3D_CUBLAS_CHECK(
        cublasLtMatmulDescSetAttribute(op, CUBLASLT_MATMUL_DESC_TRANSB, &op_b, sizeof op_b));
    const auto u = [](std::int64_t v) { return static_cast<std::uint64_t>(v); };
    T3D_CUBLAS_CHECK(cublasLtMatrixLayoutCreate(&a, in, u(s.trans_b ? s.K : s.N),
                                                u(s.trans_b ? s.N : s.K), s.ldb));
    T3D_CUBLAS_CHECK(cublasLtMatrixLayoutCreate(&b, in, u(s.trans_a ? s.M : s.K),
                                                u(s.trans_a ? s.K : s.M), s.lda));
    T3D_CUBLAS_CHECK(cublasLtMatrixLayoutCreate(&c, CUDA_R_32F, u(s.N), u(s.M), s.ldc));
    T3D_CUBLAS_CHECK(cublasLtMatmulPreferenceCreate(&preference));
    const std::size_t workspace = kBlasWorkspaceBytes;
    T3D_CUBLAS_CHECK(cublasLtMatmulPreferenceSetAttribute(
        preference, CUBLASLT_MATMUL_PREF_MAX_WORKSPACE_BYTES, &workspace, sizeof workspace));
    for (const auto which :
         {CUBLASLT_MATMUL_PREF_MIN_ALIGNMENT_A_BYTES, CUBLASLT_MATMUL_PREF_MIN_ALIGNMENT_B_BYTES,
          CUBLASLT_MATMUL_PREF_MIN_ALIGNMENT_C_BYTES, CUBLASLT_MATMUL_PREF_MIN_ALIGNMENT_D_BYTES})
      T3D_CUBLAS_CHECK(
          cublasLtMatmulPreferenceSetAttribute(preference, which, &s.align, sizeof s.align));
  }
  ~GemmPlan() {
    if (preference) cublasLtMatmulPreferenceDestroy(preference);
    if (c) cublasLtMatrixLayoutDestroy(c);
    if (b) cublasLtMatrixLayoutDestroy(b);
    if (a) cublasLtMatrixLayoutDestroy(a);
    if (op) cublasLtMatmulDescDestroy(op);
  }
  GemmPlan(const GemmPlan&) = delete;
  GemmPlan& operator=(const GemmPlan&) = delete;
  GemmAlgorithm algorithm;  // what run() runs, set by its maker

  // cuBLASLt's heuristic answers for the shape, best first (at most `wanted`; at least one, else
  // an InternalError naming the shape).
  std::vector<GemmAlgorithm> candidates(const Stream::Impl& st, const GemmShape& s,
                                        int wanted) const {
    std::vector<cublasLtMatmulHeuristicResult_t> results(static_cast<std::size_t>(wanted));
    int returned = 0;
    const cublasStatus_t status = cublasLtMatmulAlgoGetHeuristic(st.lt, op, a, b, c, c, preference,
                                                                 wanted, results.data(), &returned);
    std::vector<GemmAlgorithm> out;
    for (int i = 0; status == CUBLAS_STATUS_SUCCESS && i < returned; ++i) {
      if (results[static_cast<std::size_t>(i)].state != CUBLAS_STATUS_SUCCESS) continue;
      GemmAlgorithm g;
      static_assert(sizeof g.words == sizeof(cublasLtMatmulAlgo_t));
      std::memcpy(g.words.data(), &results[static_cast<std::size_t>(i)].algo, sizeof g.words);
      out.push_back(g);
    }
    if (out.empty())
      throw InternalError(::t3d::detail::concat(
          "cuBLASLt has no algorithm for the GEMM ", s.M, "x", s.N, "x", s.K, " (",
          s.precision == GemmPrecision::kBf16 ? "bf16" : "fp32", ", alignment ", s.align,
          " bytes): ", cublasLtGetStatusString(status)));
    return out;
  }

  // Whether `g` runs this plan's shape within the stream's workspace (cublasLtMatmulAlgoCheck).
  bool supports(const Stream::Impl& st, const GemmAlgorithm& g) const {
    cublasLtMatmulAlgo_t algo;
    std::memcpy(&algo, g.words.data(), sizeof algo);
    cublasLtMatmulHeuristicResult_t result{};
    return cublasLtMatmulAlgoCheck(st.lt, op, a, b, c, c, &algo, &result) ==
               CUBLAS_STATUS_SUCCESS &&
           result.workspaceSize <= kBlasWorkspaceBytes;
  }

  // D = op(A) op(B) (+ C when accumulating: the epilogue's beta = 1; C may be D).
  void run(const Stream::Impl& st, const void* A, const void* B, const float* C, float* D,
           bool accumulate) const {
    const float alpha = 1.0f, beta = accumulate ? 1.0f : 0.0f;
    cublasLtMatmulAlgo_t algo;
    std::memcpy(&algo, algorithm.words.data(), sizeof algo);
    // Lt's A is our B and its B our A (the file's first comment).
    T3D_CUBLAS_CHECK(cublasLtMatmul(st.lt, op, &alpha, B, a, A, b, &beta, C, c, D, c, &algo,
                                    st.blas_workspace, kBlasWorkspaceBytes, st.stream));
  }
};

namespace {

// Plans kept at most: a mixture of experts' GEMMs meet a new row count at nearly every call, and
// a plan is a few cuBLASLt descriptors. Dropping them all changes nothing but the time to make
// them again: a plan's algorithm is a function of its shape (plan_of).
constexpr std::size_t kMaxGemmPlans = 2048;

// The algorithm of a shape the table lacks: cuBLASLt's first heuristic answer for its row
// bucket's shape (gemm_table.h: one query per bucket, not per row count), if that runs the exact
// shape, else the first answer for the exact shape. Either way a function of the shape, the GPU
// model and the library, whatever ran before.
GemmAlgorithm untabled_algorithm(Stream::Impl& st, const GemmShape& shape, const GemmPlan& plan) {
  const GemmShape bucket = gemm_bucket_shape(shape);
  auto found = st.bucket_algorithms.find(bucket);
  if (found == st.bucket_algorithms.end()) {
    const GemmAlgorithm first = bucket == shape
                                    ? plan.candidates(st, shape, 1).front()
                                    : GemmPlan(bucket).candidates(st, bucket, 1).front();
    found = st.bucket_algorithms.emplace(bucket, first).first;
  }
  return plan.supports(st, found->second) ? found->second : plan.candidates(st, shape, 1).front();
}

// The stream's plan of `shape`: made at its first use, with the table's algorithm or
// untabled_algorithm's.
const GemmPlan& plan_of(Stream::Impl& st, const GemmShape& shape) {
  if (const auto kept = st.gemm_plans.find(shape); kept != st.gemm_plans.end())
    return *kept->second;
  if (st.gemm_plans.size() >= kMaxGemmPlans) st.gemm_plans.clear();
  auto plan = std::make_shared<GemmPlan>(shape);
  const auto found = st.gemm_table.algorithms.find(shape);
  plan->algorithm = found != st.gemm_table.algorithms.end() ? found->second
                                                            : untabled_algorithm(st, shape, *plan);
  return *st.gemm_plans.emplace(shape, std::move(plan)).first->second;
}

// C (M, N) = or += op(A) (M, K) · op(B) (K, N), row-major with leading dimensions lda, ldb, ldc;
// with `C_in`, C = C_in + op(A) op(B) (C_in laid out as C).
// bf16: A and B are rounded into the stream's workspace first (one buffer for both, B's part on
// kGemmAlignCap bytes so that its alignment, and so the shape's algorithm, is A's size's alone).
void gemm(const Stream& s, GemmPrecision p, bool trans_a, bool trans_b, std::int64_t M,
          std::int64_t N, std::int64_t K, const float* A, std::int64_t lda, const float* B,
          std::int64_t ldb, bool accumulate, float* C, std::int64_t ldc, const bf16* A16 = nullptr,
          const bf16* B16 = nullptr, const float* C_in = nullptr) {
  if (M == 0 || N == 0) return;
  Stream::Impl& st = s.impl();
  if (K == 0) {  // an empty product (no rows of a weight gradient): C = C_in, 0 or itself
    const std::size_t pitch = static_cast<std::size_t>(ldc) * sizeof(float);
    const std::size_t width = static_cast<std::size_t>(N) * sizeof(float);
    if (C_in)
      T3D_CUDA_CHECK(cudaMemcpy2DAsync(C, pitch, C_in, pitch, width, static_cast<std::size_t>(M),
                                       cudaMemcpyDeviceToDevice, st.stream));
    else if (!accumulate)
      T3D_CUDA_CHECK(cudaMemset2DAsync(C, pitch, 0, width, static_cast<std::size_t>(M), st.stream));
    return;
  }
  const void* a = A;
  const void* b = B;
  if (p == GemmPrecision::kBf16) {
    // The stored extents of A and B: rows × leading dimension, as the row-major operands lie.
    // An operand given rounded is read as it is; the others are rounded here.
    const std::int64_t a_elems = (trans_a ? K : M) * lda, b_elems = (trans_b ? N : K) * ldb;
    constexpr std::int64_t kAlignElems = kGemmAlignCap / sizeof(bf16);
    const std::int64_t b_offset = A16 ? 0 : (a_elems + kAlignElems - 1) / kAlignElems * kAlignElems;
    const std::int64_t need = b_offset + (B16 ? 0 : b_elems);
    bf16* rounded =
        need ? st.gemm_inputs.at_least(st.stream, static_cast<std::size_t>(need)) : nullptr;
    if (!A16) float_to_bf16(s, rounded, A, a_elems);
    if (!B16) float_to_bf16(s, rounded + b_offset, B, b_elems);
    a = A16 ? static_cast<const void*>(A16) : rounded;
    b = B16 ? static_cast<const void*>(B16) : rounded + b_offset;
  }
  if (C_in) accumulate = true;
  GemmShape shape{M, N, K, lda, ldb, ldc, trans_a, trans_b, accumulate, p, 0};
  shape.align =
      std::min(gemm_alignment(a, b, C), C_in ? gemm_alignment(C_in, C_in, C_in) : kGemmAlignCap);
  plan_of(st, shape).run(st, a, b, C_in ? C_in : C, C, accumulate);
}

// Extents in elements of a shape's operands, as they lie row-major.
struct Extents {
  std::int64_t a, b, c;
};
Extents extents(const GemmShape& s) {
  return {(s.trans_a ? s.K : s.M) * s.lda, (s.trans_b ? s.N : s.K) * s.ldb, s.M * s.ldc};
}

// Fastest and slowest of `rounds` timed runs of `plan` (events on the stream).
std::array<double, 2> time_plan(const Stream::Impl& st, const GemmPlan& plan, const void* A,
                                const void* B, float* C, bool accumulate, int rounds) {
  cudaEvent_t start, stop;
  T3D_CUDA_CHECK(cudaEventCreate(&start));
  T3D_CUDA_CHECK(cudaEventCreate(&stop));
  std::array<double, 2> fastest_slowest{1e30, 0};
  plan.run(st, A, B, C, C, accumulate);  // warm-up: the kernel loaded, caches warm
  for (int r = 0; r < rounds; ++r) {
    T3D_CUDA_CHECK(cudaEventRecord(start, st.stream));
    plan.run(st, A, B, C, C, accumulate);
    T3D_CUDA_CHECK(cudaEventRecord(stop, st.stream));
    T3D_CUDA_CHECK(cudaEventSynchronize(stop));
    float ms = 0;
    T3D_CUDA_CHECK(cudaEventElapsedTime(&ms, start, stop));
    fastest_slowest[0] = std::min(fastest_slowest[0], ms * 1e-3);
    fastest_slowest[1] = std::max(fastest_slowest[1], ms * 1e-3);
  }
  cudaEventDestroy(start);
  cudaEventDestroy(stop);
  return fastest_slowest;
}

}  // namespace

void linear_forward(const Stream& s, GemmPrecision p, float* y, const float* x, const float* w,
                    std::int64_t N, std::int64_t in, std::int64_t out, Out mode, const bf16* x16,
                    const bf16* w16, const float* residual) {
  // y (N, out) = (residual +) x (N, in) · w^T (in, out)
  gemm(s, p, false, true, N, out, in, x, in, w, in, mode == Out::kAccumulate, y, out, x16, w16,
       residual);
}

void linear_backward_input(const Stream& s, GemmPrecision p, float* dx, const float* dy,
                           const float* w, std::int64_t N, std::int64_t in, std::int64_t out,
                           Out mode, const bf16* dy16, const bf16* w16) {
  // dx (N, in) = dy (N, out) · w (out, in)
  gemm(s, p, false, false, N, in, out, dy, out, w, in, mode == Out::kAccumulate, dx, in, dy16, w16);
}

void linear_backward_weight(const Stream& s, GemmPrecision p, float* dw, const float* dy,
                            const float* x, std::int64_t N, std::int64_t in, std::int64_t out,
                            const bf16* dy16, const bf16* x16) {
  // dw (out, in) += dy^T (out, N) · x (N, in)
  gemm(s, p, true, false, out, in, N, dy, out, x, in, true, dw, in, dy16, x16);
}

std::array<GemmShape, 4> linear_gemm_shapes(GemmPrecision p, std::int64_t N, std::int64_t in,
                                            std::int64_t out, std::uint32_t align) {
  // The calls above, as gemm() keys them.
  return {GemmShape{N, out, in, in, in, out, false, true, false, p, align},
          GemmShape{N, in, out, out, in, in, false, false, false, p, align},
          GemmShape{out, in, N, out, in, in, true, false, true, p, align},
          GemmShape{N, out, in, in, in, out, false, true, true, p, align}};
}

std::string gemm_library(const Stream& s) { return s.impl().gemm_table.library; }

GemmTable gemm_table(const Stream& s) { return s.impl().gemm_table; }

std::vector<GemmShape> gemm_shapes_planned(const Stream& s) {
  std::vector<GemmShape> shapes;
  for (const auto& [shape, plan] : s.impl().gemm_plans) shapes.push_back(shape);
  return shapes;
}

std::string use_gemm_table(const Stream& s, const GemmTable& table) {
  Stream::Impl& st = s.impl();
  if (table.library != st.gemm_table.library)
    return ::t3d::detail::concat("its algorithms are for ", table.library, ", this is ",
                                 st.gemm_table.library);
  st.gemm_table = table;
  st.gemm_plans.clear();
  return {};
}

GemmTable tune_gemms(const Stream& s, const std::vector<GemmShape>& shapes, int candidates,
                     int rounds) {
  Stream::Impl& st = s.impl();
  T3D_CUDA_CHECK(cudaSetDevice(st.device));
  for (const GemmShape& shape : shapes) {
    const Extents e = extents(shape);
    const std::size_t in_bytes = shape.precision == GemmPrecision::kBf16 ? 2 : 4;
    // cudaMalloc's 256-byte alignment serves any shape's `align` (≤ kGemmAlignCap).
    const DeviceMemory A(static_cast<std::size_t>(e.a) * in_bytes, "GEMM tuning input A");
    const DeviceMemory B(static_cast<std::size_t>(e.b) * in_bytes, "GEMM tuning input B");
    const DeviceMemory C(static_cast<std::size_t>(e.c) * sizeof(float), "GEMM tuning output");
    GemmPlan plan(shape);
    const std::vector<GemmAlgorithm> answers = plan.candidates(st, shape, candidates);
    std::size_t winner = 0;
    std::array<double, 2> best{};
    for (std::size_t i = 0; i < answers.size(); ++i) {
      plan.algorithm = answers[i];
      const std::array<double, 2> t =
          time_plan(st, plan, A.data(), B.data(), C.as<float>(), shape.accumulate, rounds);
      if (i == 0 || beats_clearly(t, best)) {
        winner = i;
        best = t;
      }
    }
    st.gemm_table.algorithms[shape] = answers[winner];
  }
  st.gemm_table.source = "measured";
  st.gemm_plans.clear();
  return st.gemm_table;
}

}  // namespace t3d::kernels::cuda
