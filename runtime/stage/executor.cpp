#include "runtime/stage/executor.h"

#include <algorithm>

#include "kernels/check.h"
#include "kernels/ops.h"
#include "parallel/trace.h"

namespace t3d::runtime {

using parallel::Op;

namespace {
// Message tags: (micro-batch, chunk, direction) -> unique tag (MPI guarantees at least 32767).
int tag_of(int mb, int chunk, int chunks, bool gradient) {
  return (mb * chunks + chunk) * 2 + (gradient ? 1 : 0);
}
}  // namespace

PipelineExecutor::PipelineExecutor(parallel::Schedule schedule, const parallel::TensorComm& pp,
                                   WirePrecision wire)
    : schedule_(std::move(schedule)), pp_(pp), wire_(wire) {
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
}

bool PipelineExecutor::local(int chunk_a, int chunk_b) const {
  return schedule_.chunk_stage[chunk_a] == schedule_.chunk_stage[chunk_b];
}

void PipelineExecutor::put_local(const kernels::Exec& exec, const float* data, size_t n, int tag) {
  int i;
  if (local_free_.empty()) {
    i = static_cast<int>(local_pool_.size());
    local_pool_.emplace_back();
  } else {
    i = local_free_.back();
    local_free_.pop_back();
  }
  local_pool_[i].reserve(exec, n * sizeof(float), "pipeline hand-over");
  kernels::copy(exec, local_pool_[i].as<float>(), data, static_cast<int64_t>(n));
  T3D_ASSERT(local_of_tag_.emplace(tag, i).second, "local hand-over ", tag, " posted twice");
}

void PipelineExecutor::take_local(const kernels::Exec& exec, float* data, size_t n, int tag) {
  const auto it = local_of_tag_.find(tag);
  // The validator orders a producer before its consumer on the same rank: a miss is a bug.
  T3D_ASSERT(it != local_of_tag_.end(), "local hand-over ", tag, " taken before it was made");
  const auto& buf = local_pool_[it->second];
  T3D_ASSERT(buf.bytes() >= n * sizeof(float), "local hand-over size");
  kernels::copy(exec, data, buf.as<float>(), static_cast<int64_t>(n));
  local_free_.push_back(it->second);
  local_of_tag_.erase(it);
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

double PipelineExecutor::run(StageModel& model, const MicroBatchSource& source, float grad_scale,
                             bool training) {
  if (!training) return run_forward_only(model, source);
  grad_in_.reserve(model.exec(), sizeof(float) * static_cast<size_t>(model.io_floats()),
                   "pipeline gradient received");
  const size_t chunks = slots_.size();
  // Slot of each (micro-batch, local chunk) while it is alive, and free slots per chunk.
  slot_of_.assign(static_cast<size_t>(schedule_.n_micro) * chunks, -1);
  free_.resize(chunks);
  for (size_t c = 0; c < chunks; ++c) {
    free_[c].clear();
    for (int s = slots_[c] - 1; s >= 0; --s) free_[c].push_back(s);
  }
  for (const auto& a : schedule_.ranks[pp_.rank()]) {
    if (a.op == Op::kF)
      run_forward(model, source, a, grad_scale);
    else
      run_backward(model, a);
  }
  wait_sends();
  return model.take_loss_sum();  // the step's one wait for its losses
}

int PipelineExecutor::take_slot(int c, int mb) {
  T3D_ASSERT(!free_[c].empty(), "no free activation slot for micro-batch ", mb);
  const int slot = free_[c].back();
  free_[c].pop_back();
  slot_of_[mb * slots_.size() + c] = slot;
  return slot;
}

void PipelineExecutor::release_slot(int c, int mb) {
  free_[c].push_back(slot_of_[mb * slots_.size() + c]);
  slot_of_[mb * slots_.size() + c] = -1;
}

void PipelineExecutor::run_forward(StageModel& model, const MicroBatchSource& source,
                                   const parallel::Action& a, float grad_scale) {
  const int K = schedule_.num_chunks();
  const size_t n = static_cast<size_t>(model.io_floats());
  const int c = local_chunk(a.chunk);
  const auto& range = model.chunks()[c];
  const int slot = take_slot(c, a.mb);
  const int32_t* tokens = nullptr;
  const int32_t* targets = nullptr;
  if (range.first || range.last) source(a.mb, &tokens, &targets);
  if (!range.first) {
    const int tag = tag_of(a.mb, a.chunk, K, false);
    if (local(a.chunk - 1, a.chunk))
      take_local(model.exec(), model.input(c, slot), n, tag);
    else
      receive(model, model.input(c, slot), schedule_.chunk_stage[a.chunk - 1], tag);
  }
  parallel::trace::Span span("forward", "compute");
  span.arg("mb", a.mb).arg("chunk", a.chunk);
  model.forward(c, slot, tokens, targets, grad_scale, true);
  if (!range.last) {
    const int tag = tag_of(a.mb, a.chunk + 1, K, false);
    if (local(a.chunk, a.chunk + 1))
      put_local(model.exec(), model.output(c, slot), n, tag);
    else
      send(model, model.output(c, slot), schedule_.chunk_stage[a.chunk + 1], tag);
  }
}

// B, W or BW of one (micro-batch, chunk): W and BW free the micro-batch's slot afterwards.
void PipelineExecutor::run_backward(StageModel& model, const parallel::Action& a) {
  const int K = schedule_.num_chunks();
  const size_t n = static_cast<size_t>(model.io_floats());
  const int c = local_chunk(a.chunk);
  const auto& range = model.chunks()[c];
  const int slot = slot_of_[a.mb * slots_.size() + c];
  T3D_ASSERT(slot >= 0, to_string(a), " before its forward");
  if (a.op == Op::kW) {  // the deferred weight gradients
    parallel::trace::Span span("backward (weight grads)", "compute");
    span.arg("mb", a.mb).arg("chunk", a.chunk);
    model.backward_weight(c, slot);
    release_slot(c, a.mb);
    return;
  }
  const float* dout = nullptr;
  if (!range.last) {
    const int tag = tag_of(a.mb, a.chunk, K, true);
    if (local(a.chunk, a.chunk + 1))
      take_local(model.exec(), grad_in_.as<float>(), n, tag);
    else
      receive(model, grad_in_.as<float>(), schedule_.chunk_stage[a.chunk + 1], tag);
    dout = grad_in_.as<float>();
  }
  parallel::trace::Span span(a.op == Op::kB ? "backward (input grads)" : "backward", "compute");
  span.arg("mb", a.mb).arg("chunk", a.chunk);
  if (a.op == Op::kB)
    model.backward_input(c, slot, dout);
  else
    model.backward(c, slot, dout);
  if (!range.first) {
    const int tag = tag_of(a.mb, a.chunk - 1, K, true);
    if (local(a.chunk - 1, a.chunk))
      put_local(model.exec(), model.input_grad(c, slot), n, tag);
    else
      send(model, model.input_grad(c, slot), schedule_.chunk_stage[a.chunk - 1], tag);
  }
  if (a.op == Op::kBW) release_slot(c, a.mb);
}

void PipelineExecutor::send(StageModel& model, const float* data, int peer, int tag) {
  // The data is copied into a staging buffer of its own, so the sender never has to wait for a
  // receiver before reusing its activations: waiting there can deadlock interleaved schedules,
  // whose stages feed each other both ways. The pool grows to the step's peak of sends in flight
  // during the first step and is reused afterwards.
  const size_t n = static_cast<size_t>(model.io_floats());
  Staging* s = nullptr;
  for (auto& st : staging_)
    if (pp_.test(st.request)) {
      s = &st;
      break;
    }
  if (!s) s = &staging_.emplace_back();
  const kernels::Exec& exec = model.exec();
  if (wire_ == WirePrecision::kBf16) {
    s->data.reserve(exec, n * sizeof(kernels::bf16), "pipeline send staging");
    auto* b16 = s->data.as<kernels::bf16>();
    kernels::float_to_bf16(exec, b16, data, static_cast<int64_t>(n));  // half the bytes
    s->request = pp_.isend(b16, n, peer, tag);
  } else {
    s->data.reserve(exec, n * sizeof(float), "pipeline send staging");
    kernels::copy(exec, s->data.as<float>(), data, static_cast<int64_t>(n));
    s->request = pp_.isend(s->data.as<float>(), n, peer, tag);
  }
}

void PipelineExecutor::wait_sends() {
  for (auto& st : staging_) pp_.wait(st.request, "pipeline send");
}

void PipelineExecutor::receive(StageModel& model, float* data, int peer, int tag) {
  const size_t n = static_cast<size_t>(model.io_floats());
  if (wire_ == WirePrecision::kFp32) return pp_.recv(data, n, peer, tag);
  recv16_.reserve(model.exec(), n * sizeof(kernels::bf16), "pipeline receive (bf16)");
  auto* b16 = recv16_.as<kernels::bf16>();
  pp_.recv(b16, n, peer, tag);
  kernels::bf16_to_float(model.exec(), data, b16, static_cast<int64_t>(n));
}

double PipelineExecutor::run_forward_only(StageModel& model, const MicroBatchSource& source) {
  // Micro-batch by micro-batch through the chunks in model order, on slot 0, each send completed
  // at once. Slower than a schedule but deadlock-free for any placement: every wait is on a rank
  // further along the same micro-batch's path, so waits never form a cycle.
  const int K = schedule_.num_chunks();
  const int stage = pp_.rank();
  for (int mb = 0; mb < schedule_.n_micro; ++mb)
    for (int k = 0; k < K; ++k) {
      if (schedule_.chunk_stage[k] != stage) continue;
      const int c = local_chunk(k);
      const auto& range = model.chunks()[c];
      const int32_t* tokens = nullptr;
      const int32_t* targets = nullptr;
      if (range.first || range.last) source(mb, &tokens, &targets);
      const size_t n = static_cast<size_t>(model.io_floats());
      if (!range.first) {
        if (local(k - 1, k))
          take_local(model.exec(), model.input(c, 0), n, tag_of(mb, k, K, false));
        else
          receive(model, model.input(c, 0), schedule_.chunk_stage[k - 1], tag_of(mb, k, K, false));
      }
      parallel::trace::Span span("forward (validation)", "compute");
      span.arg("mb", mb).arg("chunk", k);
      model.forward(c, 0, tokens, targets, 0.0f, false);
      if (!range.last) {
        if (local(k, k + 1)) {
          put_local(model.exec(), model.output(c, 0), n, tag_of(mb, k + 1, K, false));
          continue;
        }
        send(model, model.output(c, 0), schedule_.chunk_stage[k + 1], tag_of(mb, k + 1, K, false));
        wait_sends();
      }
    }
  return model.take_loss_sum();
}

}  // namespace t3d::runtime
