// The element arithmetic both backends run: the CPU's row loops (kernels/simd_rows.inc) and the
// CUDA kernels (kernels/cuda/) call these same functions, so an element's value is defined once.
// Internal to kernels/.
//
// Bits: every function is IEEE single or double arithmetic in the written order, rounded as
// written. The CUDA backend compiles with -fmad=false, and the CPU's loops that promise bits run
// with fp-contract off (simd_rows.inc), so where both evaluate an element through one of these
// functions they give the same bits (RMSNorm, AdamW, RoPE, the bf16 casts). Where the CPU loop lets
// GCC contract to FMAs (SwiGLU and the attention tiles on AVX2/AVX-512), the backends agree within
// an ulp or two, and the GPU equals the CPU's SSE2 path.
#pragma once

#include <cmath>
#include <cstdint>
#include <cstring>
#if !defined(__CUDACC__)
#include <bit>
#endif

#ifdef __CUDACC__
#define T3D_HD __host__ __device__
#else
#define T3D_HD
#endif
// A loop of a constant trip count unrolled on the GPU, so that the small arrays it indexes stay in
// registers (an array indexed at run time lives in a thread's local memory).
#ifdef __CUDA_ARCH__
#define T3D_UNROLL _Pragma("unroll")
#else
#define T3D_UNROLL
#endif

