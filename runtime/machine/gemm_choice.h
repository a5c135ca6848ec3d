// Which GEMM the linear layers run on, and so the training precision when the recipe says
// `auto`: chosen by measuring on the machine in use, once per CPU, thread count, libraries and
// model shapes (cached), never from a constant written on another machine.
//
// Candidates (kernels/gemm.h), by train.precision and hardware.gemm:
//   fp32: openblas-fp32, onednn-fp32
//   bf16: the two fp32 kinds (bf16 then only stores activations and rounds TP/PP traffic) and
//         onednn-bf16 (bf16 GEMM inputs, fp32 accumulation)
//   auto: all three; the precision becomes bf16 when onednn-bf16 wins, else fp32
// hardware.gemm = openblas or onednn keeps that library's candidates only (onednn with bf16 means
// onednn-bf16). Every rank of a host measures at once (as they will train), the world sums the
// times, and rank 0's cache answers the next run with the same key.
//
// Reproducibility: two kinds round differently, so the choice decides a run's last bits. A
// candidate replaces the one before it in the list only when its slowest measured round beats
// that one's fastest round by kGemmSwitchMargin (preferred_gemm): kinds whose rates overlap
// within the machine's noise keep the earlier one, so re-measuring (a new machine, an emptied
// cache, another layout's key) gives the same answer, and only a clear speed-up changes bits.
// A measurement disturbed by load from elsewhere keeps the choice cached for this CPU instead,
// says so in the log and is not cached (decide_gemm).
//
// On a GPU (rank 0's hardware.device resolves to one) nothing is measured: the GEMMs are cuBLAS in
// the precision's inputs, and the kind only names that precision for the snapshots (what a CPU
// resuming them runs); auto precision is fp32 there until bf16 there is measured against it.
//
// The decision is a value, JobPrecision (runtime/launch/job.h): the verb stores it in its Job once
// (Job::set_precision) and everything that computes reads it from there (the stage's Model, the
// peaks); the user's recipe is not changed. Snapshots record it as concrete recipe values
// (train.precision fp32 or bf16, hardware.gemm openblas or onednn: recipe_as_run), so `resume`
// continues with it (`snapshot.resume` with `auto` values takes them from the snapshot it
// resumes) and eval runs the kind the snapshot trained with (recorded_precision).
#pragma once

#include <string>
#include <utility>
#include <vector>

#include "kernels/device.h"
#include "kernels/gemm.h"
#include "runtime/launch/job.h"

