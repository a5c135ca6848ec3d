#include "parallel/nccl_comm.h"

#include <cuda_runtime_api.h>
#include <mpi.h>
#include <spdlog/spdlog.h>

#include <algorithm>
#include <atomic>
#include <chrono>
#include <condition_variable>
#include <cstdio>
#include <cstdlib>
#include <map>
#include <mutex>
#include <string>
#include <thread>
#include <type_traits>
#include <utility>
#include <vector>

#include "kernels/check.h"
#include "kernels/cuda_native.h"
#include "parallel/nccl_api.h"
#include "parallel/nccl_library.h"
#include "parallel/trace.h"

namespace t3d::parallel {

namespace {

using Clock = std::chrono::steady_clock;

void check_nccl(ncclResult_t r, const char* call, const char* file, int line) {
  if (r == ncclSuccess || r == ncclInProgress) return;
  throw InternalError(
      ::t3d::detail::concat(file, ":", line, ": ", call, " failed: ", nccl_api().error_string(r)));
}
void check_cuda(cudaError_t r, const char* call, const char* file, int line) {
  if (r == cudaSuccess) return;
  throw InternalError(
      ::t3d::detail::concat(file, ":", line, ": ", call, " failed: ", cudaGetErrorString(r)));
}
#define T3D_NCCL(call) check_nccl((call), #call, __FILE__, __LINE__)
#define T3D_CUDA(call) check_cuda((call), #call, __FILE__, __LINE__)

template <class T>  // float, or uint16_t: bf16 bits (kernels/precision.h)
ncclDataType_t nccl_type() {
  return std::is_same_v<T, float> ? ncclFloat32 : ncclBfloat16;
}

ncclRedOp_t nccl_op(ReduceOp op) {
  return op == ReduceOp::max ? ncclMax : op == ReduceOp::min ? ncclMin : ncclSum;
}

// One operation in flight: its stream records `began` before it and `done` after it. Shared by
// the request that started it (until wait, test or release) and the watchdog (until `done`
// fires). The deadline runs from when the watchdog first sees `began` fired (the host enqueues up
// to a step ahead), as the MPI path times only real waits. A host wait (`on_host`: the owner in an
// NCCL call that may wait for peers) has no events: it runs from its making to `host_done`.
struct Op {
  cudaEvent_t began = nullptr, done = nullptr;
  const char* what = "";
  int peer = -1;
  bool on_host = false;
  std::atomic<bool> host_done{false};
  bool running = false;  // the watchdog saw `began`; `start` is then when
  Clock::time_point start = Clock::now();
  bool finished() const { return on_host ? host_done.load() : cudaEventQuery(done) == cudaSuccess; }
  ~Op() {
    if (began) cudaEventDestroy(began);
    if (done) cudaEventDestroy(done);
  }
};

}  // namespace

struct NcclComm::Impl {
  const Comm& mpi;
  int device = 0;
  cudaStream_t compute = nullptr;
  // The collectives' communicator and stream; point to point: to a higher rank on `up`, to a
  // lower one on `down` (NcclComm's header says why).
  ncclComm_t main = nullptr, up = nullptr, down = nullptr;
  cudaStream_t main_stream = nullptr, up_stream = nullptr, down_stream = nullptr;
  cudaEvent_t compute_ready = nullptr;  // re-recorded before each operation
  mutable std::map<uint64_t, std::shared_ptr<Op>> started;
  mutable uint64_t next_handle = 1;
  // The watchdog thread and what it watches.
  mutable std::mutex mu;
  std::condition_variable wake;
  mutable std::vector<std::shared_ptr<Op>> watched;
  // A call that threw may leave NCCL operations untracked: abort, not destroy (a destroy waits).
  mutable std::atomic<bool> must_abort{false};
  // Held by the owner inside NCCL's calls: the watchdog aborts the communicators only when it can
  // take it (an abort frees a communicator under a call that uses it, or waits on it).
  mutable std::timed_mutex calling;
  bool stopping = false;
  std::thread watchdog;

