// The linear layers' GEMMs through cuBLAS. Row-major C (M, N) = op(A) op(B) is column-major
// C^T = op(B)^T op(A)^T, so each call passes B before A with the transposes unchanged.
#include "kernels/cuda/cuda_internal.cuh"

namespace t3d::kernels::cuda {
namespace {

// C (M, N) = or += op(A) (M, K) · op(B) (K, N), row-major with leading dimensions lda, ldb, ldc.
// bf16: A and B are rounded into the stream's workspace first (one buffer for both).
void gemm(const Stream& s, GemmPrecision p, bool trans_a, bool trans_b, std::int64_t M,
          std::int64_t N, std::int64_t K, const float* A, std::int64_t lda, const float* B,
          std::int64_t ldb, bool accumulate, float* C, std::int64_t ldc, const bf16* A16 = nullptr,
          const bf16* B16 = nullptr) {
  if (M == 0 || N == 0) return;
  Stream::Impl& st = s.impl();
  const float alpha = 1.0f, beta = accumulate ? 1.0f : 0.0f;
  const cublasOperation_t op_a = trans_a ? CUBLAS_OP_T : CUBLAS_OP_N;
  const cublasOperation_t op_b = trans_b ? CUBLAS_OP_T : CUBLAS_OP_N;
  const void* a = A;
  const void* b = B;
  cudaDataType_t type = CUDA_R_32F;
  if (p == GemmPrecision::kBf16) {
    // The stored extents of A and B: rows × leading dimension, as the row-major operands lie.
    // An operand given rounded is read as it is; the others are rounded here.
    const std::int64_t a_elems = (trans_a ? K : M) * lda, b_elems = (trans_b ? N : K) * ldb;
    const std::int64_t need = (A16 ? 0 : a_elems) + (B16 ? 0 : b_elems);
    bf16* rounded = need ? st.gemm_inputs_for(static_cast<std::size_t>(need)) : nullptr;
    if (!A16) float_to_bf16(s, rounded, A, a_elems);
    if (!B16) float_to_bf16(s, rounded + (A16 ? 0 : a_elems), B, b_elems);
    a = A16 ? static_cast<const void*>(A16) : rounded;
    b = B16 ? static_cast<const void*>(B16) : rounded + (A16 ? 0 : a_elems);
    type = CUDA_R_16BF;
  }
  // The handle is in CUBLAS_PEDANTIC_MATH (Stream): fp32 stays fp32 (no TF32).
  T3D_CUBLAS_CHECK(cublasGemmEx(st.blas, op_b, op_a, static_cast<int>(N), static_cast<int>(M),
                                static_cast<int>(K), &alpha, b, type, static_cast<int>(ldb), a,
                                type, static_cast<int>(lda), &beta, C, CUDA_R_32F,
                                static_cast<int>(ldc), CUBLAS_COMPUTE_32F, CUBLAS_GEMM_DEFAULT));
}

}  // namespace

void linear_forward(const Stream& s, GemmPrecision p, float* y, const float* x, const float* w,
                    std::int64_t N, std::int64_t in, std::int64_t out, Out mode, const bf16* x16) {
  // y (N, out) = x (N, in) · w^T (in, out)
  gemm(s, p, false, true, N, out, in, x, in, w, in, mode == Out::kAccumulate, y, out, x16);
}

void linear_backward_input(const Stream& s, GemmPrecision p, float* dx, const float* dy,
                           const float* w, std::int64_t N, std::int64_t in, std::int64_t out,
                           Out mode, const bf16* dy16) {
  // dx (N, in) = dy (N, out) · w (out, in)
  gemm(s, p, false, false, N, in, out, dy, out, w, in, mode == Out::kAccumulate, dx, in, dy16);
}

void linear_backward_weight(const Stream& s, GemmPrecision p, float* dw, const float* dy,
                            const float* x, std::int64_t N, std::int64_t in, std::int64_t out,
                            const bf16* dy16, const bf16* x16) {
  // dw (out, in) += dy^T (out, N) · x (N, in)
  gemm(s, p, true, false, out, in, N, dy, out, x, in, true, dw, in, dy16, x16);
}

}  // namespace t3d::kernels::cuda
