// Kernel micro-benchmark: sgemm at LLaMA-like shapes and tiled attention forward+backward.
// Prints median GFLOP/s over several runs. OpenBLAS picks its kernels when it loads, so set the
// core type in the environment before starting:  OPENBLAS_CORETYPE=SkylakeX ./bench_kernels
//
// Usage: bench_kernels [threads...]   (default: 1 2)
//        bench_kernels --attention [threads...]   only the bf16 attention at bench/e2e's layer
//        shape (B=8 T=256 H=Hkv=8 D=64, tile 64), median of 41: quick before/after comparisons
// Attention runs in fp32 and, where the CPU has AVX512-BF16, with the bf16 tiles that ranks with
// bf16 linear GEMMs use (kernels/attention_bf16.h).
#include <algorithm>
#include <chrono>
#include <cstdio>
#include <cstdlib>
#include <functional>
#include <string>
#include <vector>

#include "kernels/blas.h"
#include "kernels/gemm.h"
#include "kernels/ops.h"

namespace k = t3d::kernels;

namespace {

// Median seconds of `repeats` calls after one warm-up call.
double median_seconds(const std::function<void()>& fn, int repeats) {
  fn();
  std::vector<double> t;
  for (int r = 0; r < repeats; ++r) {
    const auto t0 = std::chrono::steady_clock::now();
    fn();
    t.push_back(std::chrono::duration<double>(std::chrono::steady_clock::now() - t0).count());
  }
  std::sort(t.begin(), t.end());
  return t[t.size() / 2];
}

std::vector<float> filled(std::size_t n, float v) { return std::vector<float>(n, v); }

void bench_gemm(const char* what, k::Trans ta, k::Trans tb, int M, int N, int K, int repeats) {
  auto A = filled((std::size_t)M * K, 0.01f), B = filled((std::size_t)K * N, 0.02f),
       C = filled((std::size_t)M * N, 0.0f);
  const double s = median_seconds(
      [&] { k::sgemm(ta, tb, M, N, K, 1.0f, A.data(), B.data(), 0.0f, C.data()); }, repeats);
  std::printf("  %-26s M=%5d N=%5d K=%5d  %8.1f GFLOP/s  (%.2f ms)\n", what, M, N, K,
              2.0 * M * N * K / s * 1e-9, s * 1e3);
}

// First "model name" line of /proc/cpuinfo: figures mean little without it.
std::string cpu_model() {
  std::FILE* f = std::fopen("/proc/cpuinfo", "r");
  if (f == nullptr) return "(unknown)";
  char line[512];
  std::string model = "(unknown)";
  while (std::fgets(line, sizeof line, f) != nullptr) {
    const std::string l = line;
    if (l.rfind("model name", 0) == 0 && l.find(':') != std::string::npos) {
      model = l.substr(l.find(':') + 2);
      if (!model.empty() && model.back() == '\n') model.pop_back();
      break;
    }
  }
  std::fclose(f);
  return model;
}

void bench_attention(int B, int T, int H, int Hkv, int D, int tile, int repeats, k::GemmKind kind) {
  k::AttentionShape s{B, T, H, Hkv, D, tile};
  const std::size_t nq = (std::size_t)B * T * H * D, nkv = (std::size_t)B * T * Hkv * D;
  auto q = filled(nq, 0.01f), kk = filled(nkv, 0.02f), v = filled(nkv, 0.03f);
  auto out = filled(nq, 0), dout = filled(nq, 0.01f), dq = filled(nq, 0), dk = filled(nkv, 0),
       dv = filled(nkv, 0), lse = filled((std::size_t)B * H * T, 0);
  auto scratch = filled((std::size_t)k::attention_scratch_floats(s), 0);
  // Useful FLOPs of causal attention (half the T x T square): forward 2 GEMMs, backward 5
  // (one recomputes the scores), each 2 * B * H * (T^2 / 2) * D.
  const double gemm = 2.0 * B * H * (double)T * T / 2 * D;
  const double fwd = median_seconds(
      [&] {
        // attention's tiles follow the linear layers' kind
        k::attention_forward(kind, out.data(), lse.data(), q.data(), kk.data(), v.data(),
                             scratch.data(), s);
      },
      repeats);
  const double bwd = median_seconds(
      [&] {
        k::attention_backward(kind, dq.data(), dk.data(), dv.data(), dout.data(), q.data(),
                              kk.data(), v.data(), out.data(), lse.data(), scratch.data(), s);
      },
      repeats);
  std::printf(
      "  attention %s B=%d T=%5d H=%d Hkv=%d D=%d tile=%3d  fwd %6.1f GFLOP/s (%.2f ms)"
      "  bwd %6.1f GFLOP/s (%.2f ms)\n",
      k::gemm_kind_is_bf16(kind) ? "bf16" : "fp32", B, T, H, Hkv, D, tile, 2 * gemm / fwd * 1e-9,
      fwd * 1e3, 5 * gemm / bwd * 1e-9, bwd * 1e3);
}

}  // namespace

