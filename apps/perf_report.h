// The end-of-run performance table (the reference's: layout, devices, per-device peak memory,
// tokens/s per device and in all, communication share of TP, DP and PP (and CP, EP), pipeline
// bubble, MFU), computed from the TrainSummary the trainer returns. Formulas in docs/metrics.md.
#pragma once

#include <cstdint>
#include <string>

#include "runtime/launch/job.h"
#include "runtime/supervise/supervisor.h"
#include "runtime/train/trainer.h"

namespace t3d::runtime {

struct PerfSummary {
  std::string layout;  // "pp2 dp2 tp2, 1f1b, 2 micro-batches"
  int devices = 0;
  std::string device;       // rank 0's: "cpu", or "cuda:0 NVIDIA H100 80GB HBM3, ..."
  int steps_measured = 0;   // steps averaged (the first, warm-up, step is left out)
  double peak_mem_gib = 0;  // largest arena peak of any rank
  double tokens_per_s = 0;  // all devices
  double tokens_per_s_per_device = 0;
  double tp_comm_share = 0, dp_comm_share = 0, pp_wait_share = 0, cp_comm_share = 0,
         ep_comm_share = 0;  // of step time, mean over ranks
  double bubble = -1;        // the schedule's simulated bubble fraction (< 0: unknown)
  double mfu = 0;            // over the hardware peak of the GEMMs' precision
  double mfu_gemm = 0;       // over the chosen GEMM's measured rate at the model's shapes
  std::string gemm;          // the linear layers' GEMM kind ("onednn-bf16")
  // Mixture of experts: the largest imbalance over layers (ExpertLoad) at the first and last
  // step and its largest
  // over the run (every step counted); < 0 for a dense model.
  double imbalance_first = -1, imbalance_last = -1, imbalance_max = -1;
  // run.replay_every > 0: the share of step time its checks took (replay_s); < 0 when off.
  double replay_share = -1;
  int64_t replay_every = 0;
};

PerfSummary summarize_performance(const Recipe& recipe, const JobPrecision& precision, int devices,
                                  const TrainSummary& summary);
std::string format_performance(const PerfSummary& perf);
std::string performance_json(const PerfSummary& perf);

// The rows a supervised (self-launched) job adds at its end, printed by the launcher after its
// ranks' table: restarts, time lost, goodput (the supervisor's own figures), any elastic shrink.
std::string format_supervision(const SupervisedRun& run);
// Logs those rows and adds them to <run_dir>/summary.json as "supervision" (when rank 0 wrote it).
void report_supervision(const SupervisedRun& run, const std::string& run_dir);

// Rank 0: logs the table and writes summary.json (with the table's values) into the run
// directory. Other ranks: nothing. Does nothing for a run without steps.
void report_performance(const Job& job, const TrainSummary& summary);

}  // namespace t3d::runtime
