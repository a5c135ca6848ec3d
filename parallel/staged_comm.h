// Tensor collectives for a rank whose tensors live in its device's memory, over a communicator
// that reads and writes host memory only (the MPI one): each operation copies its input to host
// staging, runs the inner operation there, and copies the result back into device memory
// (kernels::copy_to_host / copy_from_host on the rank's Exec). A started operation copies back
// when wait() or test() sees it finished. The sums, their order and so the bits are the inner
// communicator's. This is the path for ranks that share a GPU (which NCCL refuses) and for GPUs
// without a device communicator; on a CPU Exec it is the same as the inner one, plus copies.
#pragma once

#include <cstdint>
#include <list>
#include <map>
#include <vector>

#include "kernels/exec.h"
#include "parallel/tensor_comm.h"

namespace t3d::parallel {

class StagedComm final : public TensorComm {
 public:
  // Both must outlive this.
  StagedComm(const TensorComm& inner, const kernels::Exec& exec) : inner_(inner), exec_(exec) {}
  int rank() const override { return inner_.rank(); }
  int size() const override { return inner_.size(); }

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

 private:
  // A started operation's host side: `host` holds its staging (kept alive until it finishes);
  // on finishing, bytes [back_offset, back_offset + back_bytes) of it go to `back` (none when
  // null: a send).
  struct Staged {
    std::vector<char> host;
    void* back = nullptr;
    size_t back_offset = 0, back_bytes = 0;
  };
  // Host staging: a buffer from the spares (finished operations' staging, kept so that a steady
  // stream of operations allocates nothing after the first), sized `bytes`; and its return.
  std::vector<char> take(size_t bytes) const;
  void give(std::vector<char> host) const;
  std::vector<char> to_host(const void* device, size_t bytes) const;
  // Records `staged` under the inner request's handle, or copies it back now when the inner
  // operation finished already (a request that was never pending).
  Request track(Request inner, Staged staged) const;
  void finish(uint64_t handle) const;
  template <class T>
  void all_to_allv(Exchange& exchange, const T* send, const std::vector<int>& send_counts,
                   const std::vector<int>& send_displs, T* recv,
                   const std::vector<int>& recv_counts, const std::vector<int>& recv_displs,
                   size_t row_size) const;

  const TensorComm& inner_;
  kernels::Exec exec_;
  mutable std::map<uint64_t, Staged> started_;  // by the inner request's handle
  mutable std::list<Staged> released_;          // dropped unfinished: kept until destruction
  mutable std::vector<std::vector<char>> spares_;
};

}  // namespace t3d::parallel
