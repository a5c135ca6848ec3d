#include "kernels/device.h"

#include <vector>

#include "kernels/check.h"
#include "kernels/cuda/cuda_ops.h"

namespace t3d::kernels {

#ifndef T3D_HAVE_CUDA
// Without the CUDA backend no Stream is ever made (open refuses "cuda"), but Device's unique_ptr
// still names its destructor: an empty Impl gives it one.
struct cuda::Stream::Impl {};
cuda::Stream::~Stream() = default;
#endif

Device::~Device() = default;

std::unique_ptr<Device> Device::open(DeviceChoice choice, int local_rank, const std::string& key) {
  std::unique_ptr<Device> d(new Device);
  if (choice == DeviceChoice::kCpu) return d;
#ifdef T3D_HAVE_CUDA
  std::string why;
  const std::vector<cuda::DeviceInfo> gpus = cuda::visible_devices(&why);
  if (gpus.empty()) {
    T3D_USER_CHECK(choice == DeviceChoice::kAuto, key, " = \"cuda\", but this rank sees no GPU (",
                   why, "): set ", key, " = \"cpu\" or \"auto\", or run where a GPU is visible");
    return d;
  }
  const int index = cuda::device_for_local_rank(local_rank, static_cast<int>(gpus.size()));
  d->stream_ = std::make_unique<cuda::Stream>(index);
  d->description_ = "cuda:" + std::to_string(index) + " " + cuda::describe(gpus[index]);
#else
  T3D_USER_CHECK(choice == DeviceChoice::kAuto, key,
                 " = \"cuda\", but this titan3d was built without the CUDA backend (no CUDA "
                 "toolkit at configure time, or T3D_CUDA=OFF): rebuild where one is, or set ",
                 key, " = \"cpu\"");
  (void)local_rank;
#endif
  return d;
}

Exec Device::exec(GemmKind kind) const {
  if (stream_) return Exec(kind, *stream_);
  return Exec(kind);
}

}  // namespace t3d::kernels
