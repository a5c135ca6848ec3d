// The GPU's bf16 tensor-core attention tiles (kernels/cuda/ops_attention_bf16.cu) against the
// CPU's fp32 tiles (test_attention.cpp checks those against finite differences and, for context
// parallelism, against full attention) on bf16-rounded inputs, so what is left is the kernel's
// own rounding of P and dS to bf16 and its fp32 sums: the bounds of test_attention_bf16.cpp
// (out within 2^-8 max|v|, lse within fp32 error, gradients within 1e-2 of their largest value;
// a wrong index, mask, fragment or tile gives errors of the order of the values themselves).
// Also: every output element written, two runs give the same bits, the dispatch by GEMM kind, and
// head dims above 128 on the fp32 tiles. Each test needs a GPU and skips with the reason where the
// process sees none.
#include <gtest/gtest.h>

#include <cmath>
#include <cstdlib>
#include <string>
#include <vector>

#include "kernels/cuda/cuda_ops.h"
#include "kernels/gemm.h"
#include "kernels/ops.h"
#include "kernels/precision.h"
#include "tests/kernels/gpu_compare.h"
#include "tests/kernels/reference.h"
#include "tests/kernels/the_gpu.h"

namespace t3d::kernels {
namespace {

namespace gpu = cuda;
using cuda::testing::Dev;
using cuda::testing::expect_same_bits;
using cuda::testing::S;

struct Case {
  std::int64_t B, T, H, Hkv, D, q_pos, kv_len;
  float q_scale;
};

std::string name(const Case& c) {
  return "B" + std::to_string(c.B) + " T" + std::to_string(c.T) + " H" + std::to_string(c.H) + "/" +
         std::to_string(c.Hkv) + " D" + std::to_string(c.D) + " q_pos " + std::to_string(c.q_pos) +
         " of " + std::to_string(c.kv_len) + " qs " + std::to_string(c.q_scale);
}

AttentionShape shape_of(const Case& c) {
  AttentionShape s;
  s.B = c.B, s.T = c.T, s.n_heads = c.H, s.n_kv_heads = c.Hkv, s.head_dim = c.D;
  s.q_pos = c.q_pos, s.kv_len = c.kv_len, s.tile = 32;
  return s;
}

std::vector<float> rounded(std::vector<float> x, float scale = 1.0f) {
  for (auto& v : x) v = bf16_to_float(float_to_bf16(v * scale));
  return x;
}

struct Inputs {
  std::vector<float> q, k, v, dout;
};

Inputs inputs(const Case& c, const AttentionShape& s) {
  const std::size_t nq = c.B * c.T * c.H * c.D, nkv = c.B * s.keys() * c.Hkv * c.D;
  return {rounded(ref::random_floats(nq, 70), c.q_scale), rounded(ref::random_floats(nkv, 71)),
          rounded(ref::random_floats(nkv, 72)), rounded(ref::random_floats(nq, 73))};
}

struct Outputs {
  std::vector<float> out, lse, dq, dk, dv;
};

// The CPU's fp32 tiles (one thread: its own fixed order).
Outputs cpu_fp32(const Inputs& in, const AttentionShape& s) {
  Outputs r{std::vector<float>(in.q.size()),
            std::vector<float>(static_cast<std::size_t>(s.B * s.n_heads * s.T)),
            std::vector<float>(in.q.size()), std::vector<float>(in.k.size()),
            std::vector<float>(in.k.size())};
  std::vector<float> scratch(attention_scratch_floats(s));
  ref::with_threads(1, [&] {
    attention_forward(ref::kFp32, r.out.data(), r.lse.data(), in.q.data(), in.k.data(), in.v.data(),
                      scratch.data(), s);
    attention_backward(ref::kFp32, r.dq.data(), r.dk.data(), r.dv.data(), in.dout.data(),
                       in.q.data(), in.k.data(), in.v.data(), r.out.data(), r.lse.data(),
                       scratch.data(), s);
  });
  return r;
}

// One forward and backward on the GPU through `exec`, every output starting as garbage.
Outputs gpu_run(const Exec& exec, const Inputs& in, const AttentionShape& s) {
  const std::size_t nq = in.q.size(), nkv = in.k.size(), nl = s.B * s.n_heads * s.T;
  Dev<float> q(in.q), k(in.k), v(in.v), dout(in.dout);
  Dev<float> out(std::vector<float>(nq, 5.0f)), lse(std::vector<float>(nl, 5.0f)),
      dq(std::vector<float>(nq, 5.0f)), dk(std::vector<float>(nkv, 5.0f)),
      dv(std::vector<float>(nkv, 5.0f));
  attention_forward(exec, out.p(), lse.p(), q.p(), k.p(), v.p(), nullptr, s);
  attention_backward(exec, dq.p(), dk.p(), dv.p(), dout.p(), q.p(), k.p(), v.p(), out.p(), lse.p(),
                     nullptr, s);
  return {out.host(), lse.host(), dq.host(), dk.host(), dv.host()};
}

Exec gpu_bf16() { return Exec(GemmKind::kOneDnnBf16, S()); }
Exec gpu_fp32() { return Exec(GemmKind::kOpenBlasF32, S()); }

// Head dims padded to each of the kernel's widths (32, 64, 128), grouped and multi-query heads,
// T not a multiple of the 64-row tiles, several key tiles, context-parallel chunks (queries at
// 70.. of 130 keys; at 128.. of 300, the keys past the last query's position get zero gradients),
// a peaked softmax.
const Case kCases[] = {
    {2, 150, 4, 2, 64, 0, 0, 1.0f},  {1, 60, 2, 1, 40, 70, 130, 1.0f},
    {1, 200, 2, 2, 128, 0, 0, 1.0f}, {1, 100, 2, 1, 128, 128, 300, 1.0f},
    {1, 33, 3, 1, 16, 0, 0, 1.0f},   {1, 9, 2, 2, 5, 0, 0, 1.0f},
    {1, 130, 4, 2, 32, 0, 0, 12.0f},
};

TEST(CudaAttentionBf16, MatchesTheCpuWithinBf16Rounding) {
  REQUIRE_GPU();
  for (const Case& c : kCases) {
    const AttentionShape s = shape_of(c);
    const Inputs in = inputs(c, s);
    const Outputs want = cpu_fp32(in, s);
    const Outputs got = gpu_run(gpu_bf16(), in, s);
    const std::string at = name(c);
    ref::expect_close(got.out, ref::to_double(want.out), 0.0, std::ldexp(1.0, -8), at.c_str());
    ref::expect_close(got.lse, ref::to_double(want.lse), 2e-5, 2e-6, ("lse " + at).c_str());
    ref::expect_close_to_max(got.dq, ref::to_double(want.dq), 1e-2, ("dq " + at).c_str());
    ref::expect_close_to_max(got.dk, ref::to_double(want.dk), 1e-2, ("dk " + at).c_str());
    ref::expect_close_to_max(got.dv, ref::to_double(want.dv), 1e-2, ("dv " + at).c_str());
    if (c.T > 16) {  // control: P really rounded to bf16 (not the fp32 tiles' result)
      EXPECT_GT(ref::max_abs_diff(got.out, ref::to_double(want.out)), 1e-5)
          << "as exact as fp32: " << at;
    }
  }
}

TEST(CudaAttentionBf16, RepeatsItsBits) {
  REQUIRE_GPU();
  for (const Case& c : {kCases[0], kCases[3]}) {
    const AttentionShape s = shape_of(c);
    const Inputs in = inputs(c, s);
    const Outputs a = gpu_run(gpu_bf16(), in, s), b = gpu_run(gpu_bf16(), in, s);
    const std::string at = name(c);
    expect_same_bits(b.out, a.out, ("out twice " + at).c_str());
    expect_same_bits(b.lse, a.lse, ("lse twice " + at).c_str());
    expect_same_bits(b.dq, a.dq, ("dq twice " + at).c_str());
    expect_same_bits(b.dk, a.dk, ("dk twice " + at).c_str());
    expect_same_bits(b.dv, a.dv, ("dv twice " + at).c_str());
  }
}

// attention_forward / _backward given a GPU Exec: a bf16 GEMM kind runs the bf16 tiles, an fp32
// kind the fp32 tiles, and a head dim above 128 the fp32 tiles whatever the kind.
TEST(CudaAttentionBf16, TheGemmKindChoosesTheTiles) {
  REQUIRE_GPU();
  if (const char* env = std::getenv("T3D_GPU_ATTENTION"); env && std::string(env) == "fp32")
    GTEST_SKIP() << "T3D_GPU_ATTENTION=fp32 sends every kind to the fp32 tiles";
  for (const Case& c : {kCases[0], Case{1, 40, 2, 2, 160, 0, 0, 1.0f}}) {
    const AttentionShape s = shape_of(c);
    const Inputs in = inputs(c, s);
    const std::size_t nq = in.q.size(), nl = s.B * s.n_heads * s.T;
    Dev<float> q(in.q), k(in.k), v(in.v), o16(nq), l16(nl), o32(nq), l32(nl);
    gpu::attention_forward_bf16(S(), o16.p(), l16.p(), q.p(), k.p(), v.p(), s);
    gpu::attention_forward(S(), o32.p(), l32.p(), q.p(), k.p(), v.p(), s);
    const Outputs via_bf16 = gpu_run(gpu_bf16(), in, s), via_fp32 = gpu_run(gpu_fp32(), in, s);
    const std::string at = name(c);
    EXPECT_EQ(gpu::attention_bf16_tiles(s), c.D <= 128) << at;
    expect_same_bits(via_bf16.out, c.D <= 128 ? o16.host() : o32.host(),
                     ("bf16 kind " + at).c_str());
    expect_same_bits(via_fp32.out, o32.host(), ("fp32 kind " + at).c_str());
    if (c.D <= 128) {
      EXPECT_NE(o16.host(), o32.host()) << "the two tiles agree bit for bit: " << at;
    }
  }
}

}  // namespace
}  // namespace t3d::kernels
