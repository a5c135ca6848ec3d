// Runs one rank's action list of a pipeline schedule (parallel/schedule.h) over its model chunks:
// forwards, backwards, and the point-to-point traffic the table implies. The same executor runs
// every schedule, and pp = 1 is just the one-stage table (F, BW per micro-batch).
//
// Zero-bubble tables split the backward into B (input gradients, sent upstream at once) and W
// (weight gradients, deferred into what would be bubble); a slot stays taken until its W.
// Consecutive chunks on one stage (ZB-V's V turns on stage pp-1; pp = 1 with two chunks) hand the
// activation and its gradient over in memory, in fp32, without a transfer. Every buffer the
// executor keeps is in the stage's memory (StageModel::exec(): the GPU's on a GPU backend), filled
// by kernel ops, and moved through the tensor communicator (parallel/tensor_comm.h).
#pragma once

#include <array>
#include <cstdint>
#include <deque>
#include <functional>
#include <map>
#include <vector>

#include "kernels/arena.h"
#include "parallel/schedule.h"
#include "parallel/tensor_comm.h"
#include "runtime/model/stage_model.h"

namespace t3d::runtime {

// Micro-batch data for the first chunk (tokens) and the last (targets); rows·seq_len each.
using MicroBatchSource =
    std::function<void(int micro, const int32_t** tokens, const int32_t** targets)>;

// The precision activations and their gradients travel in between stages (train.precision):
// bf16 halves the bytes; each message is rounded to bf16 once. Hand-overs inside a stage stay fp32.
enum class WirePrecision { kFp32, kBf16 };

class PipelineExecutor {
 public:
  // `schedule` is the whole table; this rank runs ranks[pp.rank()].
  PipelineExecutor(parallel::Schedule schedule, const parallel::TensorComm& pp, WirePrecision wire);

  // Activation slots each local chunk needs (peak micro-batches alive on it), index = local chunk.
  const std::vector<int>& slots_per_chunk() const { return slots_; }
  // Does the table split backwards into B and W (the model must keep W's inputs)?
  bool splits_backward() const;
  int max_slots() const;

  // One step: every action of this rank on `model`, whose chunks() are this rank's chunks of the
  // schedule in model order. Returns the summed loss over the micro-batches of the last chunk (0
  // on ranks without it), taken once at the end (StageModel::take_loss_sum). `training` needs
  // slots_per_chunk() slots per chunk; false runs forwards only (validation), on slot 0.
  double run(StageModel& model, const MicroBatchSource& source, float grad_scale, bool training);

 private:
  int local_chunk(int global_chunk) const;
  double run_forward_only(StageModel& model, const MicroBatchSource& source);
  // One action of a training schedule.
  void run_forward(StageModel& model, const MicroBatchSource& source, const parallel::Action& a,
                   float grad_scale);
  void run_backward(StageModel& model, const parallel::Action& a);
  int take_slot(int c, int mb);  // a free activation slot of local chunk c for micro-batch mb
  void release_slot(int c, int mb);
  // Point-to-point in the wire precision.
  void send(StageModel& model, const float* data, int peer, int tag);
  void wait_sends();
  void receive(StageModel& model, float* data, int peer, int tag);
  // The in-memory hand-over between consecutive chunks on this stage, keyed like the MPI tags.
  bool local(int chunk_a, int chunk_b) const;
  void put_local(const kernels::Exec& exec, const float* data, size_t n, int tag);
  void take_local(const kernels::Exec& exec, float* data, size_t n, int tag);

  parallel::Schedule schedule_;
  const parallel::TensorComm& pp_;
  WirePrecision wire_;
  kernels::Buffer recv16_;            // bf16 wire: (rows, C) a receive lands in before its decode
  std::vector<int> local_of_global_;  // global chunk -> index in model.chunks(), or -1
  std::vector<int> slots_;
  kernels::Buffer grad_in_;  // (rows, C) gradient received for the chunk being backpropagated
  // Per-step bookkeeping, kept between steps so a step does not allocate.
  std::vector<int> slot_of_;            // [mb · chunks + c] -> slot or -1
  std::vector<std::vector<int>> free_;  // [c] free slots
  struct Staging {  // one send in flight: a copy of its data, in the wire precision
    kernels::Buffer data;
    parallel::Request request;
  };
  std::deque<Staging> staging_;  // a deque: growing it never moves a buffer a send still reads
  std::vector<kernels::Buffer> local_pool_;  // hand-over buffers (fp32), reused across steps
  std::vector<int> local_free_;              // indices into local_pool_
  std::map<int, int> local_of_tag_;          // tag -> buffer holding that message
};

}  // namespace t3d::runtime