int main(int argc, char** argv) {
  std::vector<int> threads;
  bool attention_only = false;
  for (int i = 1; i < argc; ++i) {
    if (std::string(argv[i]) == "--attention")
      attention_only = true;
    else
      threads.push_back(std::atoi(argv[i]));
  }
  if (threads.empty()) threads = {1, 2};

  std::printf("CPU: %s\n", cpu_model().c_str());
  if (attention_only) {
    if (!k::cpu_has_bf16_dot()) {
      std::printf("no AVX512-BF16 here: the bf16 attention tiles do not run\n");
      return 0;
    }
    for (int t : threads) {
      k::set_blas_threads(t);
      std::printf("threads = %d (median of 41)\n", t);
      bench_attention(8, 256, 8, 8, 64, 64, 41, k::GemmKind::kOneDnnBf16);
    }
    return 0;
  }
  const char* env = std::getenv("OPENBLAS_CORETYPE");
  std::printf("OpenBLAS: %s\n", k::openblas_config_string().c_str());
  std::printf("OPENBLAS_CORETYPE=%s, recommended for this CPU: %s\n", env ? env : "(unset)",
              k::recommended_openblas_coretype().c_str());
  k::verify_gemm_kind(k::GemmKind::kOpenBlasF32);

  for (int t : threads) {
    k::set_blas_threads(t);
    std::printf("\nBLAS threads = %d (median of 7)\n", t);
    // One rank's projections at B*T = 2048 tokens, C = 512: q/o (N=512), gate/up (N=1536),
    // GQA k/v (N=256); then the two backward GEMMs of a 512 -> 1536 linear.
    bench_gemm("fwd  x W^T  (q, o proj)", k::Trans::kNo, k::Trans::kYes, 2048, 512, 512, 7);
    bench_gemm("fwd  x W^T  (gate, up)", k::Trans::kNo, k::Trans::kYes, 2048, 1536, 512, 7);
    bench_gemm("fwd  x W^T  (k, v GQA)", k::Trans::kNo, k::Trans::kYes, 2048, 256, 512, 7);
    bench_gemm("bwd  dy W   (down in-grad)", k::Trans::kNo, k::Trans::kNo, 2048, 512, 1536, 7);
    bench_gemm("bwd  dy^T x (up w-grad)", k::Trans::kYes, k::Trans::kNo, 1536, 512, 2048, 7);
    bench_gemm("square", k::Trans::kNo, k::Trans::kNo, 1024, 1024, 1024, 7);
    std::vector<k::GemmKind> kinds = {k::GemmKind::kOpenBlasF32};
    if (k::cpu_has_bf16_dot()) kinds.push_back(k::GemmKind::kOneDnnBf16);
    for (const k::GemmKind kind : kinds) {
      bench_attention(8, 256, 8, 8, 64, 64, 5, kind);  // bench/e2e's model: a layer's micro-batch
      bench_attention(8, 256, 8, 8, 64, 128, 5, kind);
      bench_attention(2, 1024, 8, 2, 64, 64, 5, kind);
      bench_attention(2, 1024, 8, 2, 64, 128, 5, kind);
      bench_attention(1, 4096, 8, 2, 64, 128, 3, kind);
    }
  }
  return 0;
}
