// The hardware's arithmetic peak, measured: what MFU is a fraction of (docs/metrics.md).
//
// fp32: a loop of independent chains of dependent vector FMAs (enough chains to hide the FMA
// latency on both FMA pipes), AVX-512 where the CPU has it, else AVX2. bf16: the same loop with
// the AVX512-BF16 dot product (vdpbf16ps: two bf16 products added into each fp32 lane), the
// instruction bf16 GEMMs are built from; 0 where the CPU lacks it. On a CPU with AMX (Sapphire
// Rapids and later), where oneDNN's bf16 GEMMs run on the tiles instead, bf16 also measures the
// tile product (tdpbf16ps) on six independent tiles. One core's rate: the host's peak is that
// times its cores.
#pragma once

#include <string>

namespace t3d::kernels {

struct CorePeak {
  double fp32_gflops = 0;      // per core
  double bf16_gflops = 0;      // per core; 0 without AVX512-BF16
  double amx_bf16_gflops = 0;  // per core: AMX bf16 tiles; 0 without AMX (or not granted by the OS)
  const char* fp32_isa = "";   // "avx512" or "avx2" (or "scalar")
};

// "AMD EPYC (family 26, model 2)": /proc/cpuinfo's model name with family and model, the
// identity of a CPU for caches and for every recorded figure ("unknown CPU" where unreadable);
// with an ISA cap that takes features away (cpu_isa_cap), "..., model 2, ONEDNN_MAX_CPU_ISA=AVX2)".
std::string cpu_model_name();

// Whether this process may run AMX bf16 tiles: the CPU has them, the ISA cap keeps them and Linux
// granted the tile state (asked once).
bool cpu_runs_amx_bf16();

// Best of `rounds` timed runs of about 20 ms each on the calling thread.
CorePeak measure_core_peak(int rounds = 5);

}  // namespace t3d::kernels