  Impl(const Comm& group, const kernels::Exec& exec);
  ~Impl();
  // What the constructor made (communicators, streams, event), freed; the communicators
  // destroyed, or aborted where operations are unfinished (a destroy would wait on the peers).
  void release(bool abort);
  void watch();
  // The watchdog's two ends: an operation unfinished past parallel.timeout_s, or an error NCCL
  // reported. Both abort the NCCL communicators, then the job (exit 3).
  [[noreturn]] void abort_hung(const Op& hung);
  [[noreturn]] void abort_on_error(ncclResult_t error);
  void abort_comms();  // when no NCCL call of the owner's holds them (`calling`), else nothing
  std::shared_ptr<Op> watch_host_wait(const char* what, int peer) const;  // until `host_done`
  // Runs `enqueue` (NCCL calls on `comm`) on `stream` after the compute stream's work so far;
  // returns the operation, its event recorded after it and watched.
  template <class F>
  std::shared_ptr<Op> launch(cudaStream_t stream, const char* what, int peer, F enqueue) const;
  Request started_request(std::shared_ptr<Op> op) const;
  // NcclComm::prepare_pairs: one float each way, grouped per direction communicator, waited for.
  void connect(const std::vector<int>& send_to, const std::vector<int>& receive_from) const;
  void compute_waits(const Op& op) const { T3D_CUDA(cudaStreamWaitEvent(compute, op.done, 0)); }
  ncclComm_t send_comm(int peer) const { return peer > mpi.rank() ? up : down; }
  cudaStream_t send_stream(int peer) const { return peer > mpi.rank() ? up_stream : down_stream; }
  ncclComm_t recv_comm(int peer) const { return peer < mpi.rank() ? up : down; }
  cudaStream_t recv_stream(int peer) const { return peer < mpi.rank() ? up_stream : down_stream; }
};

NcclComm::Impl::Impl(const Comm& group, const kernels::Exec& exec) : mpi(group) {
  T3D_ASSERT(exec.on_gpu(), "an NCCL communicator for a rank that computes on the CPU");
  device = kernels::cuda::stream_device(*exec.stream);
  compute = static_cast<cudaStream_t>(kernels::cuda::native_stream(*exec.stream));
  const NcclApi& api = nccl_api();
  // Rank 0's ids for the three communicators (one for a single rank: nothing travels point to
  // point), over the group's MPI communicator, with its result: where it cannot make them (no
  // network interface NCCL may use), every rank throws its error instead of waiting.
  const int comms = group.size() > 1 ? 3 : 1;
  std::vector<ncclUniqueId> ids(static_cast<size_t>(comms));
  int made = ncclSuccess;
  if (group.rank() == 0)
    for (auto& id : ids)
      if (made == ncclSuccess) made = api.get_unique_id(&id);
  group.broadcast(&made, 1, 0);
  if (made != ncclSuccess)  // the host's network set-up: the user's to fix
    throw UserError(::t3d::detail::concat(
        "NCCL's bootstrap of group `", group.name(), "`: ncclGetUniqueId failed on its rank 0: ",
        api.error_string(static_cast<ncclResult_t>(made)),
        ". Set NCCL_SOCKET_IFNAME to a network interface every host has (NCCL_DEBUG=INFO says "
        "which it tried), or parallel.device_comm = \"staged\""));
  group.broadcast(reinterpret_cast<char*>(ids.data()), ids.size() * sizeof(ncclUniqueId), 0);
  T3D_CUDA(cudaSetDevice(device));
  try {  // no destructor runs for a constructor that throws: what was made is released here
    ncclComm_t* comms_made[3] = {&main, &up, &down};
    for (int c = 0; c < comms; ++c)
      T3D_NCCL(api.comm_init_rank(comms_made[c], group.size(), ids[static_cast<size_t>(c)],
                                  group.rank()));
    for (cudaStream_t* s : {&main_stream, &up_stream, &down_stream})
      T3D_CUDA(cudaStreamCreateWithFlags(s, cudaStreamNonBlocking));
    T3D_CUDA(cudaEventCreateWithFlags(&compute_ready, cudaEventDisableTiming));
    watchdog = std::thread([this] { watch(); });
  } catch (...) {
    release(/*abort=*/true);
    throw;
  }
}

void NcclComm::Impl::connect(const std::vector<int>& send_to,
                             const std::vector<int>& receive_from) const {
  const NcclApi& api = nccl_api();
  // [0]: what is sent; [1 + i]: what receive_from[i] sends. In up_stream's order, ready before
  // either stream reads it: no device-wide wait (this may run mid-training: the replay's pairs).
  void* floats_memory = nullptr;
  const size_t bytes = (1 + receive_from.size()) * sizeof(float);
  T3D_CUDA(cudaMallocAsync(&floats_memory, bytes, up_stream));
  float* floats = static_cast<float*>(floats_memory);
  T3D_CUDA(cudaMemsetAsync(floats, 0, bytes, up_stream));
  T3D_CUDA(cudaStreamSynchronize(up_stream));
  T3D_CUDA(cudaStreamSynchronize(down_stream));
  // NCCL connects the pairs on the host, in ncclGroupEnd, waiting there for each peer: from here
  // (the work queued before on both streams done: watched as its own operations) the exchange is
  // one host wait under the watchdog, so a peer that never comes ends the job (exit 3) as a hung
  // operation on the GPU does.
  const auto wait = watch_host_wait("prepare_pairs (NCCL connecting point-to-point pairs)", -1);
  try {
    // The pairs of each direction's communicator in one group: NCCL connects them together.
    for (ncclComm_t comm : {up, down}) {
      cudaStream_t stream = comm == up ? up_stream : down_stream;
      std::lock_guard<std::timed_mutex> inside(calling);
      T3D_NCCL(api.group_start());
      for (int peer : send_to)
        if (peer != mpi.rank() && send_comm(peer) == comm)
          T3D_NCCL(api.send(floats, 1, ncclFloat32, peer, comm, stream));
      for (size_t i = 0; i < receive_from.size(); ++i)
        if (receive_from[i] != mpi.rank() && recv_comm(receive_from[i]) == comm)
          T3D_NCCL(api.recv(floats + 1 + i, 1, ncclFloat32, receive_from[i], comm, stream));
      T3D_NCCL(api.group_end());
    }
    T3D_CUDA(cudaStreamSynchronize(up_stream));
    T3D_CUDA(cudaStreamSynchronize(down_stream));
  } catch (...) {
    wait->host_done = must_abort = true;
    throw;
  }
  wait->host_done = true;
  T3D_CUDA(cudaFreeAsync(floats, up_stream));
}

NcclComm::Impl::~Impl() {
  bool all_done = true;
  {
    std::lock_guard<std::mutex> lock(mu);
    stopping = true;
    for (const auto& op : watched) all_done = all_done && op->finished();
  }
  wake.notify_all();
  if (watchdog.joinable()) watchdog.join();
  started.clear();
  watched.clear();
  // Unfinished operations (unwinding after an error) would make a destroy wait on the peers.
  release(/*abort=*/!all_done || must_abort);
}

void NcclComm::Impl::release(bool abort) {
  cudaSetDevice(device);
  const NcclApi& api = nccl_api();
  for (ncclComm_t* c : {&main, &up, &down})
    if (*c) (abort ? api.comm_abort : api.comm_destroy)(std::exchange(*c, nullptr));
  for (cudaStream_t* s : {&main_stream, &up_stream, &down_stream})
    if (*s) cudaStreamDestroy(std::exchange(*s, nullptr));
  if (compute_ready) cudaEventDestroy(std::exchange(compute_ready, nullptr));
}

void NcclComm::Impl::watch() {
  cudaSetDevice(device);
  const double timeout_s = mpi.timeout_s();
  std::unique_lock<std::mutex> lock(mu);
  while (!stopping) {
    wake.wait_for(lock, std::chrono::milliseconds(100));
    std::shared_ptr<Op> hung;
    std::erase_if(watched, [&](const std::shared_ptr<Op>& op) {
      if (op->finished()) return true;
      if (!op->running) {
        if (cudaEventQuery(op->began) != cudaSuccess) return false;  // not reached yet
        op->running = true;
        op->start = Clock::now();
      }
      if (!hung && std::chrono::duration<double>(Clock::now() - op->start).count() > timeout_s)
        hung = op;
      return false;
    });
    ncclResult_t error = ncclSuccess;
    for (ncclComm_t c : {main, up, down}) {
      ncclResult_t e = ncclSuccess;
      if (c && nccl_api().comm_get_async_error(c, &e) == ncclSuccess && e != ncclSuccess &&
          e != ncclInProgress)
        error = e;
    }
    if (!hung && error == ncclSuccess) continue;
    lock.unlock();
    if (hung) abort_hung(*hung);
    abort_on_error(error);
  }
}

void NcclComm::Impl::abort_comms() {
  // Aborting the communicators ends the GPU's waits. Not while the owner is inside a call on them
  // (waiting on the host for a peer): MPI_Abort ends the process then. `calling` stays held.
  if (calling.try_lock_for(std::chrono::seconds(2)))
    for (ncclComm_t c : {main, up, down})
      if (c) nccl_api().comm_abort(c);
}

void NcclComm::Impl::abort_hung(const Op& hung) {
  abort_comms();
  mpi.abort_hung(
      hung.what, hung.peer,
      hung.on_host ? " (NCCL waiting on the host for a peer)" : " (an NCCL operation on the GPU)");
}

void NcclComm::Impl::abort_on_error(ncclResult_t error) {
  abort_comms();
  // A peer that died or a broken link shows here (ncclRemoteError, ncclSystemError): the job
  // ends as for a hang (exit 3), naming the group.
  const std::string msg = "watchdog: NCCL reported \"" +
                          std::string(nccl_api().error_string(error)) + "\" on group `" +
                          mpi.name() + "` (world rank " +
                          std::to_string(mpi.world_ranks().at(static_cast<size_t>(mpi.rank()))) +
                          "); a peer is stuck or dead, or the network to its host is down. "
                          "Aborting the job.";
  spdlog::critical(msg);
  std::fprintf(stderr, "%s\n", msg.c_str());
  std::fflush(stderr);
  MPI_Abort(MPI_COMM_WORLD, 3);
  std::abort();  // MPI_Abort does not return
}

template <class F>
std::shared_ptr<Op> NcclComm::Impl::launch(cudaStream_t stream, const char* what, int peer,
                                           F enqueue) const {
  T3D_CUDA(cudaEventRecord(compute_ready, compute));
  T3D_CUDA(cudaStreamWaitEvent(stream, compute_ready, 0));
  // The enqueue is a host wait first: NCCL connects a communicator's peers lazily, on the host in
  // its first calls, waiting there for them (as prepare_pairs).
  const auto op = watch_host_wait(what, peer);
  try {
    T3D_CUDA(cudaEventCreateWithFlags(&op->began, cudaEventDisableTiming));
    T3D_CUDA(cudaEventRecord(op->began, stream));
    std::lock_guard<std::timed_mutex> inside(calling);
    enqueue(stream);
    T3D_CUDA(cudaEventCreateWithFlags(&op->done, cudaEventDisableTiming));
    T3D_CUDA(cudaEventRecord(op->done, stream));
  } catch (...) {
    op->host_done = must_abort = true;
    throw;
  }
  std::lock_guard<std::mutex> lock(mu);  // then an operation on the GPU, timed from `began`
  op->on_host = op->running = false;
  return op;
}

std::shared_ptr<Op> NcclComm::Impl::watch_host_wait(const char* what, int peer) const {
  auto op = std::make_shared<Op>();
  op->what = what, op->peer = peer, op->on_host = op->running = true;
  std::lock_guard<std::mutex> lock(mu);
  watched.push_back(op);
  return op;
}

Request NcclComm::Impl::started_request(std::shared_ptr<Op> op) const {
  const uint64_t handle = next_handle++;
  started.emplace(handle, std::move(op));
  return Request{true, handle};
}

NcclComm::NcclComm(const Comm& group, const kernels::Exec& exec)
    : impl_(std::make_unique<Impl>(group, exec)) {}

NcclComm::~NcclComm() = default;

int NcclComm::rank() const { return impl_->mpi.rank(); }
int NcclComm::size() const { return impl_->mpi.size(); }

namespace {

// The trace span of a call, as the MPI communicator writes it.
void span_args(trace::Span& span, const Comm& mpi, size_t bytes, int64_t tag = -1) {
  span.arg("group", mpi.name()).arg("bytes", static_cast<int64_t>(bytes));
  if (tag >= 0) span.arg("bucket", tag);
}

}  // namespace

void NcclComm::all_reduce(float* data, size_t count, ReduceOp op) const {
  trace::Span span("all_reduce", "comm");
  span_args(span, impl_->mpi, count * sizeof(float));
  const auto done = impl_->launch(impl_->main_stream, "all_reduce", -1, [&](cudaStream_t s) {
    T3D_NCCL(nccl_api().all_reduce(data, data, count, ncclFloat32, nccl_op(op), impl_->main, s));
  });
  impl_->compute_waits(*done);
}

void NcclComm::all_reduce_bf16(uint16_t* data, size_t count) const {
  trace::Span span("all_reduce (bf16)", "comm");
  span_args(span, impl_->mpi, count * sizeof(uint16_t));
  const auto done = impl_->launch(impl_->main_stream, "all_reduce (bf16)", -1, [&](cudaStream_t s) {
    T3D_NCCL(nccl_api().all_reduce(data, data, count, ncclBfloat16, ncclSum, impl_->main, s));
  });
  impl_->compute_waits(*done);
}

namespace {

template <class T>
void gather_all(const NcclComm::Impl& c, const T* send, T* recv, size_t count) {
  trace::Span span("all_gather", "comm");
  span_args(span, c.mpi, count * sizeof(T));
  const auto done = c.launch(c.main_stream, "all_gather", -1, [&](cudaStream_t s) {
    T3D_NCCL(nccl_api().all_gather(send, recv, count, nccl_type<T>(), c.main, s));
  });
  c.compute_waits(*done);
}

template <class T>
void scatter_sum(const NcclComm::Impl& c, const T* send, T* recv, size_t count) {
  trace::Span span(std::is_same_v<T, float> ? "reduce_scatter" : "reduce_scatter (bf16)", "comm");
  span_args(span, c.mpi, count * sizeof(T) * static_cast<size_t>(c.mpi.size()));
  const auto done = c.launch(c.main_stream, "reduce_scatter", -1, [&](cudaStream_t s) {
    T3D_NCCL(nccl_api().reduce_scatter(send, recv, count, nccl_type<T>(), ncclSum, c.main, s));
  });
  c.compute_waits(*done);
}

template <class T>
void receive(const NcclComm::Impl& c, T* data, size_t count, int peer) {
  T3D_ASSERT(peer != c.mpi.rank(), "an NCCL receive from this rank itself");
  trace::Span span("recv", "comm");
  span_args(span, c.mpi, count * sizeof(T));
  const auto done = c.launch(c.recv_stream(peer), "recv", peer, [&](cudaStream_t s) {
    T3D_NCCL(nccl_api().recv(data, count, nccl_type<T>(), peer, c.recv_comm(peer), s));
  });
  c.compute_waits(*done);
}

template <class T>
Request send(const NcclComm::Impl& c, const T* data, size_t count, int peer) {
  T3D_ASSERT(peer != c.mpi.rank(), "an NCCL send to this rank itself");
  trace::Span span("isend", "comm");
  span_args(span, c.mpi, count * sizeof(T));
  return c.started_request(c.launch(c.send_stream(peer), "isend", peer, [&](cudaStream_t s) {
    T3D_NCCL(nccl_api().send(data, count, nccl_type<T>(), peer, c.send_comm(peer), s));
  }));
}

}  // namespace

void NcclComm::all_gather(const float* send, float* recv, size_t count) const {
  gather_all(*impl_, send, recv, count);
}
void NcclComm::all_gather(const uint16_t* send, uint16_t* recv, size_t count) const {
  gather_all(*impl_, send, recv, count);
}
void NcclComm::reduce_scatter(const float* send, float* recv, size_t count) const {
  scatter_sum(*impl_, send, recv, count);
}
void NcclComm::reduce_scatter_bf16(const uint16_t* send, uint16_t* recv, size_t count) const {
  scatter_sum(*impl_, send, recv, count);
}
void NcclComm::recv(float* data, size_t count, int peer, int /*tag: NCCL has none*/) const {
  receive(*impl_, data, count, peer);
}
void NcclComm::recv(uint16_t* data, size_t count, int peer, int /*tag*/) const {
  receive(*impl_, data, count, peer);
}
Request NcclComm::isend(const float* data, size_t count, int peer, int /*tag*/) const {
  return send(*impl_, data, count, peer);
}
Request NcclComm::isend(const uint16_t* data, size_t count, int peer, int /*tag*/) const {
  return send(*impl_, data, count, peer);
}

void NcclComm::prepare_pairs(const std::vector<int>& send_to,
                             const std::vector<int>& receive_from) const {
  impl_->connect(send_to, receive_from);
}

Request NcclComm::iall_reduce_sum(float* data, size_t count, const char* what, int64_t tag) const {
  trace::Span span(what, "comm");
  span_args(span, impl_->mpi, count * sizeof(float), tag);
  return impl_->started_request(impl_->launch(impl_->main_stream, what, -1, [&](cudaStream_t s) {
    T3D_NCCL(nccl_api().all_reduce(data, data, count, ncclFloat32, ncclSum, impl_->main, s));
  }));
}

Request NcclComm::ireduce_scatter_sum(float* data, const std::vector<int>& counts, const char* what,
                                      int64_t tag) const {
  const Impl& c = *impl_;
  const int n = c.mpi.size(), me = c.mpi.rank();
  T3D_ASSERT(static_cast<int>(counts.size()) == n, "counts for ", counts.size(),
             " ranks on a group of ", n);
  std::vector<size_t> offset(static_cast<size_t>(n) + 1, 0);
  for (int i = 0; i < n; ++i)
    offset[static_cast<size_t>(i) + 1] =
        offset[static_cast<size_t>(i)] + static_cast<size_t>(counts[static_cast<size_t>(i)]);
  const bool equal =
      std::all_of(counts.begin(), counts.end(), [&](int k) { return k == counts[0]; });
  trace::Span span(what, "comm");
  span_args(span, c.mpi, offset.back() * sizeof(float), tag);
  const size_t mine = static_cast<size_t>(counts[static_cast<size_t>(me)]);
  const size_t at = offset[static_cast<size_t>(me)];
  return c.started_request(c.launch(c.main_stream, what, -1, [&](cudaStream_t s) {
    const NcclApi& api = nccl_api();
    if (equal) {  // in place: NCCL leaves this rank's block where it was, at `at`
      T3D_NCCL(api.reduce_scatter(data, data + at, mine, ncclFloat32, ncclSum, c.main, s));
    } else {  // one reduce per rank, block i summed in place onto rank i
      T3D_NCCL(api.group_start());
      for (int i = 0; i < n; ++i) {
        float* block = data + offset[static_cast<size_t>(i)];
        const size_t k = static_cast<size_t>(counts[static_cast<size_t>(i)]);
        if (k) T3D_NCCL(api.reduce(block, block, k, ncclFloat32, ncclSum, i, c.main, s));
      }
      T3D_NCCL(api.group_end());
    }
    // The contract puts the block at the start: moved down in pieces no longer than the shift,
    // so that no piece's source overlaps its destination or a piece still to be read.
    for (size_t done = 0; at > 0 && done < mine;) {
      const size_t piece = std::min(at, mine - done);
      T3D_CUDA(cudaMemcpyAsync(data + done, data + at + done, piece * sizeof(float),
                               cudaMemcpyDeviceToDevice, s));
      done += piece;
    }
  }));
}

Request NcclComm::iall_gatherv(const float* mine, float* recv, const std::vector<int>& counts,
                               const std::vector<int>& displs, const char* what,
                               int64_t tag) const {
  const Impl& c = *impl_;
  const int n = c.mpi.size(), me = c.mpi.rank();
  T3D_ASSERT(static_cast<int>(counts.size()) == n && displs.size() == counts.size(),
             "counts / displacements for ", counts.size(), " ranks on a group of ", n);
  trace::Span span(what, "comm");
  span_args(span, c.mpi, static_cast<size_t>(counts[static_cast<size_t>(me)]) * sizeof(float), tag);
  // One broadcast per rank from its part, grouped: each part lands at its displacement on every
  // rank, whatever the order parts arrive in.
  return c.started_request(c.launch(c.main_stream, what, -1, [&](cudaStream_t s) {
    const NcclApi& api = nccl_api();
    T3D_NCCL(api.group_start());
    for (int i = 0; i < n; ++i) {
      const size_t k = static_cast<size_t>(counts[static_cast<size_t>(i)]);
      float* part = recv + displs[static_cast<size_t>(i)];
      const float* from = (i == me && mine) ? mine : part;
      if (k) T3D_NCCL(api.broadcast(from, part, k, ncclFloat32, i, c.main, s));
    }
    T3D_NCCL(api.group_end());
  }));
}

namespace {

template <class T>
void exchange_rows(const NcclComm::Impl& c, Exchange& exchange, const T* send,
                   const std::vector<int>& send_counts, const std::vector<int>& send_displs,
                   T* recv, const std::vector<int>& recv_counts,
                   const std::vector<int>& recv_displs, size_t row_size) {
  const int n = c.mpi.size();
  T3D_ASSERT(!exchange.request.pending, "an exchange started before the previous one finished");
  T3D_ASSERT(static_cast<int>(send_counts.size()) == n && static_cast<int>(recv_counts.size()) == n,
             "counts for ", send_counts.size(), " ranks on a group of ", n);
  size_t sent = 0;
  for (int p = 0; p < n; ++p)
    if (p != c.mpi.rank()) sent += static_cast<size_t>(send_counts[static_cast<size_t>(p)]);
  trace::Span span("all_to_allv", "comm");
  span_args(span, c.mpi, sent * row_size * sizeof(T));
  // Grouped sends and receives (this rank's own rows too): each peer's rows land at their
  // displacement, so the placement never depends on arrival order.
  exchange.request =
      c.started_request(c.launch(c.main_stream, "all_to_allv", -1, [&](cudaStream_t s) {
        const NcclApi& api = nccl_api();
        T3D_NCCL(api.group_start());
        const auto rows = [&](const std::vector<int>& v, int p) {  // elements from rows
          return static_cast<size_t>(v[static_cast<size_t>(p)]) * row_size;
        };
        for (int p = 0; p < n; ++p) {
          const ncclDataType_t type = nccl_type<T>();
          if (rows(send_counts, p))
            T3D_NCCL(
                api.send(send + rows(send_displs, p), rows(send_counts, p), type, p, c.main, s));
          if (rows(recv_counts, p))
            T3D_NCCL(
                api.recv(recv + rows(recv_displs, p), rows(recv_counts, p), type, p, c.main, s));
        }
        T3D_NCCL(api.group_end());
      }));
}

}  // namespace

void NcclComm::start_all_to_allv(Exchange& exchange, const float* send,
                                 const std::vector<int>& send_counts,
                                 const std::vector<int>& send_displs, float* recv,
                                 const std::vector<int>& recv_counts,
                                 const std::vector<int>& recv_displs, size_t row_size) const {
  exchange_rows(*impl_, exchange, send, send_counts, send_displs, recv, recv_counts, recv_displs,
                row_size);
}

void NcclComm::start_all_to_allv(Exchange& exchange, const uint16_t* send,
                                 const std::vector<int>& send_counts,
                                 const std::vector<int>& send_displs, uint16_t* recv,
                                 const std::vector<int>& recv_counts,
                                 const std::vector<int>& recv_displs, size_t row_size) const {
  exchange_rows(*impl_, exchange, send, send_counts, send_displs, recv, recv_counts, recv_displs,
                row_size);
}

void NcclComm::wait(Request& request, const char* /*what: the watchdog names the operation*/,
                    int /*peer*/) const {
  if (!request.pending) return;
  const auto it = impl_->started.find(request.handle);
  T3D_ASSERT(it != impl_->started.end(), "a request this communicator did not start");
  impl_->compute_waits(*it->second);
  impl_->started.erase(it);
  request = Request{};
}

bool NcclComm::test(Request& request) const {
  if (!request.pending) return true;
  const auto it = impl_->started.find(request.handle);
  T3D_ASSERT(it != impl_->started.end(), "a request this communicator did not start");
  const cudaError_t q = cudaEventQuery(it->second->done);
  if (q == cudaErrorNotReady) return false;
  T3D_CUDA(q);
  impl_->started.erase(it);
  request = Request{};
  return true;
}

void NcclComm::release(Request& request) const {
  if (request.pending) impl_->started.erase(request.handle);  // the watchdog still watches it
  request = Request{};
}

}  // namespace t3d::parallel
