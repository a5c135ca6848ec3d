// A thin RAII wrapper over MPI communicators: typed collectives, checked return codes, and a
// watchdog on every wait. No global communicators: a Mesh object is passed explicitly.
//
// Every blocking operation is issued non-blocking and then waited on with a deadline
// (parallel.timeout_s): a rank stuck past it logs the operation, group and peers it waits on and
// aborts the whole job, so no rank hangs forever (Open MPI never detects a hang by itself).
#pragma once

#include <mpi.h>

#include <cstdint>
#include <memory>
#include <string>
#include <type_traits>
#include <vector>

#include "parallel/mesh.h"
#include "parallel/tensor_comm.h"

namespace t3d::parallel {

// Checks an MPI return code; throws InternalError with the call, file and line.
#define T3D_MPI(call) ::t3d::parallel::detail::check_mpi((call), #call, __FILE__, __LINE__)
namespace detail {
void check_mpi(int code, const char* call, const char* file, int line);
}

// The MPI datatype of T (the element types the collectives carry), one line per type.
template <typename T>
inline MPI_Datatype mpi_type() {
  // clang-format off
  if constexpr (std::is_same_v<T, float>) return MPI_FLOAT;
  else if constexpr (std::is_same_v<T, double>) return MPI_DOUBLE;
  else if constexpr (std::is_same_v<T, int32_t>) return MPI_INT32_T;
  else if constexpr (std::is_same_v<T, int64_t>) return MPI_INT64_T;
  else if constexpr (std::is_same_v<T, uint64_t>) return MPI_UINT64_T;
  else if constexpr (std::is_same_v<T, uint16_t>) return MPI_UINT16_T;
  else if constexpr (std::is_same_v<T, char>) return MPI_CHAR;
  else static_assert(sizeof(T) == 0, "no MPI datatype for this element type");
  // clang-format on
}

// The MPI communicator: control traffic on host memory, and the tensor transfers of TensorComm.
class Comm final : public TensorComm {
 public:
  Comm() = default;  // null communicator
  // Duplicates MPI_COMM_WORLD so titan3d's traffic never mixes with anyone else's.
  static Comm world(double timeout_s);
  ~Comm();
  Comm(Comm&&) noexcept;
  Comm& operator=(Comm&&) noexcept;
  Comm(const Comm&) = delete;
  Comm& operator=(const Comm&) = delete;

  // Collective over this communicator: ranks with equal colour form a new group named `name`.
  Comm split(int colour, int key, std::string name) const;

  int rank() const override { return rank_; }
  int size() const override { return size_; }
  const std::string& name() const { return name_; }
  MPI_Comm handle() const { return comm_; }
  // World ranks of this group's members, by group rank (for messages naming peers).
  const std::vector<int>& world_ranks() const { return world_ranks_; }
  // Host name of every world rank (runtime gathers them once, on the world communicator, before
  // the mesh splits it; split groups share the table). The watchdog then names the hosts it
  // waits on: on a multi-host job a cut link shows as the far host's name.
  void set_world_hosts(std::vector<std::string> host_of_world_rank);

