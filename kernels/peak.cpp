#include "kernels/peak.h"

#include <algorithm>
#include <chrono>
#include <cstdint>
#include <fstream>
#include <string>

#include "kernels/blas.h"
#include "kernels/gemm.h"
#include "kernels/peak_loops.h"

namespace t3d::kernels {
namespace {

// GFLOP/s of `loop`: iterations scaled until one run takes ~20 ms, then the best of `rounds`.
template <class Loop>
double best_rate(Loop loop, int rounds) {
  float sink = 0;
  std::int64_t iterations = 1 << 12;
  double best = 0;
  for (int r = 0; r < rounds;) {
    const auto t0 = std::chrono::steady_clock::now();
    const double flops = loop(iterations, &sink);
    const double s = std::chrono::duration<double>(std::chrono::steady_clock::now() - t0).count();
    if (s < 0.02 && iterations < (std::int64_t{1} << 40)) {
      iterations *= 2;  // too short to time: not a round
      continue;
    }
    best = std::max(best, flops / s * 1e-9);
    ++r;
  }
  return sink == 12345.678f ? best + 1e-9 : best;  // reads sink: the loops stay
}

std::string cpuinfo_field(const std::string& text, const std::string& name) {
  const auto at = text.find("\n" + name);
  if (at == std::string::npos) return "";
  const auto colon = text.find(':', at), end = text.find('\n', at + 1);
  if (colon == std::string::npos || colon > end) return "";
  std::string v = text.substr(colon + 1, end - colon - 1);
  v.erase(0, v.find_first_not_of(" \t"));
  return v;
}

}  // namespace

std::string cpu_model_name() {
  std::ifstream in("/proc/cpuinfo");
  std::string text = "\n", line;
  for (int i = 0; i < 64 && std::getline(in, line); ++i) text += line + "\n";  // the first CPU
  const std::string name = cpuinfo_field(text, "model name");
  const std::string cap = cpu_isa_cap();
  const std::string capped = cap.empty() ? "" : ", ONEDNN_MAX_CPU_ISA=" + cap;
  if (name.empty()) return "unknown CPU" + (cap.empty() ? "" : " (" + capped.substr(2) + ")");
  return name + " (family " + cpuinfo_field(text, "cpu family") + ", model " +
         cpuinfo_field(text, "model\t") + capped + ")";
}

bool cpu_runs_amx_bf16() {
  static const bool granted = detect_cpu_features().amx_bf16 && detail::amx_tile_state_granted();
  return granted && detect_cpu_features().amx_bf16;  // the cap is read on every call
}

CorePeak measure_core_peak(int rounds) {
  CorePeak p;
  const CpuFeatures f = detect_cpu_features();
  if (f.avx512f) {
    p.fp32_gflops = best_rate(detail::fma_loop_avx512, rounds);
    p.fp32_isa = "avx512";
  } else if (f.avx2 && f.fma) {
    p.fp32_gflops = best_rate(detail::fma_loop_avx2, rounds);
    p.fp32_isa = "avx2";
  } else {
    p.fp32_isa = "scalar";  // no vector FMA: no meaningful peak, MFU is reported as unknown
  }
  if (cpu_has_bf16_dot()) p.bf16_gflops = best_rate(detail::bf16_dot_loop_avx512, rounds);
  if (cpu_runs_amx_bf16()) p.amx_bf16_gflops = best_rate(detail::bf16_tile_loop_amx, rounds);
  return p;
}

}  // namespace t3d::kernels
