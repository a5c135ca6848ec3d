// Tensor collectives between GPUs over NCCL (loaded at run time: parallel/nccl_library.h), on
// device pointers, stream-ordered with the rank's compute stream (the Exec's cuda::Stream). Only
// for a group whose every rank has a GPU of its own (NCCL refuses two ranks of one communicator on
// one GPU); the stage decides per group (runtime/stage/device_comm.h). Built with T3D_HAVE_NCCL.
//
// Streams: every operation runs on a stream of this communicator that first waits on an event
// of the compute stream (so it sees the compute stream's writes), then records an event of its
// own. A blocking call (all_reduce, all_gather, reduce_scatter, recv) makes the compute stream
// wait on that event before returning, without blocking the host: what the compute stream runs
// next sees the result. A started call (isend, the i* collectives, start_all_to_allv) returns a
// Request; wait() makes the compute stream wait on its event (the host does not block), test()
// asks the event. So a gradient bucket's reduction overlaps the rest of the backward. The
// collectives share one stream and one NCCL communicator, in the order the host issues them,
// which every rank issues alike. Point-to-point transfers travel on two more communicators, one
// per direction (to a higher group rank, to a lower one), each with its own stream, so that two
// ranks sending to each other before receiving do not wait on each other's sends once their pair
// is connected. NCCL connects a pair at its first exchange on a communicator, on the host inside
// the call, waiting there for the peer to reach its own: so the pairs are connected beforehand,
// all ranks together (prepare_pairs: a grouped exchange of one float per pair and direction), by
// their users: the pipeline's ring neighbours when the stage's groups are made, the replay's
// update check per distance. (Two NCCL kernels on two streams progress side by side in practice,
// which CUDA does not promise.) NCCL has no
// tags, so the messages of one direction between two ranks match in the order they are issued
// (the tag is not used) and a receive must name the exact count sent.
//
// Bits: NCCL's own sums (ring, tree or NVLS, as NCCL's tuning picks for the group's size, the
// topology and the byte count), deterministic for a fixed configuration (ranks, GPUs, NCCL
// version, NCCL_* settings) since no floating-point atomics are involved, but not MPI's order: a
// sum may differ in its last bits from the staged path's. bf16 sums are NCCL's bf16 sums, in
// NCCL's order: on a ring or tree each pairwise add rounded to bf16 (round to nearest even), as
// the interface states; a switch reduction (NVLS) may add in higher precision and round once.
//
// Watchdog (parallel.timeout_s): a thread of this communicator polls the events of the
// operations in flight; one unfinished past the deadline (from when its stream reached it, not
// from its enqueue, which may be a step earlier), or an error NCCL reports
// (ncclCommGetAsyncError), aborts the NCCL communicators and then the job through the MPI
// communicator's watchdog (Comm::abort_hung: the operation, the group and its peers, exit 3).
// Traces: a span per call on the host (the enqueue, not the GPU's time). The test-only faults of
// parallel/fault.h act on the MPI communicator only.
#pragma once

#include <memory>

#include "kernels/exec.h"
#include "parallel/comm.h"
#include "parallel/tensor_comm.h"

namespace t3d::parallel {

class NcclComm final : public TensorComm {
 public:
  // Collective over `group`: its rank 0 makes NCCL's unique ids and sends them over `group`
  // (control traffic), then every rank joins. `exec` is the rank's GPU execution. Both must
  // outlive this. NCCL must have loaded (nccl_library()).
  NcclComm(const Comm& group, const kernels::Exec& exec);
  ~NcclComm() override;
  NcclComm(const NcclComm&) = delete;
  NcclComm& operator=(const NcclComm&) = delete;

  int rank() const override;
  int size() const override;
  void all_reduce(float* data, size_t count, ReduceOp op = ReduceOp::sum) const override;
  void all_reduce_bf16(uint16_t* data, size_t count) const override;
  void all_gather(const float* send, float* recv, size_t count) const override;
  void all_gather(const uint16_t* send, uint16_t* recv, size_t count) const override;
  void reduce_scatter(const float* send, float* recv, size_t count) const override;
  void reduce_scatter_bf16(const uint16_t* send, uint16_t* recv, size_t count) const override;
  void recv(float* data, size_t count, int peer, int tag) const override;
  void recv(uint16_t* data, size_t count, int peer, int tag) const override;
  Request isend(const float* data, size_t count, int peer, int tag) const override;
  Request isend(const uint16_t* data, size_t count, int peer, int tag) const override;
  void prepare_pairs(const std::vector<int>& send_to,
                     const std::vector<int>& receive_from) const override;
  Request iall_reduce_sum(float* data, size_t count, const char* what,
                          int64_t tag = -1) const override;
  Request ireduce_scatter_sum(float* data, const std::vector<int>& counts, const char* what,
                              int64_t tag = -1) const override;
  Request iall_gatherv(const float* mine, float* recv, const std::vector<int>& counts,
                       const std::vector<int>& displs, const char* what,
                       int64_t tag = -1) const override;
  void start_all_to_allv(Exchange& exchange, const float* send, const std::vector<int>& send_counts,
                         const std::vector<int>& send_displs, float* recv,
                         const std::vector<int>& recv_counts, const std::vector<int>& recv_displs,
                         size_t row_size) const override;
  void start_all_to_allv(Exchange& exchange, const uint16_t* send,
                         const std::vector<int>& send_counts, const std::vector<int>& send_displs,
                         uint16_t* recv, const std::vector<int>& recv_counts,
                         const std::vector<int>& recv_displs, size_t row_size) const override;
  using TensorComm::wait;  // wait(Exchange&)
  void wait(Request& request, const char* what, int peer = -1) const override;
  bool test(Request& request) const override;
  void release(Request& request) const override;

  struct Impl;  // the NCCL communicators, streams and watchdog (nccl_comm.cpp)

 private:
  std::unique_ptr<Impl> impl_;
};

}  // namespace t3d::parallel
