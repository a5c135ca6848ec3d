#include "runtime/executor.h"

#include <algorithm>
#include <map>

#include "kernels/check.h"

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

int PipelineExecutor::max_slots() const { return *std::max_element(slots_.begin(), slots_.end()); }

int PipelineExecutor::local_chunk(int global_chunk) const {
  const int c = local_of_global_.at(global_chunk);
  T3D_ASSERT(c >= 0, "chunk ", global_chunk, " is not on this stage");
  return c;
}

double PipelineExecutor::run(Model& model, const MicroBatchSource& source, float grad_scale,
                             bool training) {
  const int K = schedule_.num_chunks();
  const int stage = pp_.rank();
  const size_t n = static_cast<size_t>(model.rows() * model.config().dim);
  if (grad_in_.size() < n) grad_in_.resize(n);
  // Slot of each (micro-batch, local chunk) while it is alive.
  std::map<std::pair<int, int>, int> slot_of;
  std::vector<std::vector<int>> free_slots(slots_.size());
  for (size_t c = 0; c < slots_.size(); ++c)
    for (int s = slots_[c] - 1; s >= 0; --s) free_slots[c].push_back(s);
  // Sends in flight, completed before their buffer is written again and at the end of the step.
  std::vector<MPI_Request> pending;
  auto flush_sends = [&] {
    for (auto& r : pending) pp_.wait(r, "pipeline send");
    pending.clear();
  };

  double loss = 0;
  for (const auto& a : schedule_.ranks[stage]) {
    if (!training && a.op != Op::kF) continue;
    const int c = local_chunk(a.chunk);
    const auto& range = model.chunks()[c];
    if (a.op == Op::kF) {
      T3D_ASSERT(!free_slots[c].empty(), "no free activation slot for ", to_string(a));
      const int slot = free_slots[c].back();
      free_slots[c].pop_back();
      slot_of[{a.mb, c}] = slot;
      const int32_t* tokens = nullptr;
      const int32_t* targets = nullptr;
      if (range.first || range.last) source(a.mb, &tokens, &targets);
      if (!range.first) {
        pp_.recv(model.input(c, slot), n, schedule_.chunk_stage[a.chunk - 1],
                 tag_of(a.mb, a.chunk, K, false));
      }
      loss += model.forward(c, slot, tokens, targets, grad_scale, training);
      if (!range.last)
        pending.push_back(pp_.isend(model.output(c, slot), n, schedule_.chunk_stage[a.chunk + 1],
                                    tag_of(a.mb, a.chunk + 1, K, false)));
      if (!training) {  // forward-only: the slot is free again once its output has left
        flush_sends();
        free_slots[c].push_back(slot);
        slot_of.erase({a.mb, c});
      }
      continue;
    }
    if (a.op == Op::kW) continue;  // B already computed the weight gradients (see executor.h)
    const int slot = slot_of.at({a.mb, c});
    const float* dout = nullptr;
    if (!range.last) {
      pp_.recv(grad_in_.data(), n, schedule_.chunk_stage[a.chunk + 1],
               tag_of(a.mb, a.chunk, K, true));
      dout = grad_in_.data();
    }
    flush_sends();  // input_grad(c) and this slot's output may still be in flight
    model.backward(c, slot, dout);
    if (!range.first)
      pending.push_back(pp_.isend(model.input_grad(c), n, schedule_.chunk_stage[a.chunk - 1],
                                  tag_of(a.mb, a.chunk - 1, K, true)));
    free_slots[c].push_back(slot);
    slot_of.erase({a.mb, c});
  }
  flush_sends();
  return loss;
}

}  // namespace t3d::runtime
