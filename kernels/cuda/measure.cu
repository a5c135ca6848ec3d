// One GPU's rates for selfcheck (cuda_ops.h, measure_rates).
#include <chrono>
#include <cstring>
#include <limits>

#include "kernels/cuda/cuda_internal.cuh"

namespace t3d::kernels::cuda {

namespace {

// Best wall time over `rounds` of `body` on `s`, the stream idle before and waited for after.
template <class Body>
double best_seconds(const Stream& s, int rounds, Body&& body) {
  double best = std::numeric_limits<double>::infinity();
  for (int round = 0; round < rounds; ++round) {
    s.synchronize();
    const auto t0 = std::chrono::steady_clock::now();
    body();
    s.synchronize();
    const std::chrono::duration<double> dt = std::chrono::steady_clock::now() - t0;
    best = std::min(best, dt.count());
  }
  return best;
}

// Pinned host memory, given back on every path.
struct PinnedBlock {
  void* data = nullptr;
  explicit PinnedBlock(std::size_t bytes) { T3D_CUDA_CHECK(cudaMallocHost(&data, bytes)); }
  ~PinnedBlock() { cudaFreeHost(data); }
  PinnedBlock(const PinnedBlock&) = delete;
  PinnedBlock& operator=(const PinnedBlock&) = delete;
};

}  // namespace

Device::Rates measure_rates(const Stream& s, std::int64_t M, std::int64_t N, std::int64_t K,
                            std::size_t bytes, int rounds) {
  T3D_CUDA_CHECK(cudaSetDevice(s.device()));
  Device::Rates r;
  const DeviceMemory x(static_cast<std::size_t>(M * K) * sizeof(float), "selfcheck GEMM input");
  const DeviceMemory w(static_cast<std::size_t>(N * K) * sizeof(float), "selfcheck GEMM weight");
  const DeviceMemory y(static_cast<std::size_t>(M * N) * sizeof(float), "selfcheck GEMM output");
  zero(s, x.as<float>(), M * K);
  zero(s, w.as<float>(), N * K);
  constexpr int kReps = 4;  // GEMMs per timed round: launch gaps amortised
  const double flops =
      2.0 * static_cast<double>(M) * static_cast<double>(N) * static_cast<double>(K) * kReps;
  for (const GemmPrecision p : {GemmPrecision::kFp32, GemmPrecision::kBf16}) {
    const auto gemms = [&] {
      for (int i = 0; i < kReps; ++i)
        linear_forward(s, p, y.as<float>(), x.as<float>(), w.as<float>(), M, K, N);
    };
    gemms();  // warm-up: cuBLAS's heuristics and the bf16 input buffer
    const double t = best_seconds(s, rounds, gemms);
    (p == GemmPrecision::kFp32 ? r.gemm_fp32_tflops : r.gemm_bf16_tflops) = flops / t / 1e12;
  }
  const PinnedBlock host(bytes);
  std::memset(host.data, 0, bytes);
  const DeviceMemory device(bytes, "selfcheck copy");
  r.h2d_gbps = static_cast<double>(bytes) / 1e9 /
               best_seconds(s, rounds, [&] { copy_to_device(s, device.data(), host.data, bytes); });
  r.d2h_gbps = static_cast<double>(bytes) / 1e9 /
               best_seconds(s, rounds, [&] { copy_to_host(s, host.data, device.data(), bytes); });
  return r;
}

}  // namespace t3d::kernels::cuda