  template <typename T>
  void all_reduce(T* data, size_t count, ReduceOp op = ReduceOp::sum) const {
    all_reduce_raw(data, count, mpi_type<T>(), op);
  }
  void all_reduce(float* data, size_t count, ReduceOp op = ReduceOp::sum) const override {
    all_reduce_raw(data, count, mpi_type<float>(), op);
  }
  // Group rank `root`'s text on every rank (its length first, then the bytes).
  void broadcast(std::string& text, int root) const;
  void all_reduce_bf16(uint16_t* data, size_t count) const override;
  void reduce_scatter_bf16(const uint16_t* send, uint16_t* recv, size_t count) const override;
  // send: count elements per rank; recv: count·size elements, rank-major.
  template <typename T>
  void all_gather(const T* send, T* recv, size_t count) const {
    all_gather_raw(send, recv, count, mpi_type<T>());
  }
  void all_gather(const float* send, float* recv, size_t count) const override {
    all_gather_raw(send, recv, count, mpi_type<float>());
  }
  void all_gather(const uint16_t* send, uint16_t* recv, size_t count) const override {
    all_gather_raw(send, recv, count, mpi_type<uint16_t>());
  }
  // send: count·size elements, rank-major; recv: this rank's count-element block of the sum.
  void reduce_scatter(const float* send, float* recv, size_t count) const override {
    reduce_scatter_raw(send, recv, count, mpi_type<float>());
  }
  // All-to-all of `count` elements per peer (the per-expert token counts): block p of `send`
  // (count·size elements, rank-major) goes to group rank p, and block p of `recv` comes from
  // group rank p.
  template <typename T>
  void all_to_all(const T* send, T* recv, size_t count) const {
    all_to_all_raw(send, recv, count, mpi_type<T>());
  }
  // All-to-all of rows of `row_size` elements (the tokens of expert parallelism: float, or bf16
  // bits as uint16_t on the wire). send_counts[p] rows from send + send_displs[p]·row_size go to
  // group rank p; the recv_counts[p] rows from group rank p land at recv + recv_displs[p]·row_size.
  // Counts and displacements in rows, one per group rank; zero counts are fine. The placement is
  // fixed by the displacements alone (source rank order when they ascend), so the result never
  // depends on arrival order. recv_counts[p] must equal what rank p sends here (all_to_all of
  // the counts first).
  template <typename T>
  void all_to_allv(const T* send, const std::vector<int>& send_counts,
                   const std::vector<int>& send_displs, T* recv,
                   const std::vector<int>& recv_counts, const std::vector<int>& recv_displs,
                   size_t row_size = 1) const {
    all_to_allv_raw(send, send_counts, send_displs, recv, recv_counts, recv_displs, row_size,
                    mpi_type<T>());
  }
  using Exchange = parallel::Exchange;
  // all_to_allv started in `exchange` (whose previous one must be finished): the buffers stay
  // untouched until wait() (watchdog, wait time counted as for the blocking one) on it. Overlaps
  // the rows' journey with compute.
  template <typename T>
  void start_all_to_allv(Exchange& exchange, const T* send, const std::vector<int>& send_counts,
                         const std::vector<int>& send_displs, T* recv,
                         const std::vector<int>& recv_counts, const std::vector<int>& recv_displs,
                         size_t row_size = 1) const {
    start_all_to_allv_raw(exchange, send, send_counts, send_displs, recv, recv_counts, recv_displs,
                          row_size, mpi_type<T>());
  }
  void start_all_to_allv(Exchange& exchange, const float* send, const std::vector<int>& send_counts,
                         const std::vector<int>& send_displs, float* recv,
                         const std::vector<int>& recv_counts, const std::vector<int>& recv_displs,
                         size_t row_size) const override {
    start_all_to_allv_raw(exchange, send, send_counts, send_displs, recv, recv_counts, recv_displs,
                          row_size, mpi_type<float>());
  }
  void start_all_to_allv(Exchange& exchange, const uint16_t* send,
                         const std::vector<int>& send_counts, const std::vector<int>& send_displs,
                         uint16_t* recv, const std::vector<int>& recv_counts,
                         const std::vector<int>& recv_displs, size_t row_size) const override {
    start_all_to_allv_raw(exchange, send, send_counts, send_displs, recv, recv_counts, recv_displs,
                          row_size, mpi_type<uint16_t>());
  }
  using TensorComm::wait;
  template <typename T>
  void broadcast(T* data, size_t count, int root) const {
    broadcast_raw(data, count, mpi_type<T>(), root);
  }
  template <typename T>
  void send(const T* data, size_t count, int peer, int tag) const {
    send_raw(data, count, mpi_type<T>(), peer, tag);
  }
  template <typename T>
  void recv(T* data, size_t count, int peer, int tag) const {
    recv_raw(data, count, mpi_type<T>(), peer, tag);
  }
  void recv(float* data, size_t count, int peer, int tag) const override {
    recv_raw(data, count, mpi_type<float>(), peer, tag);
  }
  void recv(uint16_t* data, size_t count, int peer, int tag) const override {
    recv_raw(data, count, mpi_type<uint16_t>(), peer, tag);
  }
  // Non-blocking send: the buffer must stay untouched until wait() on the returned request.
  template <typename T>
  Request isend(const T* data, size_t count, int peer, int tag) const {
    return isend_raw(data, count, mpi_type<T>(), peer, tag);
  }
  Request isend(const float* data, size_t count, int peer, int tag) const override {
    return isend_raw(data, count, mpi_type<float>(), peer, tag);
  }
  Request isend(const uint16_t* data, size_t count, int peer, int tag) const override {
    return isend_raw(data, count, mpi_type<uint16_t>(), peer, tag);
  }
  // Non-blocking receive of at most `count` elements (a message may be shorter): the buffer is
  // MPI's until wait() (watchdog) or test() reports the request done. Traced like recv, and,
  // like it, not counted: counters() count the bytes a rank sends.
  template <typename T>
  Request irecv(T* data, size_t count, int peer, int tag) const {
    return irecv_raw(data, count, mpi_type<T>(), peer, tag);
  }
  // The started float collectives go through the same test-only fault switch, trace span and
  // byte count as the blocking ones.
  Request iall_reduce_sum(float* data, size_t count, const char* what,
                          int64_t tag = -1) const override;
  Request ireduce_scatter_sum(float* data, const std::vector<int>& counts, const char* what,
                              int64_t tag = -1) const override;
  Request iall_gatherv(const float* mine, float* recv, const std::vector<int>& counts,
                       const std::vector<int>& displs, const char* what,
                       int64_t tag = -1) const override;
  // On expiry of the deadline: logs `what` and the peers (their hosts when known), then MPI_Abort.
  void wait(Request& request, const char* what, int peer = -1) const override;
  bool test(Request& request) const override;
  void release(Request& request) const override;
  void barrier() const;

