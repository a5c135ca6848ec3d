// Which path a GPU stage's tensor collectives take, per group (parallel.device_comm,
// docs/gpu.md): NCCL between GPUs (parallel/nccl_comm.h) or staged through host memory over MPI
// (parallel/staged_comm.h). NCCL refuses two ranks of one communicator on one GPU, so a group
// whose ranks share a GPU is staged (auto) or refused (nccl).
#pragma once

#include <array>
#include <memory>
#include <string>
#include <vector>

#include "kernels/device.h"
#include "parallel/comm.h"
#include "parallel/mesh.h"
#include "parallel/nccl_library.h"
#include "parallel/tensor_comm.h"
#include "runtime/recipe/recipe.h"

namespace t3d::runtime {

// Where one rank of a group computes: its host and its GPU's PCI bus id (empty: the CPU), and
// whether NCCL loaded there. `machine` tells apart hosts of one name (containers of several
// machines often share one): the kernel's boot id, the same for every container of one machine.
// `nccl_version`: the loaded NCCL's version code (0: not known); one communicator needs one NCCL
// version on every rank (its wire protocol changes between releases).
struct RankDevice {
  std::string host;
  std::string gpu;
  bool nccl_loaded = false;
  std::string machine;
  int nccl_version = 0;
};

struct DeviceCommPath {
  bool nccl = false;
  std::string detail;  // what the log says after "tensor collectives of <group>: "
};

// The decision, a pure function of the group's devices (by group rank), what NCCL's loader
// found on this rank (`nccl`: its version and, if it failed, where it looked), the key, and
// whether the group's point-to-point messages are taken in the order they are sent (NCCL has no
// tags: false for the pp group under ZB-V, parallel::receives_in_send_order). auto: NCCL when
// every rank has a GPU of its own, the messages keep their order and NCCL loaded (one version on
// every rank), else staged
// with the reason (a group of one rank included: it moves nothing between ranks); staged: staged;
// nccl: NCCL, or a UserError naming the key, the group and why (a rank on the CPU, two ranks and
// the GPU they share, messages out of send order, where NCCL was looked for, or two ranks'
// versions).
DeviceCommPath choose_device_comm(DeviceComm key, const std::string& group,
                                  const std::vector<RankDevice>& ranks,
                                  const parallel::NcclLibrary& nccl, bool in_send_order = true);

// "nccl" or "staged": the path's name in selfcheck's rows (docs/selfcheck.md).
const char* path_name(const DeviceCommPath& path);

// The groups a GPU stage opens a device communicator for (StageGroups, runtime/stage/stage.h),
// in the order every rank decides them; `pipeline` marks the one whose point to point needs its
// messages in send order for NCCL. selfcheck measures the same groups.
struct TensorGroup {
  const char* name;  // "tp", "pp", "cp", "dp × cp", "edp", "ep"
  const parallel::Comm* comm;
  bool pipeline = false;
};
std::array<TensorGroup, 6> tensor_groups(const parallel::Mesh& mesh);

// The path training takes for `g`: choose_device_comm over the group's gathered devices and this
// rank's NCCL loader (collective over the group; throws choose_device_comm's UserError).
DeviceCommPath choose_group_comm(DeviceComm key, const TensorGroup& g,
                                 const kernels::Device& device, bool pp_in_send_order);

// Every rank's RankDevice over `group` (collective; control traffic on its MPI communicator).
std::vector<RankDevice> gather_devices(const parallel::Comm& group, const kernels::Device& device);

// The communicator of a chosen path over `group` (collective over it when NCCL: its bootstrap),
// logged as "tensor collectives of <label>: <path.detail>": NCCL or a StagedComm over `group`.
std::unique_ptr<parallel::TensorComm> open_device_comm(const DeviceCommPath& path,
                                                       const char* label,
                                                       const parallel::Comm& group,
                                                       const kernels::Device& device);

}  // namespace t3d::runtime