namespace t3d::runtime {

// One candidate's measured GFLOP/s per rank: its fastest and its slowest round.
struct MeasuredGemm {
  kernels::GemmKind kind = kernels::GemmKind::kOpenBlasF32;
  double fastest = 0, slowest = 0;
};

inline constexpr double kGemmSwitchMargin = 1.05;

// The index of the kind to train with among `rates` (in gemm_candidates' order of preference):
// a later candidate wins only when its slowest round is kGemmSwitchMargin times faster than the
// current winner's fastest round.
size_t preferred_gemm(const std::vector<MeasuredGemm>& rates);

// Load from elsewhere while measuring (other jobs on the cores) can depress one candidate for
// every round (oneDNN fp32 at 0.5 GFLOP/s instead of 195 on a busy 2-core machine) and so flip the
// choice, and with it a fresh run's last bits. A measurement is taken for disturbed when a
// candidate's rounds differ by more than kGemmRoundSpread, or its fastest round is more than
// kGemmCachedDrop below the rate cached for it on this CPU (decide_gemm).
inline constexpr double kGemmRoundSpread = 2;
inline constexpr double kGemmCachedDrop = 8;

struct GemmDecision {
  size_t winner = 0;         // index into the candidates
  std::string interference;  // empty: the measurement decided; else what showed the load
};

// The choice from this run's measurement `measured` (gemm_candidates' order; rate 0: cannot run
// here) and `cached`, the rates cached for the same CPU, threads, libraries and candidates at the
// nearest other model shapes (empty: none). Undisturbed: preferred_gemm(measured). Disturbed: the
// choice the cached rates make (preferred_gemm(cached)), or without them the first candidate that
// runs (the order's tie-break), rather than a choice the load made; `interference` says why.
GemmDecision decide_gemm(const std::vector<MeasuredGemm>& measured,
                         const std::vector<MeasuredGemm>& cached);

struct GemmChoice {
  kernels::GemmKind kind = kernels::GemmKind::kOpenBlasF32;
  TrainPrecision precision = TrainPrecision::kFp32;  // resolved: never auto
  GemmLibrary library = GemmLibrary::kOpenBlas;      // resolved: never auto
  std::string source;  // how it was decided: "measured", "cached", "the recipe", or a snapshot
  std::vector<MeasuredGemm> rates;  // per rank; empty when there was nothing to choose
  std::string device = "cpu";       // rank 0's (kernels::Device::describe): a GPU measures nothing
  int threads = 1;
  // On a GPU: the GEMM algorithms (runtime/machine/gpu_gemm_table.h) and where they came from.
  std::string gpu_gemm_table, gpu_gemm_table_source;
  JobPrecision job_precision() const { return {kind, precision, gpu_gemm_table}; }
};

// The kind a resolved (precision, library) pair means; `auto` in either is a caller's bug.
kernels::GemmKind gemm_kind_of(TrainPrecision precision, GemmLibrary library);

// The candidates of a recipe's (possibly auto) precision and library, in order of preference on
// a tie: OpenBLAS fp32 first (the GEMM of snapshots written before the choice existed).
std::vector<kernels::GemmKind> gemm_candidates(TrainPrecision precision, GemmLibrary library);

// Collective over the job's world. Resolves the recipe's auto values (cache, measurement, or the
// snapshot being resumed), sets the threads of the OpenMP and OpenBLAS pools
// (setup_rank_threads), verifies the chosen kind against a reference, logs the decision with its
// numbers on rank 0 and writes it to <run dir>/gemm_choice.json. Returns the decision; changes
// neither the job nor anything global but the threads: the caller stores job_precision() in the
// job.
GemmChoice choose_gemm(const Job& job);

// The denominators of MFU for a host of `cores` cores training with `kind` (docs/metrics.md):
// the hardware's peak in the precision the GEMMs run in (kernels/peak.h: the fp32 FMA loop, or
// the bf16 dot-product loop for bf16 inputs, one core × cores), and the rate `kind` itself
// reaches at the model's main shapes on one thread × cores. Rank 0 only; cached per CPU.
struct HostPeaks {
  double hardware_gflops = 0;
  double gemm_gflops = 0;
  const char* hardware_what = "";  // "fp32 FMA", "bf16 dot product" or "bf16 AMX tile" (a CPU's)
};
HostPeaks host_peaks(kernels::GemmKind kind, int64_t rows, int64_t in, int64_t out, int cores);
// On a GPU: the datasheet's dense peak (kernels/gpu_specs.h) in the precision `kind`'s GEMMs run
// in, times the GPUs a host's `local_ranks` use (they may share one); no GEMM rate of its own
// (gemm_gflops 0: no mfu_gemm). A GPU the table does not know has no MFU (0), said in the log.
HostPeaks gpu_peaks(const kernels::Device& gpu, kernels::GemmKind kind, int local_ranks);

// The choice a recipe records (a snapshot's, resolved by the run that wrote it), for a job that
// does not measure (eval, selfcheck, calibration): no measurement, no collectives. A key left at
// auto (a hand-written recipe) takes the exact one: train.precision fp32, hardware.gemm openblas.
JobPrecision recorded_precision(const Recipe& recipe);

// The recipe as `job` runs it: the user's, with train.precision and hardware.gemm the job's
// precision. What snapshots store, so that resume and eval take the same choice.
Recipe recipe_as_run(const Job& job);

}  // namespace t3d::runtime
