// Is bf16 GEMM faster than fp32 here? OpenBLAS sgemm (titan3d's path) against oneDNN's matmul in
// fp32 and in bf16 (bf16 inputs, fp32 accumulation and output: what mixed precision would feed
// it), at the model's shapes, 1 and 2 threads, median of several runs. The answer decides whether
// train.precision = "bf16" feeds GEMMs bf16 (see bench/README.md).
//
// Run: OPENBLAS_CORETYPE=SkylakeX OMP_WAIT_POLICY=PASSIVE build/bench/kernels/bench_bf16_gemm
#include <omp.h>

#include <algorithm>
#include <chrono>
#include <cstdio>
#include <functional>
#include <oneapi/dnnl/dnnl.hpp>
#include <random>
#include <vector>

#include "kernels/blas.h"
#include "kernels/precision.h"

namespace {

using Clock = std::chrono::steady_clock;

double median_seconds(const std::function<void()>& fn, int repeats) {
  fn();  // warm-up: packing buffers, primitive caches
  std::vector<double> t;
  for (int i = 0; i < repeats; ++i) {
    const auto t0 = Clock::now();
    fn();
    t.push_back(std::chrono::duration<double>(Clock::now() - t0).count());
  }
  std::sort(t.begin(), t.end());
  return t[t.size() / 2];
}

// C (M, N) = A (M, K) · B (K, N) with oneDNN's matmul primitive; `dt` is the input type.
struct DnnlMatmul {
  dnnl::engine engine{dnnl::engine::kind::cpu, 0};
  dnnl::stream stream{engine};
  dnnl::matmul prim;
  dnnl::memory a, b, c;
  DnnlMatmul(int64_t M, int64_t N, int64_t K, dnnl::memory::data_type dt) {
    using tag = dnnl::memory::format_tag;
    dnnl::memory::desc ad({M, K}, dt, tag::ab), bd({K, N}, dt, tag::ab),
        cd({M, N}, dnnl::memory::data_type::f32, tag::ab);
    prim = dnnl::matmul(dnnl::matmul::primitive_desc(dnnl::matmul::desc(ad, bd, cd), engine));
    a = dnnl::memory(ad, engine);
    b = dnnl::memory(bd, engine);
    c = dnnl::memory(cd, engine);
  }
  void run() {
    prim.execute(stream, {{DNNL_ARG_SRC, a}, {DNNL_ARG_WEIGHTS, b}, {DNNL_ARG_DST, c}});
    stream.wait();
  }
};

}  // namespace

int main() {
  using t3d::kernels::Trans;
  std::printf("OpenBLAS: %s\n", t3d::kernels::openblas_config_string().c_str());
  const std::vector<std::array<int64_t, 3>> shapes = {
      {2048, 512, 512}, {2048, 1408, 512}, {2048, 512, 1408}, {512, 1536, 512}};
  std::mt19937 rng(1);
  std::normal_distribution<float> normal;
  for (int threads : {1, 2}) {
    t3d::kernels::set_blas_threads(threads);
    omp_set_num_threads(threads);
    std::printf("\nthreads = %d (median of 7)\n%-22s %12s %12s %12s %10s\n", threads, "M x N x K",
                "OpenBLAS f32", "oneDNN f32", "oneDNN bf16", "bf16/f32");
    for (const auto& [M, N, K] : shapes) {
      std::vector<float> A(M * K), B(K * N), C(M * N);
      for (auto& x : A) x = normal(rng);
      for (auto& x : B) x = normal(rng);
      const double flops = 2.0 * M * N * K;
      const double t_blas = median_seconds(
          [&] {
            t3d::kernels::sgemm(Trans::kNo, Trans::kNo, M, N, K, 1.0f, A.data(), B.data(), 0.0f,
                                C.data());
          },
          7);
      DnnlMatmul f32(M, N, K, dnnl::memory::data_type::f32);
      std::copy(A.begin(), A.end(), static_cast<float*>(f32.a.get_data_handle()));
      std::copy(B.begin(), B.end(), static_cast<float*>(f32.b.get_data_handle()));
      const double t_f32 = median_seconds([&] { f32.run(); }, 7);
      DnnlMatmul bf16(M, N, K, dnnl::memory::data_type::bf16);
      t3d::kernels::float_to_bf16(static_cast<uint16_t*>(bf16.a.get_data_handle()), A.data(),
                                  M * K);
      t3d::kernels::float_to_bf16(static_cast<uint16_t*>(bf16.b.get_data_handle()), B.data(),
                                  K * N);
      const double t_bf16 = median_seconds([&] { bf16.run(); }, 7);
      std::printf("%5ld x %5ld x %5ld   %7.1f GF/s %7.1f GF/s %7.1f GF/s %9.2fx\n", long(M),
                  long(N), long(K), flops / t_blas / 1e9, flops / t_f32 / 1e9, flops / t_bf16 / 1e9,
                  t_blas / t_bf16);
    }
  }
  return 0;
}
