#include "parallel/comm.h"

#include <sched.h>
#include <spdlog/spdlog.h>

#include <algorithm>
#include <chrono>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <thread>

#include "kernels/check.h"
#include "kernels/precision.h"
#include "parallel/fault.h"
#include "parallel/trace.h"

namespace t3d::parallel {

namespace detail {
void check_mpi(int code, const char* call, const char* file, int line) {
  if (code == MPI_SUCCESS) return;
  char text[MPI_MAX_ERROR_STRING];
  int len = 0;
  MPI_Error_string(code, text, &len);
  throw InternalError(std::string(file) + ":" + std::to_string(line) + ": " + call +
                      " failed: " + std::string(text, len));
}
}  // namespace detail

namespace {
MPI_Op to_mpi(ReduceOp op) {
  switch (op) {
    case ReduceOp::sum:
      return MPI_SUM;
    case ReduceOp::max:
      return MPI_MAX;
    case ReduceOp::min:
      return MPI_MIN;
  }
  return MPI_SUM;
}

// A Request carries an MPI_Request's bits; MPI_REQUEST_NULL is the done Request.
static_assert(sizeof(MPI_Request) <= sizeof(uint64_t), "an MPI_Request must fit a Request handle");
Request wrap(MPI_Request r) {
  Request q;
  if (r == MPI_REQUEST_NULL) return q;
  q.pending = true;
  std::memcpy(&q.handle, &r, sizeof r);
  return q;
}
MPI_Request unwrap(const Request& q) {
  if (!q.pending) return MPI_REQUEST_NULL;
  MPI_Request r;
  std::memcpy(&r, &q.handle, sizeof r);
  return r;
}

int checked_count(size_t count) {
  T3D_ASSERT(count <= static_cast<size_t>(INT32_MAX), "message of ", count,
             " elements exceeds MPI's int count");
  return static_cast<int>(count);
}
}  // namespace

Comm Comm::world(double timeout_s) {
  Comm c;
  T3D_MPI(MPI_Comm_dup(MPI_COMM_WORLD, &c.comm_));
  T3D_MPI(MPI_Comm_set_errhandler(c.comm_, MPI_ERRORS_RETURN));
  T3D_MPI(MPI_Comm_rank(c.comm_, &c.rank_));
  T3D_MPI(MPI_Comm_size(c.comm_, &c.size_));
  c.name_ = "world";
  c.timeout_s_ = timeout_s;
  c.world_ranks_.resize(c.size_);
  for (int i = 0; i < c.size_; ++i) c.world_ranks_[i] = i;
  return c;
}

Comm::~Comm() { reset(); }

void Comm::reset() noexcept {
  if (comm_ != MPI_COMM_NULL) {
    int finalized = 0;
    MPI_Finalized(&finalized);
    if (!finalized) MPI_Comm_free(&comm_);
    comm_ = MPI_COMM_NULL;
  }
}

Comm::Comm(Comm&& o) noexcept { *this = std::move(o); }

Comm& Comm::operator=(Comm&& o) noexcept {
  if (this != &o) {
    reset();
    comm_ = o.comm_;
    rank_ = o.rank_;
    size_ = o.size_;
    name_ = std::move(o.name_);
    world_ranks_ = std::move(o.world_ranks_);
    world_hosts_ = std::move(o.world_hosts_);
    timeout_s_ = o.timeout_s_;
    counters_ = o.counters_;
    o.comm_ = MPI_COMM_NULL;
  }
  return *this;
}

Comm Comm::split(int colour, int key, std::string name) const {
  Comm c;
  T3D_MPI(MPI_Comm_split(comm_, colour, key, &c.comm_));
  T3D_MPI(MPI_Comm_set_errhandler(c.comm_, MPI_ERRORS_RETURN));
  T3D_MPI(MPI_Comm_rank(c.comm_, &c.rank_));
  T3D_MPI(MPI_Comm_size(c.comm_, &c.size_));
  c.name_ = std::move(name);
  c.timeout_s_ = timeout_s_;
  c.world_hosts_ = world_hosts_;
  c.counters_ = {};
  // Members' world ranks, for watchdog messages that name peers.
  const int mine = world_ranks_.at(rank_);
  c.world_ranks_.resize(c.size_);
  T3D_MPI(MPI_Allgather(&mine, 1, MPI_INT, c.world_ranks_.data(), 1, MPI_INT, c.comm_));
  return c;
}

void Comm::set_world_hosts(std::vector<std::string> host_of_world_rank) {
  world_hosts_ = std::make_shared<const std::vector<std::string>>(std::move(host_of_world_rank));
}

void Comm::wait(Request& request, const char* what, int peer) const {
  MPI_Request r = unwrap(request);
  wait_mpi(r, what, peer);
  request = Request{};
}

void Comm::wait_mpi(MPI_Request& request, const char* what, int peer) const {
  using Clock = std::chrono::steady_clock;
  const auto start = Clock::now();
  int done = 0;
  for (long polls = 0;; ++polls) {
    T3D_MPI(MPI_Test(&request, &done, MPI_STATUS_IGNORE));
    if (done) {
      counters_.wait_s += std::chrono::duration<double>(Clock::now() - start).count();
      return;
    }
    // Yield first (latency), then sleep briefly: ranks are often oversubscribed on few cores and a
    // spinning waiter would steal the core its peer needs to finish computing.
    if (polls < 2000)
      sched_yield();
    else
      std::this_thread::sleep_for(std::chrono::microseconds(50));
    if ((polls & 255) == 0 &&
        std::chrono::duration<double>(Clock::now() - start).count() > timeout_s_)
      abort_hung(what, peer);
  }
}

void Comm::abort_hung(const char* what, int peer, const std::string& note) const {
  std::string peers;
  if (peer >= 0) {
    peers = "peer world rank " + std::to_string(world_ranks_.at(peer));
  } else {
    for (size_t i = 0; i < world_ranks_.size(); ++i)
      peers += (i ? "," : "") + std::to_string(world_ranks_[i]);
    peers = "members world ranks {" + peers + "}";
  }
  // With hosts known: which other hosts this rank waits on (a cut link shows as their names).
  std::string where;
  if (world_hosts_) {
    const auto host = [&](int group_rank) { return world_hosts_->at(world_ranks_.at(group_rank)); };
    std::vector<std::pair<std::string, std::string>> others;  // host, its world ranks
    for (int i = 0; i < size_; ++i) {
      if ((peer >= 0 && i != peer) || host(i) == host(rank_)) continue;
      auto it = std::find_if(others.begin(), others.end(),
                             [&](const auto& o) { return o.first == host(i); });
      if (it == others.end()) it = others.insert(others.end(), {host(i), ""});
      it->second += (it->second.empty() ? "" : ",") + std::to_string(world_ranks_[i]);
    }
    where = "; on host " + host(rank_) + ", waiting on ";
    if (others.empty()) where += "no other host";
    for (size_t h = 0; h < others.size(); ++h)
      where += (h ? ", host " : "host ") + others[h].first + " (world rank" +
               (others[h].second.find(',') == std::string::npos ? " " : "s ") + others[h].second +
               ")";
  }
  const std::string msg = "watchdog: world rank " + std::to_string(world_ranks_.at(rank_)) +
                          " waited more than " + std::to_string(static_cast<int>(timeout_s_)) +
                          " s (parallel.timeout_s) in " + what + " on group `" + name_ + "` (" +
                          peers + ")" + where + note +
                          "; a peer is stuck or dead, or the network to its host is down. "
                          "Aborting the job.";
  spdlog::critical(msg);
  std::fprintf(stderr, "%s\n", msg.c_str());
  std::fflush(stderr);
  // The first rank to time out is often not the one that sees the cause: a rank waiting on a
  // same-host peer fires while that peer still waits on the dead host. A short grace lets the
  // other stuck ranks' watchdogs report too before the abort kills them.
  std::this_thread::sleep_for(std::chrono::duration<double>(std::clamp(timeout_s_ / 2, 0.5, 10.0)));
  MPI_Abort(MPI_COMM_WORLD, 3);
  std::abort();  // MPI_Abort does not return
}

namespace {
uint64_t bytes_of(size_t count, MPI_Datatype type) {
  int size = 0;
  MPI_Type_size(type, &size);
  return static_cast<uint64_t>(count) * static_cast<uint64_t>(size);
}
}  // namespace

bool Comm::test(Request& request) const {
  if (!request.pending) return true;
  MPI_Request r = unwrap(request);
  int done = 0;
  T3D_MPI(MPI_Test(&r, &done, MPI_STATUS_IGNORE));
  request = wrap(r);
  return done != 0;
}

void Comm::release(Request& request) const {
  MPI_Request r = unwrap(request);
  if (r != MPI_REQUEST_NULL) MPI_Request_free(&r);
  request = Request{};
}

void Comm::all_reduce_raw(void* data, size_t count, MPI_Datatype type, ReduceOp op) const {
  if (fault::skip_operation(name_, world_ranks_[rank_])) return;  // test-only (fault.h)
  trace::Span span("all_reduce", "comm");
  span.arg("group", name_).arg("bytes", static_cast<int64_t>(bytes_of(count, type)));
  counters_.bytes += bytes_of(count, type);
  if (op == ReduceOp::sum) fault::corrupt_contribution(data, count, type, world_ranks_[rank_]);
  MPI_Request r;
  T3D_MPI(MPI_Iallreduce(MPI_IN_PLACE, data, checked_count(count), type, to_mpi(op), comm_, &r));
  wait_mpi(r, "all_reduce");
}

namespace {
void bf16_sum(void* in, void* inout, int* len, MPI_Datatype*) {
  const auto* a = static_cast<const uint16_t*>(in);
  auto* b = static_cast<uint16_t*>(inout);
  for (int i = 0; i < *len; ++i)
    b[i] = kernels::float_to_bf16(kernels::bf16_to_float(a[i]) + kernels::bf16_to_float(b[i]));
}

MPI_Op bf16_sum_op() {
  static MPI_Op op = [] {
    MPI_Op o;
    T3D_MPI(MPI_Op_create(&bf16_sum, /*commute=*/1, &o));
    return o;
  }();
  return op;
}
}  // namespace

void Comm::all_reduce_bf16(uint16_t* data, size_t count) const {
  if (fault::skip_operation(name_, world_ranks_[rank_])) return;  // test-only (fault.h)
  trace::Span span("all_reduce (bf16)", "comm");
  span.arg("group", name_).arg("bytes", static_cast<int64_t>(count * sizeof(uint16_t)));
  counters_.bytes += count * sizeof(uint16_t);
  MPI_Request r;
  T3D_MPI(MPI_Iallreduce(MPI_IN_PLACE, data, checked_count(count), MPI_UINT16_T, bf16_sum_op(),
                         comm_, &r));
  wait_mpi(r, "all_reduce (bf16)");
}

void Comm::reduce_scatter_bf16(const uint16_t* send, uint16_t* recv, size_t count) const {
  if (fault::skip_operation(name_, world_ranks_[rank_])) return;  // test-only (fault.h)
  trace::Span span("reduce_scatter (bf16)", "comm");
  span.arg("group", name_).arg("bytes", static_cast<int64_t>(count * size_ * sizeof(uint16_t)));
  counters_.bytes += count * size_ * sizeof(uint16_t);
  MPI_Request r;
  T3D_MPI(MPI_Ireduce_scatter_block(send, recv, checked_count(count), MPI_UINT16_T, bf16_sum_op(),
                                    comm_, &r));
  wait_mpi(r, "reduce_scatter (bf16)");
}

void Comm::all_gather_raw(const void* send, void* recv, size_t count, MPI_Datatype type) const {
  if (fault::skip_operation(name_, world_ranks_[rank_])) return;  // test-only (fault.h)
  trace::Span span("all_gather", "comm");
  span.arg("group", name_).arg("bytes", static_cast<int64_t>(bytes_of(count, type)));
  counters_.bytes += bytes_of(count, type);
  MPI_Request r;
  const int n = checked_count(count);
  T3D_MPI(MPI_Iallgather(send, n, type, recv, n, type, comm_, &r));
  wait_mpi(r, "all_gather");
}

void Comm::reduce_scatter_raw(const void* send, void* recv, size_t count, MPI_Datatype type) const {
  if (fault::skip_operation(name_, world_ranks_[rank_])) return;  // test-only (fault.h)
  trace::Span span("reduce_scatter", "comm");
  span.arg("group", name_).arg("bytes", static_cast<int64_t>(bytes_of(count * size_, type)));
  counters_.bytes += bytes_of(count * size_, type);
  MPI_Request r;
  T3D_MPI(MPI_Ireduce_scatter_block(send, recv, checked_count(count), type, MPI_SUM, comm_, &r));
  wait_mpi(r, "reduce_scatter");
}

void Comm::all_to_all_raw(const void* send, void* recv, size_t count, MPI_Datatype type) const {
  if (fault::skip_operation(name_, world_ranks_[rank_])) return;  // test-only (fault.h)
  const uint64_t bytes = bytes_of(count * (size_ - 1), type);     // the block to itself stays
  trace::Span span("all_to_all", "comm");
  span.arg("group", name_).arg("bytes", static_cast<int64_t>(bytes));
  counters_.bytes += bytes;
  MPI_Request r;
  const int n = checked_count(count);
  T3D_MPI(MPI_Ialltoall(send, n, type, recv, n, type, comm_, &r));
  wait_mpi(r, "all_to_all");
}

void Comm::all_to_allv_raw(const void* send, const std::vector<int>& send_counts,
                           const std::vector<int>& send_displs, void* recv,
                           const std::vector<int>& recv_counts, const std::vector<int>& recv_displs,
                           size_t row_size, MPI_Datatype type) const {
  Exchange x;
  start_all_to_allv_raw(x, send, send_counts, send_displs, recv, recv_counts, recv_displs, row_size,
                        type);
  wait(x);
}

void Comm::start_all_to_allv_raw(Exchange& x, const void* send, const std::vector<int>& send_counts,
                                 const std::vector<int>& send_displs, void* recv,
                                 const std::vector<int>& recv_counts,
                                 const std::vector<int>& recv_displs, size_t row_size,
                                 MPI_Datatype type) const {
  T3D_ASSERT(!x.request.pending,
             "all_to_allv started in an exchange whose previous one is still in flight");
  const size_t n = static_cast<size_t>(size_);
  T3D_ASSERT(send_counts.size() == n && send_displs.size() == n && recv_counts.size() == n &&
                 recv_displs.size() == n,
             "all_to_allv counts / displacements for ", send_counts.size(), ", ",
             send_displs.size(), ", ", recv_counts.size(), ", ", recv_displs.size(),
             " ranks on a group of ", size_);
  if (fault::skip_operation(name_, world_ranks_[rank_])) return;  // test-only (fault.h)
  // Rows to elements: MPI's counts are ints, so every count and end is checked to fit.
  std::vector<int>& elements = x.elements;
  elements.resize(4 * n);
  size_t sent_rows = 0, send_end = 0;
  for (size_t p = 0; p < n; ++p) {
    T3D_ASSERT(
        send_counts[p] >= 0 && send_displs[p] >= 0 && recv_counts[p] >= 0 && recv_displs[p] >= 0,
        "all_to_allv: negative count or displacement for group rank ", p);
    checked_count((static_cast<size_t>(send_displs[p]) + send_counts[p]) * row_size);
    checked_count((static_cast<size_t>(recv_displs[p]) + recv_counts[p]) * row_size);
    elements[p] = static_cast<int>(send_counts[p] * row_size);
    elements[n + p] = static_cast<int>(send_displs[p] * row_size);
    elements[2 * n + p] = static_cast<int>(recv_counts[p] * row_size);
    elements[3 * n + p] = static_cast<int>(recv_displs[p] * row_size);
    if (static_cast<int>(p) != rank_) sent_rows += static_cast<size_t>(send_counts[p]);
    send_end = std::max(send_end, static_cast<size_t>(send_displs[p]) + send_counts[p]);
  }
  if (fault::corrupts(world_ranks_[rank_])) {  // test-only (fault.h): rows leave doubled
    const auto* bytes = static_cast<const char*>(send);
    x.corrupted.assign(bytes, bytes + bytes_of(send_end * row_size, type));
    fault::corrupt_contribution(x.corrupted.data(), send_end * row_size, type, world_ranks_[rank_]);
    send = x.corrupted.data();
  }
  const uint64_t bytes = bytes_of(sent_rows * row_size, type);  // the rows to itself stay
  MPI_Request r;
  trace::Span span("all_to_allv", "comm");
  span.arg("group", name_).arg("bytes", static_cast<int64_t>(bytes));
  counters_.bytes += bytes;
  T3D_MPI(MPI_Ialltoallv(send, elements.data(), elements.data() + n, type, recv,
                         elements.data() + 2 * n, elements.data() + 3 * n, type, comm_, &r));
  x.request = wrap(r);
}

void Comm::broadcast(std::string& text, int root) const {
  uint64_t n = text.size();
  broadcast(&n, 1, root);
  text.resize(n);
  if (n) broadcast(text.data(), n, root);
}

void Comm::broadcast_raw(void* data, size_t count, MPI_Datatype type, int root) const {
  if (fault::skip_operation(name_, world_ranks_[rank_])) return;  // test-only (fault.h)
  trace::Span span("broadcast", "comm");
  span.arg("group", name_).arg("bytes", static_cast<int64_t>(bytes_of(count, type)));
  MPI_Request r;
  T3D_MPI(MPI_Ibcast(data, checked_count(count), type, root, comm_, &r));
  wait_mpi(r, "broadcast", root);
}

void Comm::send_raw(const void* data, size_t count, MPI_Datatype type, int peer, int tag) const {
  if (fault::skip_operation(name_, world_ranks_[rank_])) return;  // test-only (fault.h)
  trace::Span span("send", "comm");
  span.arg("group", name_).arg("bytes", static_cast<int64_t>(bytes_of(count, type)));
  counters_.bytes += bytes_of(count, type);
  if (fault::drop_send(world_ranks_[rank_])) return;
  fault::delay_send(world_ranks_[rank_], world_ranks_.at(peer));
  MPI_Request r;
  T3D_MPI(MPI_Isend(data, checked_count(count), type, peer, tag, comm_, &r));
  wait_mpi(r, "send", peer);
}

Request Comm::isend_raw(const void* data, size_t count, MPI_Datatype type, int peer,
                        int tag) const {
  if (fault::skip_operation(name_, world_ranks_[rank_])) return Request{};  // test-only
  trace::Span span("isend", "comm");
  span.arg("group", name_).arg("bytes", static_cast<int64_t>(bytes_of(count, type)));
  counters_.bytes += bytes_of(count, type);
  if (fault::drop_send(world_ranks_[rank_])) return Request{};
  fault::delay_send(world_ranks_[rank_], world_ranks_.at(peer));
  MPI_Request r;
  T3D_MPI(MPI_Isend(data, checked_count(count), type, peer, tag, comm_, &r));
  return wrap(r);
}

Request Comm::iall_reduce_sum(float* data, size_t count, const char* what, int64_t tag) const {
  if (fault::skip_operation(name_, world_ranks_[rank_])) return Request{};  // test-only
  trace::Span span(what, "comm");
  span.arg("group", name_).arg("bytes", static_cast<int64_t>(count * sizeof(float)));
  if (tag >= 0) span.arg("bucket", tag);
  counters_.bytes += count * sizeof(float);
  MPI_Request r;
  T3D_MPI(MPI_Iallreduce(MPI_IN_PLACE, data, checked_count(count), MPI_FLOAT, MPI_SUM, comm_, &r));
  return wrap(r);
}

Request Comm::ireduce_scatter_sum(float* data, const std::vector<int>& counts, const char* what,
                                  int64_t tag) const {
  T3D_ASSERT(static_cast<int>(counts.size()) == size_, "counts for ", counts.size(),
             " ranks on a group of ", size_);
  if (fault::skip_operation(name_, world_ranks_[rank_])) return Request{};  // test-only
  int64_t total = 0;
  for (int c : counts) total += c;
  trace::Span span(what, "comm");
  span.arg("group", name_).arg("bytes", total * static_cast<int64_t>(sizeof(float)));
  if (tag >= 0) span.arg("bucket", tag);
  counters_.bytes += static_cast<uint64_t>(total) * sizeof(float);
  MPI_Request r;
  T3D_MPI(MPI_Ireduce_scatter(MPI_IN_PLACE, data, counts.data(), MPI_FLOAT, MPI_SUM, comm_, &r));
  return wrap(r);
}

Request Comm::iall_gatherv(const float* mine, float* recv, const std::vector<int>& counts,
                           const std::vector<int>& displs, const char* what, int64_t tag) const {
  T3D_ASSERT(static_cast<int>(counts.size()) == size_ && displs.size() == counts.size(),
             "counts / displacements for ", counts.size(), " ranks on a group of ", size_);
  if (fault::skip_operation(name_, world_ranks_[rank_])) return Request{};  // test-only
  const int64_t bytes = static_cast<int64_t>(counts[rank_]) * static_cast<int64_t>(sizeof(float));
  trace::Span span(what, "comm");
  span.arg("group", name_).arg("bytes", bytes);
  if (tag >= 0) span.arg("bucket", tag);
  counters_.bytes += static_cast<uint64_t>(bytes);
  MPI_Request r;
  if (mine)
    T3D_MPI(MPI_Iallgatherv(mine, counts[rank_], MPI_FLOAT, recv, counts.data(), displs.data(),
                            MPI_FLOAT, comm_, &r));
  else
    T3D_MPI(MPI_Iallgatherv(MPI_IN_PLACE, 0, MPI_FLOAT, recv, counts.data(), displs.data(),
                            MPI_FLOAT, comm_, &r));
  return wrap(r);
}

void Comm::recv_raw(void* data, size_t count, MPI_Datatype type, int peer, int tag) const {
  if (fault::skip_operation(name_, world_ranks_[rank_])) return;  // test-only (fault.h)
  trace::Span span("recv", "comm");
  span.arg("group", name_).arg("bytes", static_cast<int64_t>(bytes_of(count, type)));
  MPI_Request r;
  T3D_MPI(MPI_Irecv(data, checked_count(count), type, peer, tag, comm_, &r));
  wait_mpi(r, "recv", peer);
}

Request Comm::irecv_raw(void* data, size_t count, MPI_Datatype type, int peer, int tag) const {
  if (fault::skip_operation(name_, world_ranks_[rank_])) return Request{};  // test-only
  trace::Span span("irecv", "comm");
  span.arg("group", name_).arg("bytes", static_cast<int64_t>(bytes_of(count, type)));
  MPI_Request r;
  T3D_MPI(MPI_Irecv(data, checked_count(count), type, peer, tag, comm_, &r));
  return wrap(r);
}

void Comm::barrier() const {
  if (fault::skip_operation(name_, world_ranks_[rank_])) return;  // test-only (fault.h)
  trace::Span span("barrier", "comm");
  span.arg("group", name_);
  MPI_Request r;
  T3D_MPI(MPI_Ibarrier(comm_, &r));
  wait_mpi(r, "barrier");
}

Mesh::Mesh(const MeshShape& shape, Comm world)
    : shape_(shape), world_(std::move(world)), coord_(shape_.coord_of(world_.rank())) {
  T3D_ASSERT(shape_.world() == world_.size(), "mesh of ", shape_.world(), " ranks on a world of ",
             world_.size());
  for (Dim d : kDims) {
    // Key = coordinate along d, so a group's rank equals the rank's coordinate in that dimension.
    groups_[static_cast<int>(d)] =
        world_.split(shape_.group_index(d, rank()), coord_[d], dim_name(d));
  }
  const int dp_cp_rank = shape_.dp_cp_rank(rank());
  dp_cp_ = world_.split(shape_.dp_cp_group_index(rank()), dp_cp_rank, "dp_cp");
  ep_ = world_.split(shape_.ep_group_index(rank()), dp_cp_rank % shape_.ep(), "ep");
  edp_ = world_.split(shape_.edp_group_index(rank()), dp_cp_rank / shape_.ep(), "edp");
}

}  // namespace t3d::parallel
