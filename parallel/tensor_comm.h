// Collectives and point-to-point transfers of tensors: arena memory (kernels/arena.h), host memory
// on the CPU backend and device memory on a GPU one. The runtime moves tensors only through this
// interface. The MPI communicator (parallel/comm.h) implements it and also carries the control
// traffic (counts, agreement, broadcasts, files), which stays on host memory; a device
// communicator (NCCL, stream-ordered) implements the same calls on device pointers beside it.
// No MPI type appears here.
//
// Element types: fp32 (`float`) and bf16 (`uint16_t`, kernels/precision.h's bits). Every call
// has the watchdog of parallel.timeout_s: a peer stuck past it aborts the job, naming the
// operation and the peers (parallel/comm.h).
#pragma once

#include <cstddef>
#include <cstdint>
#include <vector>

namespace t3d::parallel {

enum class ReduceOp { sum, max, min };

// A transfer in flight, owned by the caller: the buffers it reads or fills stay untouched until
// wait() or test() on the communicator that started it reports it done. A default Request is
// done already (nothing was started, or a test-only fault skipped the operation).
struct Request {
  bool pending = false;  // started and not yet seen finished
  uint64_t handle = 0;   // the starting communicator's own handle (an MPI_Request's bits)
};

// An all_to_allv in flight. The caller owns it and starts one exchange after another in it: its
// buffers keep their capacity, so a steady stream of exchanges on one group allocates nothing
// after the first.
struct Exchange {
  Request request;
  std::vector<int> elements;    // counts and displacements in elements, read until done
  std::vector<char> corrupted;  // test-only (parallel/fault.h): the corrupted copy being sent
};

class TensorComm {
 public:
  virtual ~TensorComm() = default;
  virtual int rank() const = 0;
  virtual int size() const = 0;

  // In place over the group. bf16: each pairwise sum is computed in fp32 and rounded to bf16, so
  // the result may differ from an fp32 sum by a few bf16 ulps.
  virtual void all_reduce(float* data, size_t count, ReduceOp op = ReduceOp::sum) const = 0;
  virtual void all_reduce_bf16(uint16_t* data, size_t count) const = 0;
  // send: count elements per rank; recv: count·size elements, rank-major.
  virtual void all_gather(const float* send, float* recv, size_t count) const = 0;
  virtual void all_gather(const uint16_t* send, uint16_t* recv, size_t count) const = 0;
  // send: count·size elements, rank-major; recv: this rank's count-element block of the sum.
  virtual void reduce_scatter(const float* send, float* recv, size_t count) const = 0;
  virtual void reduce_scatter_bf16(const uint16_t* send, uint16_t* recv, size_t count) const = 0;

  // Point to point with group rank `peer`; a receive takes at most `count` elements.
  virtual void recv(float* data, size_t count, int peer, int tag) const = 0;
  virtual void recv(uint16_t* data, size_t count, int peer, int tag) const = 0;
  virtual Request isend(const float* data, size_t count, int peer, int tag) const = 0;
  virtual Request isend(const uint16_t* data, size_t count, int peer, int tag) const = 0;
  // Collective over the group: readies the pairs this rank will send to (`send_to`) and receive
  // from (`receive_from`) before their first message, each rank naming the other ends of its
  // peers' pairs. Where a first exchange connects the pair and waits for the peer inside the call
  // (NCCL), two ranks whose first messages cross (each sending before receiving) would otherwise
  // wait on each other; MPI needs nothing.
  virtual void prepare_pairs(const std::vector<int>& /*send_to*/,
                             const std::vector<int>& /*receive_from*/) const {}

  // Started float collectives, traced as `what` (with `tag` as its "bucket" when >= 0):
  //   iall_reduce_sum:     sum of `count` floats in place.
  //   ireduce_scatter_sum: in place; `data` holds the whole (sum of counts) input, this rank's
  //                        counts[rank()] reduced floats land at its start.
  //   iall_gatherv:        rank i's counts[i] floats to recv + displs[i] on every rank; `mine`
  //                        null: this rank's part is already in place in recv.
  virtual Request iall_reduce_sum(float* data, size_t count, const char* what,
                                  int64_t tag = -1) const = 0;
  virtual Request ireduce_scatter_sum(float* data, const std::vector<int>& counts, const char* what,
                                      int64_t tag = -1) const = 0;
  virtual Request iall_gatherv(const float* mine, float* recv, const std::vector<int>& counts,
                               const std::vector<int>& displs, const char* what,
                               int64_t tag = -1) const = 0;

  // All-to-all of rows of `row_size` elements, started in `exchange` (whose previous one must be
  // finished): send_counts[p] rows from send + send_displs[p]·row_size go to group rank p; the
  // recv_counts[p] rows from group rank p land at recv + recv_displs[p]·row_size. Counts and
  // displacements in rows; the placement is fixed by the displacements alone, never by arrival
  // order. recv_counts[p] must equal what rank p sends here.
  virtual void start_all_to_allv(Exchange& exchange, const float* send,
                                 const std::vector<int>& send_counts,
                                 const std::vector<int>& send_displs, float* recv,
                                 const std::vector<int>& recv_counts,
                                 const std::vector<int>& recv_displs, size_t row_size) const = 0;
  virtual void start_all_to_allv(Exchange& exchange, const uint16_t* send,
                                 const std::vector<int>& send_counts,
                                 const std::vector<int>& send_displs, uint16_t* recv,
                                 const std::vector<int>& recv_counts,
                                 const std::vector<int>& recv_displs, size_t row_size) const = 0;

  // Waits with the watchdog deadline (`what` and `peer`, or the whole group when -1, name the
  // wait in its message); the request is done afterwards.
  virtual void wait(Request& request, const char* what, int peer = -1) const = 0;
  void wait(Exchange& exchange) const { wait(exchange.request, "all_to_allv"); }
  // Has the request completed (and been released)? Never blocks.
  virtual bool test(Request& request) const = 0;
  // Drops a request without waiting for it (unwinding after an error): the operation completes
  // unobserved, so its buffers must outlive it.
  virtual void release(Request& request) const = 0;

 protected:
  TensorComm() = default;
  TensorComm(const TensorComm&) = default;
  TensorComm& operator=(const TensorComm&) = default;
};

}  // namespace t3d::parallel
