#include "runtime/executor.h"

#include <algorithm>

#include "kernels/check.h"
#include "kernels/precision.h"
#include "parallel/trace.h"

namespace t3d::runtime {

using parallel::Op;

namespace {
// Message tags: (micro-batch, chunk, direction) -> unique tag (MPI guarantees at least 32767).
int tag_of(int mb, int chunk, int chunks, bool gradient) {
  return (mb * chunks + chunk) * 2 + (gradient ? 1 : 0);
}
}  // namespace

PipelineExecutor::PipelineExecutor(parallel::Schedule schedule, const parallel::Comm& pp)
    : schedule_(std::move(schedule)), pp_(pp) {
  T3D_ASSERT(schedule_.pp == pp_.size(), "schedule for ", schedule_.pp, " stages on a pp group of ",
             pp_.size());
  const int stage = pp_.rank();
  local_of_global_.assign(schedule_.num_chunks(), -1);
  int local = 0;
  for (int k = 0; k < schedule_.num_chunks(); ++k)
    if (schedule_.chunk_stage[k] == stage) local_of_global_[k] = local++;
  // Slots per chunk: the peak of micro-batches forwarded and not yet fully backpropagated.
  slots_.assign(local, 0);
  std::vector<int> alive(local, 0);
  for (const auto& a : schedule_.ranks[stage]) {
    const int c = local_of_global_[a.chunk];
    if (a.op == Op::kF) slots_[c] = std::max(slots_[c], ++alive[c]);
    if (a.op == Op::kBW || a.op == Op::kW) --alive[c];
  }
  T3D_USER_CHECK(schedule_.n_micro < 32767 / (2 * schedule_.num_chunks()),
                 "train.micro_batches = ", schedule_.n_micro, " is too many for MPI tags with ",
                 schedule_.num_chunks(), " pipeline chunks");
  for (int k = 0; k + 1 < schedule_.num_chunks(); ++k)
    T3D_ASSERT(schedule_.chunk_stage[k] != schedule_.chunk_stage[k + 1],
               "consecutive chunks on one stage (pp = 1 with virtual stages)");
}

bool PipelineExecutor::splits_backward() const {
  for (const auto& rank : schedule_.ranks)
    for (const auto& a : rank)
      if (a.op == Op::kB) return true;
  return false;
}

int PipelineExecutor::max_slots() const { return *std::max_element(slots_.begin(), slots_.end()); }

int PipelineExecutor::local_chunk(int global_chunk) const {
  const int c = local_of_global_.at(global_chunk);
  T3D_ASSERT(c >= 0, "chunk ", global_chunk, " is not on this stage");
  return c;
}

double PipelineExecutor::run(Model& model, const MicroBatchSource& source, float grad_scale,
                             bool training) {
  if (!training) return run_forward_only(model, source);
  const int K = schedule_.num_chunks();
  const int stage = pp_.rank();
  const size_t n = static_cast<size_t>(model.io_floats());
  if (grad_in_.size() < n) grad_in_.resize(n);
  const size_t chunks = slots_.size();
  // Slot of each (micro-batch, local chunk) while it is alive, and free slots per chunk.
  slot_of_.assign(static_cast<size_t>(schedule_.n_micro) * chunks, -1);
  free_.resize(chunks);
  sends_.resize(chunks);
  for (size_t c = 0; c < chunks; ++c) {
    free_[c].clear();
    for (int s = slots_[c] - 1; s >= 0; --s) free_[c].push_back(s);
    sends_[c].assign(static_cast<size_t>(slots_[c]), {MPI_REQUEST_NULL, MPI_REQUEST_NULL});
  }
  // A slot's two buffers that leave by isend (its output, its input gradient) are waited for only
  // when the slot is taken again: sends never block the schedule, as its validator assumes.
  auto take_slot = [&](int c, int mb) {
    T3D_ASSERT(!free_[c].empty(), "no free activation slot for micro-batch ", mb);
    const int slot = free_[c].back();
    free_[c].pop_back();
    for (auto& r : sends_[c][slot]) pp_.wait(r, "pipeline send");
    slot_of_[mb * chunks + c] = slot;
    return slot;
  };

  double loss = 0;
  for (const auto& a : schedule_.ranks[stage]) {
    const int c = local_chunk(a.chunk);
    const auto& range = model.chunks()[c];
    if (a.op == Op::kF) {
      const int slot = take_slot(c, a.mb);
      const int32_t* tokens = nullptr;
      const int32_t* targets = nullptr;
      if (range.first || range.last) source(a.mb, &tokens, &targets);
      if (!range.first)
        receive(model, model.input(c, slot), schedule_.chunk_stage[a.chunk - 1],
                tag_of(a.mb, a.chunk, K, false));
      parallel::trace::Span span("forward", "compute");
      span.arg("mb", a.mb).arg("chunk", a.chunk);
      loss += model.forward(c, slot, tokens, targets, grad_scale, true);
      if (!range.last)
        sends_[c][slot][0] = send(model, model.output(c, slot), model.send16(c, slot, false),
                                  schedule_.chunk_stage[a.chunk + 1],
                                  tag_of(a.mb, a.chunk + 1, K, false));
      continue;
    }
    const int slot = slot_of_[a.mb * chunks + c];
    T3D_ASSERT(slot >= 0, to_string(a), " before its forward");
    if (a.op == Op::kW) {  // the deferred weight gradients; the slot is free afterwards
      parallel::trace::Span span("backward (weight grads)", "compute");
      span.arg("mb", a.mb).arg("chunk", a.chunk);
      model.backward_weight(c, slot);
      free_[c].push_back(slot);
      slot_of_[a.mb * chunks + c] = -1;
      continue;
    }
    const float* dout = nullptr;
    if (!range.last) {
      receive(model, grad_in_.data(), schedule_.chunk_stage[a.chunk + 1],
              tag_of(a.mb, a.chunk, K, true));
      dout = grad_in_.data();
    }
    parallel::trace::Span span(a.op == Op::kB ? "backward (input grads)" : "backward", "compute");
    span.arg("mb", a.mb).arg("chunk", a.chunk);
    if (a.op == Op::kB)
      model.backward_input(c, slot, dout);
    else
      model.backward(c, slot, dout);
    if (!range.first)
      sends_[c][slot][1] = send(model, model.input_grad(c, slot), model.send16(c, slot, true),
                                schedule_.chunk_stage[a.chunk - 1],
                                tag_of(a.mb, a.chunk - 1, K, true));
    if (a.op == Op::kBW) {
      free_[c].push_back(slot);
      slot_of_[a.mb * chunks + c] = -1;
    }
  }
  for (auto& per_chunk : sends_)
    for (auto& pair : per_chunk)
      for (auto& r : pair) pp_.wait(r, "pipeline send");
  return loss;
}

MPI_Request PipelineExecutor::send(Model& model, const float* data, uint16_t* staging, int peer,
                                   int tag) {
  const size_t n = static_cast<size_t>(model.io_floats());
  if (!model.bf16()) return pp_.isend(data, n, peer, tag);
  kernels::float_to_bf16(staging, data, static_cast<int64_t>(n));  // half the bytes on the wire
  return pp_.isend(staging, n, peer, tag);
}

void PipelineExecutor::receive(Model& model, float* data, int peer, int tag) {
  const size_t n = static_cast<size_t>(model.io_floats());
  if (!model.bf16()) return pp_.recv(data, n, peer, tag);
  pp_.recv(model.recv16(), n, peer, tag);
  kernels::bf16_to_float(data, model.recv16(), static_cast<int64_t>(n));
}

double PipelineExecutor::run_forward_only(Model& model, const MicroBatchSource& source) {
  // Micro-batch by micro-batch through the chunks in model order, on slot 0, each send completed
  // at once. Slower than a schedule but deadlock-free for any placement: every wait is on a rank
  // further along the same micro-batch's path, so waits never form a cycle.
  const int K = schedule_.num_chunks();
  const int stage = pp_.rank();
  double loss = 0;
  for (int mb = 0; mb < schedule_.n_micro; ++mb)
    for (int k = 0; k < K; ++k) {
      if (schedule_.chunk_stage[k] != stage) continue;
      const int c = local_chunk(k);
      const auto& range = model.chunks()[c];
      const int32_t* tokens = nullptr;
      const int32_t* targets = nullptr;
      if (range.first || range.last) source(mb, &tokens, &targets);
      if (!range.first)
        receive(model, model.input(c, 0), schedule_.chunk_stage[k - 1], tag_of(mb, k, K, false));
      parallel::trace::Span span("forward (validation)", "compute");
      span.arg("mb", mb).arg("chunk", k);
      loss += model.forward(c, 0, tokens, targets, 0.0f, false);
      if (!range.last) {
        MPI_Request r = send(model, model.output(c, 0), model.send16(c, 0, false),
                             schedule_.chunk_stage[k + 1], tag_of(mb, k + 1, K, false));
        pp_.wait(r, "pipeline send");
      }
    }
  return loss;
}

}  // namespace t3d::runtime
