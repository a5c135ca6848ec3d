#include "runtime/stage/device_comm.h"

#include <spdlog/spdlog.h>
#include <unistd.h>

#include <cstring>
#include <fstream>
#include <map>
#include <string>
#include <tuple>
#include <utility>

#include "kernels/check.h"
#include "kernels/cuda_native.h"
#include "parallel/staged_comm.h"
#ifdef T3D_HAVE_NCCL
#include "parallel/nccl_comm.h"
#endif

namespace t3d::runtime {

namespace {

// Why NCCL cannot serve the group, or "" when it can.
std::string why_not_nccl(const std::vector<RankDevice>& ranks, const parallel::NcclLibrary& nccl,
                         bool in_send_order) {
  for (size_t r = 0; r < ranks.size(); ++r)
    if (ranks[r].gpu.empty())
      return "rank " + std::to_string(r) + " computes on the CPU (hardware.device)";
  // (host, machine, GPU) -> its first rank
  std::map<std::tuple<std::string, std::string, std::string>, size_t> first;
  for (size_t r = 0; r < ranks.size(); ++r) {
    const auto [it, fresh] =
        first.emplace(std::make_tuple(ranks[r].host, ranks[r].machine, ranks[r].gpu), r);
    if (!fresh)
      return "ranks " + std::to_string(it->second) + " and " + std::to_string(r) + " share GPU " +
             ranks[r].gpu + " on " + ranks[r].host + ", which NCCL refuses";
  }
  if (!in_send_order)
    return "its stages take messages out of send order (parallel.schedule = \"zb_v\"), which "
           "NCCL's untagged point to point cannot match";
  if (!nccl.loaded) return "NCCL not loaded: " + nccl.why_not;
  for (size_t r = 0; r < ranks.size(); ++r)
    if (!ranks[r].nccl_loaded)
      return "NCCL not loaded on rank " + std::to_string(r) + " (its log says where it looked)";
  for (size_t r = 1; r < ranks.size(); ++r)
    if (ranks[r].nccl_version != ranks[0].nccl_version)
      return "ranks 0 and " + std::to_string(r) + " load NCCL " +
             parallel::nccl_version_name(ranks[0].nccl_version) + " and " +
             parallel::nccl_version_name(ranks[r].nccl_version) +
             ", and one communicator needs one NCCL version";
  return "";
}

}  // namespace

DeviceCommPath choose_device_comm(DeviceComm key, const std::string& group,
                                  const std::vector<RankDevice>& ranks,
                                  const parallel::NcclLibrary& nccl, bool in_send_order) {
  if (key == DeviceComm::kStaged)
    return {false, "staged through host memory (parallel.device_comm = \"staged\")"};
  const std::string why = why_not_nccl(ranks, nccl, in_send_order);
  T3D_USER_CHECK(key != DeviceComm::kNccl || why.empty(),
                 "parallel.device_comm = \"nccl\", but the tensor collectives of ", group,
                 " cannot use NCCL: ", why,
                 ". Give each rank a GPU of its own (as many ranks per host as GPUs), point "
                 "T3D_NCCL_LIBRARY at one libnccl.so.2 of one version on every host, or set "
                 "parallel.device_comm = \"auto\"");
  if (!why.empty()) return {false, "staged through host memory (" + why + ")"};
  // A group of one rank moves nothing between ranks: auto spares it NCCL's start-up.
  if (key == DeviceComm::kAuto && ranks.size() == 1)
    return {false, "staged through host memory (one rank: NCCL would only add its start-up)"};
  return {true, "NCCL " + nccl.version_name() + " (" + std::to_string(ranks.size()) +
                    (ranks.size() == 1 ? " rank, its own GPU)" : " ranks, one GPU each)")};
}

const char* path_name(const DeviceCommPath& path) { return path.nccl ? "nccl" : "staged"; }

std::array<TensorGroup, 6> tensor_groups(const parallel::Mesh& mesh) {
  using parallel::Dim;
  return {{
      {"tp", &mesh.group(Dim::tp)},
      {"pp", &mesh.group(Dim::pp), true},
      {"cp", &mesh.group(Dim::cp)},
      {"dp × cp", &mesh.dp_cp()},
      {"edp", &mesh.edp()},
      {"ep", &mesh.ep()},
  }};
}

DeviceCommPath choose_group_comm(DeviceComm key, const TensorGroup& g,
                                 const kernels::Device& device, bool pp_in_send_order) {
  return choose_device_comm(key, g.name, gather_devices(*g.comm, device), parallel::nccl_library(),
                            !g.pipeline || pp_in_send_order);
}

std::vector<RankDevice> gather_devices(const parallel::Comm& group, const kernels::Device& device) {
  // Fixed-width records: the host name, the bus id and the boot id, each NUL-padded, then
  // NCCL's load and its version code (4 bytes).
  constexpr size_t kField = 256;
  std::vector<char> mine(3 * kField + 1 + sizeof(int), '\0');
  gethostname(mine.data(), kField - 1);
  std::ifstream boot("/proc/sys/kernel/random/boot_id");
  std::string boot_id;
  std::getline(boot, boot_id);  // empty where there is none: the host name alone decides
  std::strncpy(mine.data() + 2 * kField, boot_id.c_str(), kField - 1);
  std::string gpu;  // empty on the CPU
#ifdef T3D_HAVE_CUDA
  if (device.on_gpu())
    gpu = kernels::cuda::pci_bus_id(*device.exec(kernels::GemmKind::kOpenBlasF32).stream);
#endif
  std::strncpy(mine.data() + kField, gpu.c_str(), kField - 1);
  const parallel::NcclLibrary& nccl = parallel::nccl_library();
  mine[3 * kField] = nccl.loaded ? 1 : 0;
  const int version = nccl.loaded ? nccl.version : 0;
  std::memcpy(mine.data() + 3 * kField + 1, &version, sizeof version);
  std::vector<char> all(mine.size() * static_cast<size_t>(group.size()));
  group.all_gather(mine.data(), all.data(), mine.size());
  std::vector<RankDevice> ranks(static_cast<size_t>(group.size()));
  for (size_t r = 0; r < ranks.size(); ++r) {
    const char* rec = all.data() + r * mine.size();
    ranks[r].host.assign(rec, strnlen(rec, kField));
    ranks[r].gpu.assign(rec + kField, strnlen(rec + kField, kField));
    ranks[r].machine.assign(rec + 2 * kField, strnlen(rec + 2 * kField, kField));
    ranks[r].nccl_loaded = rec[3 * kField] != 0;
    std::memcpy(&ranks[r].nccl_version, rec + 3 * kField + 1, sizeof(int));
  }
  return ranks;
}

std::unique_ptr<parallel::TensorComm> open_device_comm(const DeviceCommPath& path,
                                                       const char* label,
                                                       const parallel::Comm& group,
                                                       const kernels::Device& device) {
  const kernels::Exec exec = device.exec(kernels::GemmKind::kOpenBlasF32);  // copies only
  spdlog::info("tensor collectives of {}: {}", label, path.detail);
#ifdef T3D_HAVE_NCCL
  if (path.nccl) return std::make_unique<parallel::NcclComm>(group, exec);
#endif
  T3D_ASSERT(!path.nccl, "NCCL chosen in a build without it");
  return std::make_unique<parallel::StagedComm>(group, exec);
}

}  // namespace t3d::runtime