  double timeout_s() const { return timeout_s_; }
  // The watchdog's end of a wait on `what` (with `peer`, or the whole group when -1) that passed
  // timeout_s: logs and prints which rank waited on whom (hosts when known) plus `note`, lets
  // the other stuck ranks' watchdogs report for a short grace, then MPI_Abort 3. The device
  // communicator (parallel/nccl_comm.h) ends its hung operations here too.
  [[noreturn]] void abort_hung(const char* what, int peer, const std::string& note = "") const;

  // Cumulative time this rank spent waiting on this group's operations, and bytes it sent or
  // contributed (an all-to-all counts the bytes it sent to other ranks: its block to itself does
  // not move): per-step differences give the communication share of each dimension.
  struct Counters {
    double wait_s = 0;
    uint64_t bytes = 0;
  };
  const Counters& counters() const { return counters_; }

 private:
  void all_reduce_raw(void* data, size_t count, MPI_Datatype type, ReduceOp op) const;
  void all_gather_raw(const void* send, void* recv, size_t count, MPI_Datatype type) const;
  void reduce_scatter_raw(const void* send, void* recv, size_t count, MPI_Datatype type) const;
  void all_to_all_raw(const void* send, void* recv, size_t count, MPI_Datatype type) const;
  void all_to_allv_raw(const void* send, const std::vector<int>& send_counts,
                       const std::vector<int>& send_displs, void* recv,
                       const std::vector<int>& recv_counts, const std::vector<int>& recv_displs,
                       size_t row_size, MPI_Datatype type) const;
  void start_all_to_allv_raw(Exchange& exchange, const void* send,
                             const std::vector<int>& send_counts,
                             const std::vector<int>& send_displs, void* recv,
                             const std::vector<int>& recv_counts,
                             const std::vector<int>& recv_displs, size_t row_size,
                             MPI_Datatype type) const;
  void broadcast_raw(void* data, size_t count, MPI_Datatype type, int root) const;
  void send_raw(const void* data, size_t count, MPI_Datatype type, int peer, int tag) const;
  void recv_raw(void* data, size_t count, MPI_Datatype type, int peer, int tag) const;
  Request isend_raw(const void* data, size_t count, MPI_Datatype type, int peer, int tag) const;
  Request irecv_raw(void* data, size_t count, MPI_Datatype type, int peer, int tag) const;
  void wait_mpi(MPI_Request& request, const char* what, int peer = -1) const;
  void reset() noexcept;

  MPI_Comm comm_ = MPI_COMM_NULL;
  int rank_ = -1;
  int size_ = 0;
  std::string name_;
  std::vector<int> world_ranks_;
  std::shared_ptr<const std::vector<std::string>> world_hosts_;  // by world rank; may be null
  double timeout_s_ = 300.0;
  mutable Counters counters_;
};

// This rank's view of the mesh: its coordinates and one communicator per dimension.
class Mesh {
 public:
  Mesh(const MeshShape& shape, Comm world);
  const MeshShape& shape() const { return shape_; }
  int rank() const { return world_.rank(); }
  const Coord& coord() const { return coord_; }
  const Comm& world() const { return world_; }
  const Comm& group(Dim d) const { return groups_[static_cast<int>(d)]; }
  // dp and cp flattened (torchtitan's dp_shard_cp mesh, picotron's cp_dp group): the ranks that
  // hold the same stage and tp shard. Gradients are summed over it (dp replicas see other rows,
  // cp ranks other positions of the same rows) and ZeRO shards the training state over it.
  // Rank = cp · dp_size + dp, so the dp neighbours of one cp rank are adjacent.
  const Comm& dp_cp() const { return dp_cp_; }
  // Expert parallelism folded into dp_cp (MeshShape::ep_group, docs/parallelism.md). ep(): the
  // ep consecutive dp_cp ranks that split the experts and exchange tokens by all-to-all (group
  // rank = dp_cp rank mod ep). edp(): the ranks holding the same experts, over which expert
  // gradients are reduced (group rank = dp_cp rank / ep). ep = 1: ep() is this rank alone and
  // edp() has dp_cp's members.
  const Comm& ep() const { return ep_; }
  const Comm& edp() const { return edp_; }
  std::string label() const { return shape_.label(rank()); }

 private:
  MeshShape shape_;
  Comm world_;
  Coord coord_;
  std::array<Comm, 4> groups_;
  Comm dp_cp_;
  Comm ep_;
  Comm edp_;
};

}  // namespace t3d::parallel
