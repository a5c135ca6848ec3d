// One rank's pipeline stage, built one way for the verbs that run the model's stage: train and
// eval (calibration's one-block probe and selfcheck's sharded-vs-unsharded check build Models of
// their own from model_options, for the reasons they state). From the recipe, the mesh and the
// job's precision (Job::precision: the GEMM kind and train.precision, decided before) it derives
//   - the compute threads (OpenBLAS and OpenMP pools: runtime/machine/machine.h) and a check that
//     the GEMMs compute right,
//   - the schedule and its placement (Schedule::chunk_stage, the only representation of which
//     stage holds which chunk), hence this stage's layer ranges,
//   - the pipeline executor, the arena (hardware.hbm_gib) and the Model with the options the
//     purpose needs (training: slots per the schedule, ZeRO regions, checkpointing, split
//     backward; forward-only: one slot per chunk, no optimizer state),
//   - the micro-batch rows (train.global_batch over dp × micro-batches),
// and the recipe's token streams (data.path, data.val_path or the held-out tail).
#pragma once

#include <cstdint>
#include <functional>
#include <memory>
#include <vector>

#include "kernels/arena.h"
#include "kernels/device.h"
#include "parallel/pipeline_split.h"
#include "parallel/schedule.h"
#include "parallel/staged_comm.h"
#include "runtime/data/data.h"
#include "runtime/data/data_sampler.h"
#include "runtime/launch/job.h"
#include "runtime/model/model.h"
#include "runtime/recipe/recipe.h"
#include "runtime/stage/device_comm.h"
#include "runtime/stage/executor.h"

namespace t3d::runtime {

enum class StagePurpose {
  kTrain,    // forward and backward per the schedule, with the recipe's ZeRO and checkpointing
  kForward,  // forward passes only (eval, probes): one activation slot, no optimizer state
};

// The recipe's pipeline schedule (parallel.schedule, virtual_stages, train.micro_batches) on pp
// stages: the action tables and the placement every stage reads.
parallel::Schedule stage_schedule(const Recipe& r, int pp);

// This stage's layer ranges in model order: the recipe's split of the layers into pp ×
// virtual_stages chunks, placed as the schedule says.
std::vector<parallel::LayerRange> stage_layers(const ModelConfig& model,
                                               const std::vector<int64_t>& pipeline_split,
                                               const parallel::Schedule& schedule, int stage);

// The Model's options for `purpose` (the executor gives the training slots; cp may be null), in
// the job's `precision`.
ModelOptions model_options(const Recipe& r, const JobPrecision& precision, StagePurpose purpose,
                           int64_t micro_rows, const PipelineExecutor* executor,
                           const parallel::TensorComm* cp);

// The tensor groups of a stage's Model, executor and training state: the mesh's own (MPI over host
// memory) on a CPU, or StagedComms over them where its device memory is guarded as a GPU's
// (T3D_GUARD_DEVICE_MEMORY=1, kernels/memory_guard.h); on a GPU, per group, NCCL or a StagedComm as
// parallel.device_comm (`key`) and the group's devices decide (runtime/stage/device_comm.h),
// each logged. Collective over every group.
class StageGroups {
 public:
  // pp_in_send_order: the schedule's stages take each other's messages in send order
  // (parallel::receives_in_send_order), which the pp group needs for NCCL.
  StageGroups(const parallel::Mesh& mesh, const kernels::Device& device, DeviceComm key,
              bool pp_in_send_order);
  const parallel::TensorComm& tp() const { return pick(tp_, mesh_.group(parallel::Dim::tp)); }
  const parallel::TensorComm& pp() const { return pick(pp_, mesh_.group(parallel::Dim::pp)); }
  const parallel::TensorComm& cp() const { return pick(cp_, mesh_.group(parallel::Dim::cp)); }
  // The gradient groups (parallel/mesh.h): dense parameters over dp × cp, experts over edp.
  const parallel::TensorComm& dp_cp() const { return pick(dp_cp_, mesh_.dp_cp()); }
  const parallel::TensorComm& edp() const { return pick(edp_, mesh_.edp()); }
  // The EP group's tensor transfers (the experts' rows and gates; its counts stay on mesh.ep()).
  const parallel::TensorComm& ep() const { return pick(ep_, mesh_.ep()); }

 private:
  static const parallel::TensorComm& pick(const std::unique_ptr<parallel::TensorComm>& own,
                                          const parallel::TensorComm& direct) {
    if (own) return *own;
    return direct;
  }
  const parallel::Mesh& mesh_;
  std::unique_ptr<parallel::TensorComm> tp_, pp_, cp_, dp_cp_, edp_, ep_;
};

struct Stage {
  // hardware.device: first, so that it outlives the memory and the Model built on its Exec.
  std::unique_ptr<kernels::Device> device;
  // Before the groups, so that it is freed after them: on a GPU, freeing it waits for the device,
  // and when unwinding from an error with NCCL operations in flight only the groups' end (their
  // communicators aborted) lets those finish.
  std::unique_ptr<kernels::Arena> arena;
  std::unique_ptr<StageGroups> groups;  // before the executor and Model, which hold its groups
  int threads = 1;
  int64_t micro_rows = 0;  // sequences per micro-batch on this rank
  std::vector<parallel::LayerRange> layers;
  std::unique_ptr<PipelineExecutor> executor;
  std::unique_ptr<Model> model;
  bool holds_loss = false;  // last pipeline stage and tp rank 0: contributes the loss once
};

// Builds this rank's stage, in job.precision(), which must be set. Collective over the job's
// world: what a rank can fail at alone before the groups (threads, the GEMM check, the device) is
// agreed there (agree_on), then the groups are made (collective on a GPU); wrap the call in
// agree_on for what follows (the arena, the Model). The Model's parameters are not initialised:
// training initialises or restores them, eval reads them from a snapshot.
Stage build_stage(const Job& job, StagePurpose purpose);

// The micro-batches a rank feeds its stage, training and eval alike: sampled for its data-parallel
// rank (Sampler::sample: whole rows), then cut to its context-parallel rank's positions
// (cp_local_positions). `slots` micro-batches stay valid at once: training keeps a step's
// micro-batches until the last chunk has read their targets.
class MicroBatchFeed {
 public:
  MicroBatchFeed(int64_t rows, int64_t seq_len, int cp, int cp_rank, int slots);
  // Edits a micro-batch's whole rows before the cut (eval scores rows past its data as nothing).
  using Mask = std::function<void(const Batch& whole)>;
  // Micro-batch mb of `step` lands in slot mb % slots.
  MicroBatchSource source(const Sampler& sampler, int64_t step, int dp_rank, int dp, int n_micro,
                          Mask mask = {});

 private:
  int64_t rows_, seq_len_;
  int cp_, cp_rank_, slots_;
  std::vector<int32_t> tokens_, targets_;              // (slots, rows · seq_len / cp)
  std::vector<int32_t> whole_tokens_, whole_targets_;  // (rows · seq_len), when cp > 1
};

// The recipe's token streams: training text and validation text (data.val_path, or the last
// data.val_fraction of data.path cut at a window boundary; empty when neither).
struct StageData {
  TokenStream train, val;
};
StageData load_stage_data(const Recipe& r);

// Before any rank starts (and in --dry-run): data.tokenizer opens and model.vocab_size holds its
// ids; UserError naming both keys otherwise. (Ranks check again when they encode the data.)
void check_tokenizer(const Recipe& r);

}  // namespace t3d::runtime
