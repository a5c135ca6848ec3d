#include "parallel/staged_comm.h"

#include <algorithm>
#include <utility>

#include "kernels/check.h"
#include "kernels/ops.h"

namespace t3d::parallel {

namespace {

// The elements a (counts, displacements) layout spans: its largest end.
size_t extent(const std::vector<int>& counts, const std::vector<int>& displs) {
  size_t end = 0;
  for (size_t i = 0; i < counts.size(); ++i)
    end = std::max(end, static_cast<size_t>(displs[i]) + static_cast<size_t>(counts[i]));
  return end;
}

template <class T>
T* as(std::vector<char>& host) {
  return reinterpret_cast<T*>(host.data());
}

}  // namespace

std::vector<char> StagedComm::take(size_t bytes) const {
  if (spares_.empty()) return std::vector<char>(bytes);
  // The smallest spare that holds `bytes`, else the largest (it grows once).
  auto best = spares_.begin();
  for (auto it = spares_.begin(); it != spares_.end(); ++it) {
    const size_t c = it->capacity(), b = best->capacity();
    if (c >= bytes ? (b < bytes || c < b) : (b < bytes && c > b)) best = it;
  }
  std::vector<char> host = std::move(*best);
  spares_.erase(best);
  host.resize(bytes);
  return host;
}

void StagedComm::give(std::vector<char> host) const { spares_.push_back(std::move(host)); }

std::vector<char> StagedComm::to_host(const void* device, size_t bytes) const {
  std::vector<char> host = take(bytes);
  if (bytes) kernels::copy_to_host(exec_, host.data(), device, bytes);
  return host;
}

void StagedComm::all_reduce(float* data, size_t count, ReduceOp op) const {
  std::vector<char> host = to_host(data, count * sizeof(float));
  inner_.all_reduce(as<float>(host), count, op);
  kernels::copy_from_host(exec_, data, host.data(), host.size());
  give(std::move(host));
}

void StagedComm::all_reduce_bf16(uint16_t* data, size_t count) const {
  std::vector<char> host = to_host(data, count * sizeof(uint16_t));
  inner_.all_reduce_bf16(as<uint16_t>(host), count);
  kernels::copy_from_host(exec_, data, host.data(), host.size());
  give(std::move(host));
}

void StagedComm::all_gather(const float* send, float* recv, size_t count) const {
  std::vector<char> mine = to_host(send, count * sizeof(float));
  std::vector<char> all = take(count * sizeof(float) * static_cast<size_t>(size()));
  inner_.all_gather(as<float>(mine), as<float>(all), count);
  kernels::copy_from_host(exec_, recv, all.data(), all.size());
  give(std::move(mine));
  give(std::move(all));
}

void StagedComm::all_gather(const uint16_t* send, uint16_t* recv, size_t count) const {
  std::vector<char> mine = to_host(send, count * sizeof(uint16_t));
  std::vector<char> all = take(count * sizeof(uint16_t) * static_cast<size_t>(size()));
  inner_.all_gather(as<uint16_t>(mine), as<uint16_t>(all), count);
  kernels::copy_from_host(exec_, recv, all.data(), all.size());
  give(std::move(mine));
  give(std::move(all));
}

void StagedComm::reduce_scatter(const float* send, float* recv, size_t count) const {
  std::vector<char> all = to_host(send, count * sizeof(float) * static_cast<size_t>(size()));
  std::vector<char> mine = take(count * sizeof(float));
  inner_.reduce_scatter(as<float>(all), as<float>(mine), count);
  kernels::copy_from_host(exec_, recv, mine.data(), mine.size());
  give(std::move(all));
  give(std::move(mine));
}

void StagedComm::reduce_scatter_bf16(const uint16_t* send, uint16_t* recv, size_t count) const {
  std::vector<char> all = to_host(send, count * sizeof(uint16_t) * static_cast<size_t>(size()));
  std::vector<char> mine = take(count * sizeof(uint16_t));
  inner_.reduce_scatter_bf16(as<uint16_t>(all), as<uint16_t>(mine), count);
  kernels::copy_from_host(exec_, recv, mine.data(), mine.size());
  give(std::move(all));
  give(std::move(mine));
}

void StagedComm::recv(float* data, size_t count, int peer, int tag) const {
  std::vector<char> host = take(count * sizeof(float));
  inner_.recv(as<float>(host), count, peer, tag);
  kernels::copy_from_host(exec_, data, host.data(), host.size());
  give(std::move(host));
}

void StagedComm::recv(uint16_t* data, size_t count, int peer, int tag) const {
  std::vector<char> host = take(count * sizeof(uint16_t));
  inner_.recv(as<uint16_t>(host), count, peer, tag);
  kernels::copy_from_host(exec_, data, host.data(), host.size());
  give(std::move(host));
}

Request StagedComm::isend(const float* data, size_t count, int peer, int tag) const {
  Staged s{to_host(data, count * sizeof(float))};
  const Request r = inner_.isend(as<float>(s.host), count, peer, tag);
  return track(r, std::move(s));
}

Request StagedComm::isend(const uint16_t* data, size_t count, int peer, int tag) const {
  Staged s{to_host(data, count * sizeof(uint16_t))};
  const Request r = inner_.isend(as<uint16_t>(s.host), count, peer, tag);
  return track(r, std::move(s));
}

Request StagedComm::iall_reduce_sum(float* data, size_t count, const char* what,
                                    int64_t tag) const {
  Staged s{to_host(data, count * sizeof(float)), data, 0, count * sizeof(float)};
  const Request r = inner_.iall_reduce_sum(as<float>(s.host), count, what, tag);
  return track(r, std::move(s));
}

Request StagedComm::ireduce_scatter_sum(float* data, const std::vector<int>& counts,
                                        const char* what, int64_t tag) const {
  size_t whole = 0;
  for (const int c : counts) whole += static_cast<size_t>(c);
  const size_t mine = static_cast<size_t>(counts[static_cast<size_t>(rank())]) * sizeof(float);
  Staged s{to_host(data, whole * sizeof(float)), data, 0, mine};
  const Request r = inner_.ireduce_scatter_sum(as<float>(s.host), counts, what, tag);
  return track(r, std::move(s));
}

Request StagedComm::iall_gatherv(const float* mine, float* recv, const std::vector<int>& counts,
                                 const std::vector<int>& displs, const char* what,
                                 int64_t tag) const {
  const size_t bytes = extent(counts, displs) * sizeof(float);
  const size_t own = static_cast<size_t>(rank());
  // The host receive buffer starts as recv's bytes: with `mine` null this rank's part is there.
  Staged s{to_host(recv, bytes), recv, 0, bytes};
  if (mine)
    kernels::copy_to_host(exec_, s.host.data() + static_cast<size_t>(displs[own]) * sizeof(float),
                          mine, static_cast<size_t>(counts[own]) * sizeof(float));
  const Request r = inner_.iall_gatherv(nullptr, as<float>(s.host), counts, displs, what, tag);
  return track(r, std::move(s));
}

template <class T>
void StagedComm::all_to_allv(Exchange& exchange, const T* send, const std::vector<int>& send_counts,
                             const std::vector<int>& send_displs, T* recv,
                             const std::vector<int>& recv_counts,
                             const std::vector<int>& recv_displs, size_t row_size) const {
  const size_t row_bytes = row_size * sizeof(T);
  // Send staging then receive staging, in one block kept until the exchange finishes. The receive
  // staging starts at least one element in, also when this rank sends nothing: a send buffer equal
  // to the receive buffer is MPI_IN_PLACE to Open MPI's non-blocking collectives (libnbc), whose
  // in-place exchange then waits for rows the peers never send.
  const size_t send_bytes = extent(send_counts, send_displs) * row_bytes;
  const size_t recv_bytes = extent(recv_counts, recv_displs) * row_bytes;
  const size_t recv_at = std::max(send_bytes, sizeof(T));
  Staged s{take(recv_at + recv_bytes), recv, recv_at, recv_bytes};
  if (send_bytes) kernels::copy_to_host(exec_, s.host.data(), send, send_bytes);
  inner_.start_all_to_allv(exchange, reinterpret_cast<const T*>(s.host.data()), send_counts,
                           send_displs, reinterpret_cast<T*>(s.host.data() + recv_at), recv_counts,
                           recv_displs, row_size);
  exchange.request = track(exchange.request, std::move(s));
}

void StagedComm::start_all_to_allv(Exchange& exchange, const float* send,
                                   const std::vector<int>& send_counts,
                                   const std::vector<int>& send_displs, float* recv,
                                   const std::vector<int>& recv_counts,
                                   const std::vector<int>& recv_displs, size_t row_size) const {
  all_to_allv(exchange, send, send_counts, send_displs, recv, recv_counts, recv_displs, row_size);
}

void StagedComm::start_all_to_allv(Exchange& exchange, const uint16_t* send,
                                   const std::vector<int>& send_counts,
                                   const std::vector<int>& send_displs, uint16_t* recv,
                                   const std::vector<int>& recv_counts,
                                   const std::vector<int>& recv_displs, size_t row_size) const {
  all_to_allv(exchange, send, send_counts, send_displs, recv, recv_counts, recv_displs, row_size);
}

Request StagedComm::track(Request inner, Staged staged) const {
  if (!inner.pending) {  // finished already (or skipped by a test-only fault): copy back now
    if (staged.back && staged.back_bytes)
      kernels::copy_from_host(exec_, staged.back, staged.host.data() + staged.back_offset,
                              staged.back_bytes);
    give(std::move(staged.host));
    return inner;
  }
  const bool fresh = started_.emplace(inner.handle, std::move(staged)).second;
  T3D_ASSERT(fresh, "two started operations share the handle ", inner.handle);
  return inner;
}

void StagedComm::finish(uint64_t handle) const {
  const auto it = started_.find(handle);
  T3D_ASSERT(it != started_.end(), "a finished request this communicator did not start");
  Staged& s = it->second;
  if (s.back && s.back_bytes)
    kernels::copy_from_host(exec_, s.back, s.host.data() + s.back_offset, s.back_bytes);
  give(std::move(s.host));
  started_.erase(it);
}

void StagedComm::wait(Request& request, const char* what, int peer) const {
  if (!request.pending) return;
  const uint64_t handle = request.handle;  // the inner wait may reset it
  inner_.wait(request, what, peer);
  finish(handle);
}

bool StagedComm::test(Request& request) const {
  if (!request.pending) return true;
  const uint64_t handle = request.handle;
  if (!inner_.test(request)) return false;
  finish(handle);
  return true;
}

void StagedComm::release(Request& request) const {
  if (!request.pending) return;
  const uint64_t handle = request.handle;
  inner_.release(request);
  const auto it = started_.find(handle);
  if (it == started_.end()) return;
  released_.push_back(std::move(it->second));  // the operation may still read or fill it
  started_.erase(it);
}

}  // namespace t3d::parallel
