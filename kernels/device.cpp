#include "kernels/device.h"

#include <vector>

#include "kernels/check.h"
#include "kernels/cuda/cuda_ops.h"

namespace t3d::kernels {

namespace {

// The GPU a rank of `local_rank` takes (index -1: none, `why` says why) and its description.
struct GpuPick {
  int index = -1, visible = 0;
  std::string description, why;
  const GpuSpec* spec = nullptr;
};

GpuPick pick_gpu(int local_rank) {
  GpuPick p;
#ifdef T3D_HAVE_CUDA
  std::vector<cuda::DeviceInfo> gpus = cuda::visible_devices(&p.why);
  if (gpus.empty()) return p;
  p.index = cuda::device_for_local_rank(local_rank, static_cast<int>(gpus.size()));
  cuda::DeviceInfo& gpu = gpus[static_cast<size_t>(p.index)];
  gpu.free_bytes = cuda::free_bytes_on(p.index);
  p.description = "cuda:" + std::to_string(p.index) + " " + cuda::describe(gpu);
  p.spec = gpu_spec_of_device(gpu.name, static_cast<double>(gpu.total_bytes) / (1 << 30));
  p.visible = static_cast<int>(gpus.size());
#else
  (void)local_rank;
  p.why = "built without the CUDA backend";
#endif
  return p;
}

}  // namespace

PinnedHostRegion::PinnedHostRegion(const Exec& exec, void* data, std::size_t bytes) {
  if (!exec.on_gpu() || bytes == 0) return;
#ifdef T3D_HAVE_CUDA
  cuda::host_register(data, bytes);
  data_ = data;
#endif
}

PinnedHostRegion::~PinnedHostRegion() {
#ifdef T3D_HAVE_CUDA
  if (data_) cuda::host_unregister(data_);
#endif
}

#ifndef T3D_HAVE_CUDA
// Built without the CUDA backend no Stream is ever made, but Device's unique_ptr names its
// destructor: an empty one, so that such a build links.
struct cuda::Stream::Impl {};
cuda::Stream::~Stream() = default;
#endif

Device::~Device() = default;

std::string Device::describe(DeviceChoice choice, int local_rank) {
  if (choice == DeviceChoice::kCpu) return "cpu";
  const GpuPick p = pick_gpu(local_rank);
  if (p.index >= 0) return p.description;
  return choice == DeviceChoice::kAuto ? "cpu" : "cuda (none: " + p.why + ")";
}

std::unique_ptr<Device> Device::open(DeviceChoice choice, int local_rank, const std::string& key) {
  std::unique_ptr<Device> d(new Device);
  if (choice == DeviceChoice::kCpu) return d;
  const GpuPick p = pick_gpu(local_rank);
  if (p.index < 0) {
#ifdef T3D_HAVE_CUDA
    T3D_USER_CHECK(choice == DeviceChoice::kAuto, key, " = \"cuda\", but this rank sees no GPU (",
                   p.why, "): set ", key, " = \"cpu\" or \"auto\", or run where a GPU is visible");
#else
    T3D_USER_CHECK(choice == DeviceChoice::kAuto, key,
                   " = \"cuda\", but this titan3d was built without the CUDA backend (no CUDA "
                   "toolkit at configure time, or T3D_CUDA=OFF): rebuild where one is, or set ",
                   key, " = \"cpu\"");
#endif
    return d;
  }
#ifdef T3D_HAVE_CUDA
  d->stream_ = std::make_unique<cuda::Stream>(p.index);
  d->description_ = p.description;
  d->spec_ = p.spec;
  d->visible_gpus_ = p.visible;
#endif
  return d;
}

Device::Rates Device::measure_rates(std::int64_t M, std::int64_t N, std::int64_t K,
                                    std::size_t bytes, int rounds) const {
  T3D_ASSERT(on_gpu(), "Device::measure_rates on the CPU");
  Rates r;
#ifdef T3D_HAVE_CUDA
  r = cuda::measure_rates(*stream_, M, N, K, bytes, rounds);
#else
  (void)M, (void)N, (void)K, (void)bytes, (void)rounds;
#endif
  return r;
}

std::string Device::gemm_table() const {
#ifdef T3D_HAVE_CUDA
  if (stream_) return cuda::gemm_table_text(cuda::gemm_table(*stream_));
#endif
  return {};
}

std::string Device::gemm_library() const {
#ifdef T3D_HAVE_CUDA
  if (stream_) return cuda::gemm_library(*stream_);
#endif
  return {};
}

std::string Device::use_gemm_table(const std::string& text) const {
  T3D_ASSERT(on_gpu(), "Device::use_gemm_table on the CPU");
#ifdef T3D_HAVE_CUDA
  std::string why;
  const std::optional<cuda::GemmTable> table = cuda::parse_gemm_table(text, &why);
  if (!table) return why;
  return cuda::use_gemm_table(*stream_, *table);
#else
  return text;
#endif
}

std::string Device::tune_linear_gemms(const std::vector<LinearSize>& layers, GemmKind kind) const {
  T3D_ASSERT(on_gpu(), "Device::tune_linear_gemms on the CPU");
#ifdef T3D_HAVE_CUDA
  std::vector<cuda::GemmShape> shapes;
  const auto precision =
      gemm_kind_is_bf16(kind) ? cuda::GemmPrecision::kBf16 : cuda::GemmPrecision::kFp32;
  for (const LinearSize& l : layers)
    for (const cuda::GemmShape& s : cuda::linear_gemm_shapes(precision, l.rows, l.in, l.out))
      shapes.push_back(s);
  return cuda::gemm_table_text(cuda::tune_gemms(*stream_, shapes));
#else
  (void)layers, (void)kind;
  return {};
#endif
}

void Device::set_op_timing(bool on) const {
#ifdef T3D_HAVE_CUDA
  if (stream_) cuda::set_op_timing(on);
#else
  (void)on;
#endif
}

std::map<std::string, double> Device::take_op_seconds() const {
#ifdef T3D_HAVE_CUDA
  if (stream_) return cuda::take_op_seconds(*stream_);
#endif
  return {};
}

Exec Device::exec(GemmKind kind) const {
  if (stream_) return Exec(kind, *stream_);
  return Exec(kind);
}

}  // namespace t3d::kernels