namespace t3d::kernels::detail {

// AdamW's per-step scalars (kernels/ops.h adamw_step computes them once per call).
struct AdamWScalars {
  float beta1, beta2, eps;
  float decay;         // 1 - lr · weight_decay
  float step_size;     // lr / (1 - beta1^t)
  float inv_sqrt_bc2;  // 1 / sqrt(1 - beta2^t)
  float grad_scale;    // multiplies each gradient first (clipping; 1 without)
};

// Anonymous: kernels/simd_rows_<isa>.cpp compile these with AVX2/AVX-512 flags; internal linkage
// keeps those copies out of the baseline code (no ODR merging of inline functions).
namespace {

// The bits of a float and back. On the CPU std::bit_cast (not memcpy), which keeps the row loops
// vectorisable; nvcc's host pass compiles C++17 (kernels/cuda/CMakeLists.txt), so memcpy there.
T3D_HD inline std::uint32_t bits_of(float f) {
#if defined(__CUDA_ARCH__)
  return __float_as_uint(f);
#elif defined(__CUDACC__)
  std::uint32_t u;
  std::memcpy(&u, &f, sizeof u);
  return u;
#else
  return std::bit_cast<std::uint32_t>(f);
#endif
}
T3D_HD inline float float_of_bits(std::uint32_t u) {
#if defined(__CUDA_ARCH__)
  return __uint_as_float(u);
#elif defined(__CUDACC__)
  float f;
  std::memcpy(&f, &u, sizeof f);
  return f;
#else
  return std::bit_cast<float>(u);
#endif
}

// exp for x <= 0 (scores minus their max), branch-free so the row loops vectorise; libm's expf
// does not, and the T^2/2 exponentials would otherwise cost more than the GEMMs.
// Cephes expf polynomial: rel. error ~2e-7 on the range used here; exp(-inf) -> ~1e-38, which
// callers never rely on (masked entries are set to 0 explicitly).
T3D_HD inline float exp_neg(float x) {
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
  return p * float_of_bits(static_cast<std::uint32_t>((static_cast<std::int32_t>(fn) + 127) << 23));
}

// sigmoid(x) = 1 / (1 + exp(-x)), from exp_neg(-|x|) so it never overflows; both branches are
// computed and selected, so it vectorises.
T3D_HD inline float sigmoid(float x) {
  const float e = exp_neg(x > 0.0f ? -x : x);
  const float inv = 1.0f / (1.0f + e);
  return x > 0.0f ? inv : e * inv;
}

// SwiGLU: h = g s(g) u with s the sigmoid; dh/du = g s(g), dh/dg = u s(g) (1 + g (1 - s(g))).
T3D_HD inline float swiglu_value(float g, float u) { return g * sigmoid(g) * u; }
T3D_HD inline void swiglu_grads(float dh, float g, float u, float& dg, float& du) {
  const float s = sigmoid(g);
  du = dh * g * s;
  dg = dh * u * s * (1.0f + g * (1.0f - s));
}

// The shared experts' sigmoid gate (Qwen2-MoE; kernels/ops_gate.h): per row t of x (N, C),
// z = x[t] · w summed in double over 16 lanes (lane j the columns c ≡ j mod 16 in increasing c,
// then the lanes pairwise 8 + 8, 4 + 4, 2 + 2, 1 + 1: RMSNorm's order), and the same order for the
// backward's dy[t] · shared[t]. One function evaluates a whole row, on the CPU and in one GPU
// thread, so both backends give the same bits.
T3D_HD inline double gate_row_dot(const float* a, const float* b, std::int64_t C) {
  double lane[16] = {};  // lane j: the products of columns j, j + 16, ... in order
  std::int64_t c0 = 0;
  for (; c0 + 16 <= C; c0 += 16) {
    T3D_UNROLL
    for (int j = 0; j < 16; ++j) lane[j] += static_cast<double>(a[c0 + j]) * b[c0 + j];
  }
  T3D_UNROLL
  for (int j = 0; j < 16; ++j)
    if (c0 + j < C) lane[j] += static_cast<double>(a[c0 + j]) * b[c0 + j];
  T3D_UNROLL
  for (int fold = 0; fold < 4; ++fold) {  // halves of 8, 4, 2, 1 lanes folded onto the first
    const int w = 8 >> fold;
    T3D_UNROLL
    for (int j = 0; j < 8; ++j)
      if (j < w) lane[j] += lane[j + w];
  }
  return lane[0];
}
// g = sigmoid(z), z rounded to fp32 first.
T3D_HD inline float gate_value(double z) { return sigmoid(static_cast<float>(z)); }
// out += g · shared (one element).
T3D_HD inline float gate_apply(float out, float g, float shared) { return out + g * shared; }
// dz = dg · g · (1 − g): the gradient of the gate's logit from that of g.
T3D_HD inline float gate_dlogit(float dg, float g) { return dg * g * (1.0f - g); }
// dw[c] += Σ_t dz[t] · x[t, c], t ascending, summed in double and added once, rounded to fp32.
T3D_HD inline float gate_dweight(float dw, const float* dz, const float* x, std::int64_t rows,
                                 std::int64_t C, std::int64_t c) {
  double acc = 0.0;
  for (std::int64_t t = 0; t < rows; ++t) acc += static_cast<double>(dz[t]) * x[t * C + c];
  return static_cast<float>(static_cast<double>(dw) + acc);
}

// fp32 <-> bf16 exactly as precision.h's float_to_bf16 (ties to even, quiet NaN) and
// bf16_to_float: integer arithmetic only, so every ISA and the GPU give the same bits (the
// AVX512-BF16 conversion instruction would flush denormals to zero instead).
T3D_HD inline std::uint16_t bf16_of(float f) {
  const std::uint32_t u = bits_of(f);
  const std::uint32_t rounded = (u + 0x7FFFu + ((u >> 16) & 1u)) >> 16;
  const bool nan = (u & 0x7FFFFFFFu) > 0x7F800000u;
  return static_cast<std::uint16_t>(nan ? ((u >> 16) | 0x40u) : rounded);
}
T3D_HD inline float float_of(std::uint16_t h) {
  return float_of_bits(static_cast<std::uint32_t>(h) << 16);
}

// RMSNorm. A row's sum of squares (or of dy·w·x) is taken in double over 16 lanes, lane j
// summing the columns c ≡ j (mod 16) in increasing c, then the lanes pairwise (8 + 8, 4 + 4,
// 2 + 2, 1 + 1): the fixed order every backend keeps (row_sum16 on the CPU, 16 threads of a warp
// on the GPU). These are the per-row and per-element steps around that sum.
T3D_HD inline double rms_term(float a, float b) { return static_cast<double>(a) * b; }
T3D_HD inline double rms_term(float a, float b, float e) { return static_cast<double>(a) * b * e; }
T3D_HD inline float rms_rstd(double sum_sq, std::int64_t C, float eps) {
  return static_cast<float>(1.0 / std::sqrt(sum_sq / static_cast<double>(C) + eps));
}
T3D_HD inline float rms_out(float x, float r, float w) { return x * r * w; }
// k of dx_c = r w_c dy_c - k x_c, from dot = sum_c dy_c w_c x_c.
T3D_HD inline float rms_k(double dot, float r, std::int64_t C) {
  return static_cast<float>(dot * r * r * r / static_cast<double>(C));
}
T3D_HD inline float rms_dx(float dy, float x, float w, float r, float k) {
  return r * w * dy - k * x;
}
T3D_HD inline float rms_dweight_term(float dy, float x, float r) { return dy * x * r; }

// The scalars of step t (counted from 1) of an AdamWConfig (kernels/ops.h), on the host. Bias
// corrections in double: beta2^t with beta2 = 0.999 and large t needs the precision.
template <class AdamWConfig>
AdamWScalars adamw_scalars(const AdamWConfig& cfg, std::int64_t step) {
  const double bc1 = 1.0 - std::pow(static_cast<double>(cfg.beta1), static_cast<double>(step));
  const double bc2 = 1.0 - std::pow(static_cast<double>(cfg.beta2), static_cast<double>(step));
  return {cfg.beta1,
          cfg.beta2,
          cfg.eps,
          1.0f - cfg.lr * cfg.weight_decay,
          static_cast<float>(cfg.lr / bc1),
          static_cast<float>(1.0 / std::sqrt(bc2)),
          cfg.grad_scale};
}

// One element of AdamW, torch's order: g = grad · scale; m, v updated; then
// p - lr/bc1 · m / (sqrt(v)/sqrt(bc2) + eps) after the decoupled decay p · (1 - lr·wd).
T3D_HD inline void adamw_element(float& p, float grad, float& m, float& v, const AdamWScalars& s) {
  const float g = grad * s.grad_scale;
  const float mi = s.beta1 * m + (1.0f - s.beta1) * g;
  const float vi = s.beta2 * v + (1.0f - s.beta2) * g * g;
  m = mi;
  v = vi;
  p = p * s.decay - s.step_size * mi / (std::sqrt(vi) * s.inv_sqrt_bc2 + s.eps);
}

// RoPE's rotation of the pair (x1, x2) = (x[i], x[i + D/2]); sin_signed is sin for the forward,
// -sin for the inverse (the backward).
T3D_HD inline void rope_rotate(float x1, float x2, float cos, float sin_signed, float& y1,
                               float& y2) {
  y1 = x1 * cos - x2 * sin_signed;
  y2 = x2 * cos + x1 * sin_signed;
}

}  // namespace
}  // namespace t3d::kernels::detail
