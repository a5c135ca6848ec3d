// Linear layers (GEMMs of the kind the caller gives, transpose flags, no copies of fp32 data) and
// SwiGLU.
#include <algorithm>
#include <cmath>
#include <vector>

#include "kernels/blas.h"
#include "kernels/check.h"
#include "kernels/cuda/cuda_ops.h"
#include "kernels/gemm.h"
#include "kernels/ops.h"
#include "kernels/simd_rows.h"
#include "kernels/threads.h"

namespace t3d::kernels {

void linear_forward(const Exec& exec, float* y, const float* x, const float* w, std::int64_t N,
                    std::int64_t in, std::int64_t out, Out mode) {
  const bf16* w16 = exec.rounded_weight(w);
  T3D_ON_GPU(exec, cuda::linear_forward(*exec.stream, cuda::gemm_precision(exec), y, x, w, N, in,
                                        out, mode, nullptr, w16));
  // y (N, out) = x (N, in) . w^T (in, out): w is [out, in], read transposed in place.
  gemm(exec.gemm, Trans::kNo, Trans::kYes, N, out, in, GemmOperand{x, in}, GemmOperand{w, in, w16},
       mode == Out::kAccumulate, y, out);
}

void linear_backward_input(const Exec& exec, float* dx, const float* dy, const float* w,
                           std::int64_t N, std::int64_t in, std::int64_t out) {
  const bf16* w16 = exec.rounded_weight(w);
  T3D_ON_GPU(exec, cuda::linear_backward_input(*exec.stream, cuda::gemm_precision(exec), dx, dy, w,
                                               N, in, out, Out::kWrite, nullptr, w16));
  // dx (N, in) = dy (N, out) . w (out, in)
  gemm(exec.gemm, Trans::kNo, Trans::kNo, N, in, out, GemmOperand{dy, out}, GemmOperand{w, in, w16},
       false, dx, in);
}

void linear_backward_weight(const Exec& exec, float* dw, const float* dy, const float* x,
                            std::int64_t N, std::int64_t in, std::int64_t out) {
  T3D_ON_GPU(exec, cuda::linear_backward_weight(*exec.stream, cuda::gemm_precision(exec), dw, dy, x,
                                                N, in, out));
  const GemmKind kind = exec.gemm;
  // dw (out, in) += dy^T (out, N) . x (N, in)
  gemm(kind, Trans::kYes, Trans::kNo, out, in, N, dy, out, x, in, true, dw, in);
}

namespace {

// The pool behind LinearInput: per thread, buffers handed out and back in stack order.
struct RoundedPool {
  std::vector<std::vector<bf16>> buffers;
  std::vector<bool> taken;
};
RoundedPool& rounded_pool() {
  thread_local RoundedPool pool;
  return pool;
}

GemmOperand operand(const LinearInput& m) { return {m.data(), m.cols(), m.rounded()}; }

}  // namespace

LinearInput::LinearInput(const Exec& exec, const float* x, std::int64_t rows, std::int64_t cols)
    : LinearInput(exec, x, nullptr, Copy::kFill, rows, cols) {}

LinearInput::LinearInput(const Exec& exec, const float* x, bf16* copy, Copy how, std::int64_t rows,
                         std::int64_t cols)
    : exec_(exec), x_(x), rows_(rows), cols_(cols) {
  const GemmKind kind = exec.gemm;
  const bool bf16_gemm = gemm_kind_is_bf16(kind);
#ifdef T3D_HAVE_CUDA
  if (exec.on_gpu()) {  // the pool is the stream's (device memory)
    if (!copy) {
      if (!bf16_gemm) return;
      const cuda::RoundedBuffer b =
          cuda::take_rounded_buffer(*exec.stream, static_cast<std::size_t>(rows * cols));
      copy = b.data;
      buffer_ = b.slot;
      how = Copy::kFill;
    }
    try {  // a failed launch throws before the destructor could give the buffer back
      if (how == Copy::kFill) float_to_bf16(exec, copy, x, rows * cols);
    } catch (...) {
      if (buffer_ >= 0) cuda::give_rounded_buffer(*exec.stream, buffer_);
      throw;
    }
    if (bf16_gemm) rounded_ = copy;
    return;
  }
#endif
  if (!copy) {  // a buffer of the pool, only worth filling for bf16 GEMMs
    if (!bf16_gemm) return;
    RoundedPool& pool = rounded_pool();
    for (std::size_t i = 0; i < pool.taken.size() && buffer_ < 0; ++i)
      if (!pool.taken[i]) buffer_ = static_cast<int>(i);
    if (buffer_ < 0) {
      buffer_ = static_cast<int>(pool.buffers.size());
      pool.buffers.emplace_back();
      pool.taken.push_back(false);
    }
    auto& buffer = pool.buffers[static_cast<std::size_t>(buffer_)];
    if (buffer.size() < static_cast<std::size_t>(rows * cols))
      buffer.resize(static_cast<std::size_t>(rows * cols));
    pool.taken[static_cast<std::size_t>(buffer_)] = true;
    copy = buffer.data();
    how = Copy::kFill;
  }
  if (how == Copy::kFill) float_to_bf16(exec, copy, x, rows * cols);
  if (bf16_gemm) rounded_ = copy;
}

LinearInput::~LinearInput() {
  if (buffer_ < 0) return;
#ifdef T3D_HAVE_CUDA
  if (exec_.on_gpu()) {
    cuda::give_rounded_buffer(*exec_.stream, buffer_);
    return;
  }
#endif
  rounded_pool().taken[static_cast<std::size_t>(buffer_)] = false;
}

void linear_forward(float* y, const LinearInput& x, const float* w, std::int64_t out, Out mode) {
  const std::int64_t N = x.rows(), in = x.cols();
  const bf16* w16 = x.exec().rounded_weight(w);
  T3D_ON_GPU(x.exec(), cuda::linear_forward(*x.exec().stream, cuda::gemm_precision(x.exec()), y,
                                            x.data(), w, N, in, out, mode, x.rounded(), w16));
  gemm(x.kind(), Trans::kNo, Trans::kYes, N, out, in, operand(x), GemmOperand{w, in, w16},
       mode == Out::kAccumulate, y, out);
}

void linear_forward_residual(float* y, const float* residual, const LinearInput& x, const float* w,
                             std::int64_t out) {
  T3D_ASSERT(y != residual, "linear_forward_residual writes y beside the residual, not over it");
  const std::int64_t N = x.rows();
  T3D_ON_GPU(x.exec(), cuda::linear_forward(*x.exec().stream, cuda::gemm_precision(x.exec()), y,
                                            x.data(), w, N, x.cols(), out, Out::kWrite, x.rounded(),
                                            x.exec().rounded_weight(w), residual));
  linear_forward(y, x, w, out);
  add_inplace(x.exec(), y, residual, N * out);  // residual + product: IEEE addition commutes
}

void linear_backward_input(float* dx, const LinearInput& dy, const float* w, std::int64_t in,
                           Out mode) {
  const std::int64_t N = dy.rows(), out = dy.cols();
  const bf16* w16 = dy.exec().rounded_weight(w);
  T3D_ON_GPU(dy.exec(),
             cuda::linear_backward_input(*dy.exec().stream, cuda::gemm_precision(dy.exec()), dx,
                                         dy.data(), w, N, in, out, mode, dy.rounded(), w16));
  gemm(dy.kind(), Trans::kNo, Trans::kNo, N, in, out, operand(dy), GemmOperand{w, in, w16},
       mode == Out::kAccumulate, dx, in);
}

void linear_backward_weight(float* dw, const LinearInput& dy, const LinearInput& x) {
  T3D_ASSERT(dy.rows() == x.rows(), "dy has ", dy.rows(), " rows, x ", x.rows());
  T3D_ASSERT(dy.kind() == x.kind(), "dy prepared for ", gemm_kind_name(dy.kind()), ", x for ",
             gemm_kind_name(x.kind()));
  T3D_ASSERT(dy.exec().on_gpu() == x.exec().on_gpu(), "dy and x prepared for different backends");
  const std::int64_t N = x.rows(), in = x.cols(), out = dy.cols();
  T3D_ON_GPU(x.exec(), cuda::linear_backward_weight(
                           *x.exec().stream, cuda::gemm_precision(x.exec()), dw, dy.data(),
                           x.data(), N, in, out, dy.rounded(), x.rounded()));
  gemm(x.kind(), Trans::kYes, Trans::kNo, out, in, N, operand(dy), operand(x), true, dw, in);
}

void swiglu_forward(const Exec& exec, float* h, const float* gate, const float* up,
                    std::int64_t n) {
  T3D_ON_GPU(exec, cuda::swiglu_forward(*exec.stream, h, gate, up, n));
  const auto& rows = detail::simd_rows();
  detail::split_range(n, [&](std::int64_t lo, std::int64_t hi) {
    rows.swiglu_fwd(h + lo, gate + lo, up + lo, hi - lo);
  });
}

// h = g s(g) u with s the sigmoid: dh/du = g s(g), dh/dg = u s(g) (1 + g (1 - s(g))).
void swiglu_backward(const Exec& exec, float* dgate, float* dup, const float* dh, const float* gate,
                     const float* up, std::int64_t n) {
  T3D_ON_GPU(exec, cuda::swiglu_backward(*exec.stream, dgate, dup, dh, gate, up, n));
  const auto& rows = detail::simd_rows();
  detail::split_range(n, [&](std::int64_t lo, std::int64_t hi) {
    rows.swiglu_bwd(dgate + lo, dup + lo, dh + lo, gate + lo, up + lo, hi - lo);
  });
}

void swiglu_forward_bf16(const Exec& exec, bf16* h16, bf16* gate16, bf16* up16, const float* gate,
                         const float* up, std::int64_t n) {
  T3D_ON_GPU(exec, cuda::swiglu_forward_bf16(*exec.stream, h16, gate16, up16, gate, up, n));
  const auto& rows = detail::simd_rows();
  detail::split_range(n, [&](std::int64_t lo, std::int64_t hi) {
    rows.swiglu_fwd_bf16(h16 + lo, gate16 + lo, up16 + lo, gate + lo, up + lo, hi - lo);
  });
}

void swiglu_backward_bf16(const Exec& exec, bf16* dgate16, bf16* dup16, const float* dh,
                          const bf16* gate16, const bf16* up16, std::int64_t n) {
  T3D_ON_GPU(exec, cuda::swiglu_backward_bf16(*exec.stream, dgate16, dup16, dh, gate16, up16, n));
  const auto& rows = detail::simd_rows();
  detail::split_range(n, [&](std::int64_t lo, std::int64_t hi) {
    rows.swiglu_bwd_bf16(dgate16 + lo, dup16 + lo, dh + lo, gate16 + lo, up16 + lo, hi - lo);
  });
}

}  // namespace t3d::kernels
