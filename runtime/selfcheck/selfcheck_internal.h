// Shared by the selfcheck sources: a rank's verdict and the agreed row it becomes, the groups
// checked, and the checks each file adds.
#pragma once

#include <fmt/format.h>

#include <functional>
#include <string>
#include <vector>

#include "kernels/device.h"
#include "kernels/exec.h"
#include "parallel/comm.h"
#include "parallel/tensor_comm.h"
#include "runtime/selfcheck/selfcheck.h"
#include "runtime/stage/device_comm.h"

namespace t3d::runtime::selfcheck {

// One rank's finding. `blame` is the world rank at fault when this rank can tell (-1: itself or
// nobody in particular); `what` says what was wrong.
struct Verdict {
  bool ok = true;
  int blame = -1;
  std::string what;
  void fail(std::string why, int culprit = -1) {
    if (!ok) return;  // the first finding is the one reported
    ok = false, what = std::move(why), blame = culprit;
  }
};

// Gathers every rank's verdict over `world` into one row: OK with `ok_detail`, or FAILED (or
// `on_failure`) with the distinct findings and the ranks to blame. Collective.
CheckRow agree_row(const parallel::Comm& world, std::string check, std::string group,
                   std::string scope, const Verdict& mine, const std::string& ok_detail,
                   CheckStatus on_failure = CheckStatus::failed);

// A group of the mesh as this rank sees it.
struct Group {
  const parallel::Comm* comm;
  std::string name;
  std::vector<int> members;  // world ranks, by group rank
  int count = 1;             // groups of this kind in the world
  // Members of any world rank's group of this kind (MeshShape); null for the world.
  std::function<std::vector<int>(int)> members_of;
  std::string scope() const {
    return fmt::format("{} group{} × {}", count, count > 1 ? "s" : "", members.size());
  }
  int me() const { return members.at(comm->rank()); }
};

// A receive that gives up after `seconds` (cancelled) instead of leaving it to the watchdog, so a
// silent peer becomes a FAILED row naming it rather than an aborted job.
bool recv_before(const parallel::Comm& c, float* data, size_t count, int peer, int tag,
                 double seconds);

// Expert parallelism (selfcheck_ep.cpp): the dispatch's all-to-all over `ep_group` and every pair
// of each EP group (content, then time), rows appended to `rows`. Collective over the world.
void ep_rows(const Job& job, const Group& ep_group, bool quick, double seconds,
             std::vector<CheckRow>& rows);

// The model-level checks (selfcheck_model.cpp): rows appended to `rows`.
void check_replicas(const Job& job, std::vector<CheckRow>& rows);
void check_gemm(const Job& job, bool quick, std::vector<CheckRow>& rows);
// selfcheck_device.cpp: each rank's device (hardware.device), and on GPUs their cuBLAS GEMM and
// pinned copy rates against their datasheets; a GPU slower than its peers by check_gemm's rule
// is a WARN naming its rank, one that cannot open or measure a FAILED row naming it.
void check_device(const Job& job, bool quick, std::vector<CheckRow>& rows);
void check_memory(const Job& job, std::vector<CheckRow>& rows);
// A mixture of experts whose run directory holds a metrics.jsonl (a run trained or under way):
// WARN for each MoE layer the idle-expert rule (runtime/model/expert_idle.h) flags at its last
// step. No row without such a file.
void check_idle_experts(const Job& job, std::vector<CheckRow>& rows);
void host_map(const Job& job, std::vector<CheckRow>& rows);

std::string bytes_label(double bytes);  // "64 MiB"

// The all-reduce bandwidth rows (docs/selfcheck.md), one way for the MPI communicators on host
// memory and the device communicators training uses on a GPU: the message sizes and iterations,
// nccl-tests' bus bandwidth factor 2(n-1)/n of an all-reduce over n ranks, the seconds of one
// all-reduce of `count` floats at `data` (memory of `exec`) over `comm` after a warm-up, the
// device's stream finished, the slowest rank's over the world (collective over the world), and
// its row: check "bandwidth", the message size as its scope, `where` ending the detail.
std::vector<size_t> bandwidth_sizes(bool quick);
int bandwidth_iters(bool quick, size_t bytes);
double all_reduce_bus_factor(int n);
double time_all_reduce(const parallel::TensorComm& comm, const parallel::Comm& world,
                       const kernels::Exec& exec, float* data, size_t count, int iters);
CheckRow bandwidth_row(const std::string& group, size_t bytes, double seconds, int n,
                       const std::string& where);

// selfcheck_device_comm.cpp: where every rank computes on a GPU, per tensor group of training
// (runtime/stage/device_comm.h's tensor_groups) a `device_comm` row naming the path training
// chooses for it ("nccl", "staged" or, where the groups of a kind differ, "nccl+staged") and why,
// FAILED naming the group and the reason where it cannot be chosen or opened, then its bandwidth
// rows on device memory, scope "<path> <size>". No row on the CPU. Collective over the world.
void device_comm_rows(const Job& job, bool quick, std::vector<CheckRow>& rows);
// Its rows for every tensor group, on `device` whatever it is (device_comm_rows on GPUs; tests on
// the CPU, where a StagedComm over host memory is what training's open_device_comm opens).
void tensor_group_rows(const Job& job, const kernels::Device& device, bool quick,
                       std::vector<CheckRow>& rows);
// The row's scope and detail for every rank's path of one group kind (world rank order; a path
// with an empty detail, a rank that could not choose, is left out): the distinct path names
// joined by "+", and the distinct details joined by "; ".
struct PathSummary {
  std::string name, detail;
};
PathSummary summarize_paths(const std::vector<DeviceCommPath>& paths);

// A per-rank rate against its peers: the median and the deviation around it, and Megatron's
// gpu_sniff_test rule for a slow one (more than 10% and more than one deviation below the median).
struct Spread {
  double median = 0, sd = 0;
  bool slow(double x) const { return x < 0.9 * median && median - x > sd; }
};
Spread spread_of(const std::vector<double>& all);  // all: one value per rank, not empty

}  // namespace t3d::runtime::selfcheck
