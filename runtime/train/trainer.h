// The training loop: data → pipeline executor (forward/backward, TP inside the model, P2P between
// stages) → data-parallel gradient all-reduce → exact global-norm clipping → AdamW with warm-up
// and cosine decay → metrics. Every rank runs it; rank 0 speaks.
#pragma once

#include <cstdint>
#include <memory>
#include <string>
#include <vector>

#include "runtime/launch/job.h"
#include "runtime/train/router_balance.h"

namespace t3d::runtime {

struct StepRecord {
  int64_t step = 0;  // 1-based: the number of optimizer steps taken
  double loss = 0, lr = 0, grad_norm = 0, tokens_per_s = 0, step_time_s = 0;
  double mfu = 0;        // model FLOPs/s over the hardware peak of the GEMMs' precision
  double mfu_gemm = 0;   // the same over the chosen GEMM's own rate at the model's shapes
  double val_loss = -1;  // < 0: not measured at this step
  // Share of the step each rank spent waiting on its tp / dp / pp / cp / ep group, averaged over
  // ranks. The pp share is the measured pipeline bubble plus activation transfer time; the ep
  // share the experts' all-to-alls.
  double tp_comm_share = 0, dp_comm_share = 0, pp_wait_share = 0, cp_comm_share = 0,
         ep_comm_share = 0;
  double peak_mem_gib = 0;  // largest arena peak over all ranks
  bool skipped = false;     // dynamic loss scaling skipped a non-finite step
  double replay_s = 0;  // rank 0's time replaying and comparing (run.replay_every), in step_time_s
  // The times this rank's host waited for its device's queued ops in the step (kernels::host_waits:
  // on a GPU each drains the stream), validation included.
  int64_t host_waits = 0;
  // Mixture of experts: the weighted auxiliary balance loss (not in `loss`), and the load: per
  // MoE layer, the largest imbalance over layers, the routed and dropped slots, the bias range.
  double aux_loss = 0;
  ExpertLoad expert_load;
};

struct TrainSummary {
  std::vector<StepRecord> steps;
  double unigram_entropy_nats = 0;  // of the training split: the loss to beat (rank 0; else 0)
  size_t peak_arena_bytes = 0;
  double peak_gflops = 0;       // this host's measured hardware peak, MFU's denominator
  double gemm_peak_gflops = 0;  // this host's measured GEMM rate, mfu_gemm's denominator
  std::string device = "cpu";   // rank 0's hardware.device, as kernels::Device describes it
};

class Trainer {
 public:
  // Builds everything (data, schedule, arena, model); failures are agreed on across ranks.
  explicit Trainer(const Job& job);
  ~Trainer();
  TrainSummary run();

 private:
  struct Impl;
  std::unique_ptr<Impl> impl_;
};

}  // namespace t3d::runtime
