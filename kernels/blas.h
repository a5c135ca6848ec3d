// The BLAS backend: the only code in titan3d that calls cblas_* (ggml-blas style, thin).
//
// Matrices are row-major. Callers express transposes with flags and leading dimensions and never
// copy: a strided sub-matrix (one head of q, a tile of k) is just a pointer and an ld.
//
// OpenBLAS chooses its kernels when libopenblas is loaded, from OPENBLAS_CORETYPE or its own CPU
// detection. Debian's 0.3.21 does not recognise recent Xeons and falls back to Prescott (SSE3)
// kernels, ~5x slower. The core type cannot be changed in-process, so the launcher calls
// recommended_openblas_coretype() and exports OPENBLAS_CORETYPE before ranks start;
// openblas_config_string() reports what actually loaded and verify_gemm_kind (kernels/gemm.h)
// checks the result.
#pragma once

#include <cstdint>
#include <string>

namespace t3d::kernels {

enum class Trans : bool { kNo = false, kYes = true };

// C (M, N) = alpha * op(A) (M, K) * op(B) (K, N) + beta * C.
// op(A) is A (M, K) with leading dimension lda, or A^T with A stored (K, M); likewise B.
void sgemm(Trans trans_a, Trans trans_b, std::int64_t M, std::int64_t N, std::int64_t K,
           float alpha, const float* A, std::int64_t lda, const float* B, std::int64_t ldb,
           float beta, float* C, std::int64_t ldc);

// Same, with packed (contiguous) matrices: leading dimensions follow from the shapes.
void sgemm(Trans trans_a, Trans trans_b, std::int64_t M, std::int64_t N, std::int64_t K,
           float alpha, const float* A, const float* B, float beta, float* C);

// Threads of OpenBLAS's own pool for this process. Keep threads per rank x ranks <= cores.
void set_blas_threads(int n);
int blas_threads();

struct CpuFeatures {
  bool avx2 = false, fma = false;
  bool avx512f = false, avx512bw = false, avx512vl = false, avx512dq = false;
  bool avx512_bf16 = false;  // the AVX512-BF16 dot product (vdpbf16ps)
  bool amx_bf16 = false;     // AMX tiles with the bf16 tile product (tdpbf16ps), OS-enabled
};
// This CPU's features as titan3d's kernels use them: cpuid (with the OS's AVX-512 state), capped
// by oneDNN's own ONEDNN_MAX_CPU_ISA (or its older name DNNL_MAX_CPU_ISA), read on every call.
// oneDNN caps its kernels by it; honouring it here too makes one variable make the whole process
// behave as on an older CPU: ONEDNN_MAX_CPU_ISA=AVX2 (with OPENBLAS_CORETYPE=Haswell) is a CPU
// without AVX-512 such as AMD Zen 3, down to the SIMD rows, bf16 rounding and attention, the
// peaks and the GEMM candidates.
CpuFeatures detect_cpu_features();
// `f` less what a oneDNN ISA cap leaves out (oneDNN's names, any case): SSE41 and AVX keep no AVX2,
// FMA or AVX-512; AVX2 and AVX2_VNNI keep no AVX-512; AVX512_CORE and AVX512_CORE_VNNI keep no
// AVX512-BF16; AVX512_CORE_BF16 and AVX512_CORE_FP16 keep no AMX. Null, empty, ALL, a later ISA or
// a name oneDNN does not know (which it ignores too): `f` as it is.
CpuFeatures cap_cpu_features(CpuFeatures f, const char* max_isa);
// That variable's value when it takes a feature away from this CPU, else "": part of the CPU's
// identity for caches and records (cpu_model_name), since what is measured under it differs.
std::string cpu_isa_cap();

// The best OPENBLAS_CORETYPE for a CPU: "SkylakeX" (AVX-512 F/BW/VL/DQ), "Haswell" (AVX2+FMA),
// or "" (leave OpenBLAS's own detection alone).
std::string recommended_openblas_coretype(const CpuFeatures& f);
std::string recommended_openblas_coretype();  // for this CPU

// What OpenBLAS actually loaded, e.g. "OpenBLAS 0.3.21 DYNAMIC_ARCH ... core=SkylakeX threads=2".
std::string openblas_config_string();
std::string openblas_corename();  // e.g. "SkylakeX", "Prescott"

// Median GFLOP/s of C = A B (M, N, K) over `repeats` runs with `threads` BLAS threads (restored
// afterwards). Allocates; call outside the step loop.
double measure_sgemm_gflops(std::int64_t M, std::int64_t N, std::int64_t K, int threads,
                            int repeats = 5);

}  // namespace t3d::kernels
