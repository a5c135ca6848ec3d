// The selfcheck `device_comm` rows and the device communicators' bandwidth rows (see
// selfcheck_internal.h): on GPUs, the communicator training opens for each tensor group, chosen
// and opened by the functions training calls (runtime/stage/device_comm.h), measured on device
// memory as the MPI rows are on host memory.
#include <fmt/format.h>

#include <algorithm>
#include <cstring>
#include <memory>
#include <set>

#include "kernels/arena.h"
#include "kernels/check.h"
#include "kernels/device.h"
#include "kernels/ops.h"
#include "parallel/mesh.h"
#include "parallel/schedule.h"
#include "runtime/selfcheck/selfcheck_internal.h"
#include "runtime/stage/stage.h"

namespace t3d::runtime::selfcheck {

PathSummary summarize_paths(const std::vector<DeviceCommPath>& paths) {
  std::set<std::string> names;  // "nccl" sorts before "staged"
  std::vector<std::string> details;
  for (const auto& p : paths) {
    if (p.detail.empty()) continue;
    names.insert(path_name(p));
    if (std::find(details.begin(), details.end(), p.detail) == details.end())
      details.push_back(p.detail);
  }
  return {fmt::format("{}", fmt::join(names, "+")), fmt::format("{}", fmt::join(details, "; "))};
}

namespace {

// Every rank's path over the world, in fixed-size records (one all-gather).
std::vector<DeviceCommPath> gather_paths(const parallel::Comm& world, const DeviceCommPath& mine) {
  constexpr size_t kDetail = 255;
  std::vector<char> rec(kDetail + 1, '\0');
  rec[0] = mine.nccl ? 1 : 0;
  std::strncpy(rec.data() + 1, mine.detail.c_str(), kDetail - 1);
  std::vector<char> all(rec.size() * static_cast<size_t>(world.size()));
  world.all_gather(rec.data(), all.data(), rec.size());
  std::vector<DeviceCommPath> paths(static_cast<size_t>(world.size()));
  for (size_t r = 0; r < paths.size(); ++r) {
    const char* p = all.data() + r * rec.size();
    paths[r].nccl = p[0] != 0;
    paths[r].detail.assign(p + 1, strnlen(p + 1, kDetail - 1));
  }
  return paths;
}

// The device of every rank, or null where any rank computes on its CPU (or could not open its
// device: check_device's row says so). Collective over the world.
std::unique_ptr<kernels::Device> gpu_everywhere(const Job& job) {
  std::unique_ptr<kernels::Device> device;
  try {
    device = kernels::Device::open(job.recipe.hardware.device, job.env.local_rank);
  } catch (const std::exception&) {
    device.reset();
  }
  int gpu = device && device->on_gpu() ? 1 : 0;
  job.mesh->world().all_reduce(&gpu, 1, parallel::ReduceOp::min);
  if (!gpu) device.reset();
  return device;
}

// The bandwidth rows of one opened communicator, on a device buffer of the largest size: scope
// "<path> <size>".
void measure(const Job& job, const std::string& group, const std::string& path,
             const parallel::TensorComm& comm, const kernels::Device& device, bool quick,
             std::vector<CheckRow>& rows) {
  const auto& world = job.mesh->world();
  const kernels::Exec exec = device.exec(kernels::GemmKind::kOpenBlasF32);  // copies only
  const std::vector<size_t> sizes = bandwidth_sizes(quick);
  kernels::Buffer buf;
  Verdict made;
  try {
    buf.reserve(exec, sizes.back(), "selfcheck bandwidth");
    const std::vector<char> zeros(sizes.back(), 0);  // zeros stay zeros: no overflow
    kernels::copy_from_host(exec, buf.as<void>(), zeros.data(), zeros.size());
  } catch (const std::exception& e) {
    made.fail(fmt::format("{} of device memory: {}", bytes_label(sizes.back()), e.what()),
              world.rank());
  }
  const CheckRow row = agree_row(world, "bandwidth", group, path, made, "");
  if (row.status == CheckStatus::failed) {
    rows.push_back(row);
    return;
  }
  for (size_t bytes : sizes) {
    const double seconds = time_all_reduce(comm, world, exec, buf.as<float>(),
                                           bytes / sizeof(float), bandwidth_iters(quick, bytes));
    rows.push_back(bandwidth_row(group, bytes, seconds, comm.size(), "device memory"));
    rows.back().scope = path + " " + rows.back().scope;  // "nccl 1 MiB"
  }
}

}  // namespace

void device_comm_rows(const Job& job, bool quick, std::vector<CheckRow>& rows) {
  const auto device = gpu_everywhere(job);
  if (!device) return;  // the CPU: the MPI rows are the tensor collectives' own
  tensor_group_rows(job, *device, quick, rows);
}

void tensor_group_rows(const Job& job, const kernels::Device& device, bool quick,
                       std::vector<CheckRow>& rows) {
  const auto& mesh = *job.mesh;
  const auto& world = mesh.world();
  const Recipe& r = job.recipe;
  const int pp = static_cast<int>(mesh.shape().size(parallel::Dim::pp));
  std::vector<CheckRow> measured;  // after the device_comm rows, one block in the table
  // Every rank decides every group in training's order: each decision gathers over its group.
  for (const TensorGroup& g : tensor_groups(mesh)) {
    DeviceCommPath path;
    Verdict chose;
    try {
      const bool in_order = parallel::receives_in_send_order(stage_schedule(r, pp));
      path = choose_group_comm(r.parallel.device_comm, g, device, in_order);
    } catch (const std::exception& e) {
      chose.fail(e.what());
    }
    const PathSummary s = summarize_paths(gather_paths(world, path));
    const std::string scope = s.name.empty() ? "refused" : s.name;  // no rank could choose
    CheckRow row = agree_row(world, "device_comm", g.name, scope, chose, s.detail);
    if (row.status == CheckStatus::failed) {
      rows.push_back(std::move(row));
      continue;
    }
    // Opening is collective over the group (NCCL's bootstrap); a rank that fails is named.
    std::unique_ptr<parallel::TensorComm> comm;
    Verdict opened;
    try {
      comm = open_device_comm(path, g.name, *g.comm, device);
    } catch (const std::exception& e) {
      opened.fail(fmt::format("opening the {} communicator: {}", path_name(path), e.what()),
                  world.rank());
    }
    const CheckRow open_row = agree_row(world, "device_comm", g.name, scope, opened, s.detail);
    rows.push_back(open_row);
    if (open_row.status == CheckStatus::failed || g.comm->size() < 2) continue;
    measure(job, g.name, scope, *comm, device, quick, measured);
  }
  rows.insert(rows.end(), measured.begin(), measured.end());
}

}  // namespace t3d::runtime::selfcheck
