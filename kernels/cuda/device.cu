// Devices, streams, device memory and the host <-> device copies of the CUDA backend.
#include <algorithm>
#include <cstdio>
#include <cstring>
#include <utility>

#include "kernels/arena.h"
#include "kernels/cuda/cuda_internal.cuh"
#include "kernels/cuda_native.h"
#include "kernels/ops.h"  // kUnwaitedUploadBytes

namespace t3d::kernels::cuda {
namespace {

std::string cuda_version(int v) {
  return std::to_string(v / 1000) + "." + std::to_string(v % 1000 / 10);
}

}  // namespace

std::vector<DeviceInfo> visible_devices(std::string* why) {
  std::vector<DeviceInfo> out;
  int driver = 0, runtime = 0;
  cudaRuntimeGetVersion(&runtime);
  if (cudaDriverGetVersion(&driver) != cudaSuccess || driver == 0) {
    if (why) *why = "no NVIDIA driver is loaded (libcuda not found)";
    return out;
  }
  int count = 0;
  const cudaError_t err = cudaGetDeviceCount(&count);
  if (err != cudaSuccess || count == 0) {
    if (why) {
      *why = err == cudaSuccess ? "the driver sees no GPU" : cudaGetErrorString(err);
      if (driver < runtime)
        *why += " (driver supports CUDA " + cuda_version(driver) + ", titan3d was built with " +
                cuda_version(runtime) + ")";
    }
    cudaGetLastError();  // clear the error so later calls start clean
    return out;
  }
  for (int i = 0; i < count; ++i) {
    cudaDeviceProp p{};
    T3D_CUDA_CHECK(cudaGetDeviceProperties(&p, i));
    DeviceInfo d;
    d.index = i;
    d.name = p.name;
    d.cc_major = p.major;
    d.cc_minor = p.minor;
    d.sm_count = p.multiProcessorCount;
    d.driver_version = driver;
    d.runtime_version = runtime;
    d.total_bytes = p.totalGlobalMem;  // from the properties: no context is made (free_bytes_on)
    out.push_back(std::move(d));
  }
  return out;
}

std::size_t free_bytes_on(int index) {
  // cudaSetDevice makes the device's primary context (CUDA 12 and later), and cudaMemGetInfo
  // needs one: only on the device this thread goes on to use, never switched back.
  T3D_CUDA_CHECK(cudaSetDevice(index));
  std::size_t free = 0, total = 0;
  T3D_CUDA_CHECK(cudaMemGetInfo(&free, &total));
  return free;
}

std::string describe(const DeviceInfo& d) {
  char mem[64];
  if (d.free_bytes > 0)
    std::snprintf(mem, sizeof mem, "%.1f GiB (%.1f free)", d.total_bytes / double(1u << 30),
                  d.free_bytes / double(1u << 30));
  else
    std::snprintf(mem, sizeof mem, "%.1f GiB", d.total_bytes / double(1u << 30));
  return d.name + ", " + mem + ", sm_" + std::to_string(d.cc_major) + std::to_string(d.cc_minor) +
         ", " + std::to_string(d.sm_count) + " SMs, driver CUDA " + cuda_version(d.driver_version) +
         ", runtime " + cuda_version(d.runtime_version);
}

int device_for_local_rank(int local_rank, int visible_count) {
  T3D_USER_CHECK(visible_count > 0, "no GPU is visible to this rank");
  T3D_ASSERT(local_rank >= 0, "negative local rank ", local_rank);
  return local_rank % visible_count;
}

namespace {

__global__ void arch_probe_kernel() {}

// A GPU this build has no code for (an A100 under the default CMAKE_CUDA_ARCHITECTURES=90) is
// refused here, naming both, rather than failing its first op with "no kernel image".
void check_built_for(int device) {
  cudaFuncAttributes attrs{};
  const cudaError_t probe = cudaFuncGetAttributes(&attrs, arch_probe_kernel);
  if (probe == cudaSuccess) return;
  (void)cudaGetLastError();  // not sticky; any other answer is left to the first op to report
  if (probe != cudaErrorNoKernelImageForDevice && probe != cudaErrorInvalidDeviceFunction) return;
  cudaDeviceProp prop{};
  T3D_CUDA_CHECK(cudaGetDeviceProperties(&prop, device));
  std::string built = T3D_CUDA_ARCHITECTURES;  // "80,90" (CMake's list, commas for semicolons)
  std::replace(built.begin(), built.end(), ',', ';');
  throw ::t3d::UserError(::t3d::detail::concat(
      "GPU ", device, " (", prop.name, ", sm_", prop.major, prop.minor,
      ") has no code in this titan3d, whose GPU code is built for CUDA architectures ", built,
      ": rebuild with -DCMAKE_CUDA_ARCHITECTURES=\"", prop.major, prop.minor, ";", built,
      "\" (docs/gpu.md), or set hardware.device = \"cpu\""));
}

}  // namespace

Stream::Stream(int device) : impl_(std::make_unique<Impl>()) {
  impl_->device = device;
  T3D_CUDA_CHECK(cudaSetDevice(device));
  check_built_for(device);
  // Buffers made mid-step are allocated and freed in their stream's order (stream_alloc: no
  // device-wide wait, which could wait on NCCL operations in flight), and that needs the
  // device's memory pools. Asked first, before anything is made.
  int pools = 0;
  T3D_CUDA_CHECK(cudaDeviceGetAttribute(&pools, cudaDevAttrMemoryPoolsSupported, device));
  T3D_USER_CHECK(pools != 0, "GPU ", device,
                 " has no stream-ordered memory pools (cudaDevAttrMemoryPoolsSupported = 0, as "
                 "under some virtual GPUs), which titan3d's device buffers need: run on a GPU and "
                 "driver that support them (CUDA 11.2 and later, not every vGPU profile), or set "
                 "hardware.device = \"cpu\"");
  int smem = 0;
  T3D_CUDA_CHECK(cudaDeviceGetAttribute(&smem, cudaDevAttrMaxSharedMemoryPerBlockOptin, device));
  impl_->smem_per_block = static_cast<std::size_t>(smem);
  T3D_CUDA_CHECK(cudaStreamCreateWithFlags(&impl_->stream, cudaStreamNonBlocking));
  T3D_CUDA_CHECK(cudaStreamCreateWithFlags(&impl_->copy_stream, cudaStreamNonBlocking));
  T3D_CUDA_CHECK(cudaEventCreateWithFlags(&impl_->compute_mark, cudaEventDisableTiming));
  T3D_CUDA_CHECK(cudaEventCreateWithFlags(&impl_->copies_mark, cudaEventDisableTiming));
  T3D_CUBLAS_CHECK(cublasLtCreate(&impl_->lt));
  T3D_CUDA_CHECK(cudaMalloc(&impl_->blas_workspace, kBlasWorkspaceBytes));
  cudaDeviceProp prop{};
  T3D_CUDA_CHECK(cudaGetDeviceProperties(&prop, device));
  impl_->gemm_table.library = ::t3d::detail::concat(
      "cuBLASLt ", cublasLtGetVersion(), " on ", prop.name, " (sm_", prop.major, prop.minor, ")");
  T3D_CUDA_CHECK(cudaMalloc(&impl_->scalar_sum, sizeof(double)));
  T3D_CUDA_CHECK(cudaMalloc(&impl_->scalar_count, sizeof(unsigned long long)));
  // The small uploads' staging ring, made here rather than at the first upload: a pinned host
  // allocation may wait for the device, which mid-step can wait on NCCL operations in flight.
  Impl::UploadRing& ring = impl_->uploads;
  T3D_CUDA_CHECK(cudaHostAlloc(reinterpret_cast<void**>(&ring.pinned),
                               kUploadSlots * kUnwaitedUploadBytes, cudaHostAllocPortable));
  for (cudaEvent_t& e : ring.copied)
    T3D_CUDA_CHECK(cudaEventCreateWithFlags(&e, cudaEventDisableTiming));
}

Stream::~Stream() {
  if (!impl_) return;
  cudaSetDevice(impl_->device);
  if (impl_->stream) cudaStreamSynchronize(impl_->stream);
  if (impl_->copy_stream) cudaStreamSynchronize(impl_->copy_stream);
  if (impl_->compute_mark) cudaEventDestroy(impl_->compute_mark);
  if (impl_->copies_mark) cudaEventDestroy(impl_->copies_mark);
  if (impl_->copy_stream) cudaStreamDestroy(impl_->copy_stream);
  if (impl_->lt) cublasLtDestroy(impl_->lt);
  for (const Impl::TimedOp& op : impl_->timed_ops) {
    cudaEventDestroy(op.start);
    if (op.stop) cudaEventDestroy(op.stop);
  }
  for (const cudaEvent_t e : impl_->spare_events) cudaEventDestroy(e);
  for (const cudaEvent_t e : impl_->uploads.copied)
    if (e) cudaEventDestroy(e);
  cudaFreeHost(impl_->uploads.pinned);
  cudaFree(impl_->blas_workspace);
  cudaFree(impl_->scalar_sum);
  cudaFree(impl_->scalar_count);
  if (impl_->stream) cudaStreamDestroy(impl_->stream);
}

int Stream::device() const { return impl_->device; }

void Stream::synchronize() const { T3D_CUDA_CHECK(cudaStreamSynchronize(impl_->stream)); }

void* native_stream(const Stream& stream) { return stream.impl().stream; }

int stream_device(const Stream& stream) { return stream.device(); }

std::string pci_bus_id(const Stream& stream) {
  char id[32] = {};
  T3D_CUDA_CHECK(cudaDeviceGetPCIBusId(id, sizeof(id), stream.device()));
  return id;
}

DeviceMemory::DeviceMemory(std::size_t bytes, std::string_view what) : bytes_(bytes) {
  if (bytes == 0) return;
  data_ = device_alloc_zeroed(bytes, what);
}

namespace {

// A failed allocation of `bytes` for `what`: UserError for a GPU without the memory or without a
// device, else the CUDA error.
void check_allocation(cudaError_t err, std::size_t bytes, std::string_view what) {
  if (err == cudaErrorMemoryAllocation) {
    cudaGetLastError();
    std::size_t free_bytes = 0, total = 0;
    cudaMemGetInfo(&free_bytes, &total);
    throw UserError(::t3d::detail::concat("out of GPU memory allocating ", what, ": asked ",
                                          format_bytes(bytes), ", ", format_bytes(free_bytes),
                                          " free of ", format_bytes(total),
                                          "; lower hardware.hbm_gib's use (smaller micro-batches, "
                                          "recompute, ZeRO) or use more GPUs"));
  }
  if (err == cudaErrorNoDevice || err == cudaErrorInsufficientDriver) {
    cudaGetLastError();
    throw UserError(::t3d::detail::concat("no GPU to allocate ", what,
                                          " on: ", cudaGetErrorString(err),
                                          "; run on the CPU or where a GPU is visible"));
  }
  T3D_CUDA_CHECK(err);
}

}  // namespace

void* device_alloc_zeroed(std::size_t bytes, std::string_view what) {
  void* data = nullptr;
  check_allocation(cudaMalloc(&data, bytes), bytes, what);
  T3D_CUDA_CHECK(cudaMemset(data, 0, bytes));
  // cudaMemset runs on the legacy default stream, which the non-blocking streams do not wait for:
  // without this, a stream's first writes (weights copied in, the bf16 weight copy) could be
  // zeroed after the fact. Made before training (the arena): the wait costs nothing.
  T3D_CUDA_CHECK(cudaDeviceSynchronize());
  return data;
}

void* stream_alloc(cudaStream_t stream, std::size_t bytes, std::string_view what) {
  void* data = nullptr;
  check_allocation(cudaMallocAsync(&data, std::max<std::size_t>(bytes, 1), stream), bytes, what);
  return data;
}

void* stream_alloc_zeroed(const Stream& s, std::size_t bytes, std::string_view what) {
  cudaStream_t stream = s.impl().stream;
  void* data = stream_alloc(stream, bytes, what);
  T3D_CUDA_CHECK(cudaMemsetAsync(data, 0, bytes, stream));
  return data;
}

void stream_free(const Stream& s, void* p) noexcept {
  if (p) cudaFreeAsync(p, s.impl().stream);
}

void device_free(void* p) noexcept {
  if (p) cudaFree(p);
}

DeviceMemory::~DeviceMemory() {
  if (data_) cudaFree(data_);
}

DeviceMemory::DeviceMemory(DeviceMemory&& other) noexcept
    : data_(std::exchange(other.data_, nullptr)), bytes_(std::exchange(other.bytes_, 0)) {}

DeviceMemory& DeviceMemory::operator=(DeviceMemory&& other) noexcept {
  if (this != &other) {
    if (data_) cudaFree(data_);
    data_ = std::exchange(other.data_, nullptr);
    bytes_ = std::exchange(other.bytes_, 0);
  }
  return *this;
}

void copy_to_device(const Stream& s, void* device_dst, const void* host_src, std::size_t bytes) {
  if (bytes == 0) return;
  // From any host thread (a restore's I/O thread): a thread's first CUDA call would otherwise
  // make a context on GPU 0 (docs/gpu.md: a rank makes one on its own GPU only).
  T3D_CUDA_CHECK(cudaSetDevice(s.device()));
  T3D_CUDA_CHECK(
      cudaMemcpyAsync(device_dst, host_src, bytes, cudaMemcpyHostToDevice, s.impl().stream));
}

void copy_to_device_staged(const Stream& s, void* device_dst, const void* host_src,
                           std::size_t bytes) {
  T3D_ASSERT(bytes <= kUnwaitedUploadBytes, "a staged upload of ", bytes, " bytes");
  if (bytes == 0) return;
  T3D_CUDA_CHECK(cudaSetDevice(s.device()));  // from any host thread, as copy_to_device
  Stream::Impl& st = s.impl();
  Stream::Impl::UploadRing& ring = st.uploads;
  const std::lock_guard<std::mutex> lock(ring.taking);
  const int slot = ring.next;
  ring.next = (slot + 1) % kUploadSlots;
  T3D_CUDA_CHECK(cudaEventSynchronize(ring.copied[slot]));  // the slot's previous copy has run
  unsigned char* staged = ring.pinned + static_cast<std::size_t>(slot) * kUnwaitedUploadBytes;
  std::memcpy(staged, host_src, bytes);
  T3D_CUDA_CHECK(cudaMemcpyAsync(device_dst, staged, bytes, cudaMemcpyHostToDevice, st.stream));
  T3D_CUDA_CHECK(cudaEventRecord(ring.copied[slot], st.stream));
}

void host_register(void* p, std::size_t bytes) {
  if (bytes) T3D_CUDA_CHECK(cudaHostRegister(p, bytes, cudaHostRegisterPortable));
}

void host_unregister(void* p) noexcept { cudaHostUnregister(p); }

void copy_to_host(const Stream& s, void* host_dst, const void* device_src, std::size_t bytes) {
  if (bytes == 0) return;
  T3D_CUDA_CHECK(cudaSetDevice(s.device()));  // from any host thread, as copy_to_device
  T3D_CUDA_CHECK(
      cudaMemcpyAsync(host_dst, device_src, bytes, cudaMemcpyDeviceToHost, s.impl().stream));
}

void copy_to_host_behind(const Stream& s, void* host_dst, const void* device_src,
                         std::size_t bytes) {
  if (bytes == 0) return;
  Stream::Impl& st = s.impl();
  T3D_CUDA_CHECK(cudaEventRecord(st.compute_mark, st.stream));
  T3D_CUDA_CHECK(cudaStreamWaitEvent(st.copy_stream, st.compute_mark, 0));
  T3D_CUDA_CHECK(
      cudaMemcpyAsync(host_dst, device_src, bytes, cudaMemcpyDeviceToHost, st.copy_stream));
}

void wait_for_copies_behind(const Stream& s) {
  // From any host thread (the snapshot's I/O thread): the stream's device made current first.
  T3D_CUDA_CHECK(cudaSetDevice(s.device()));
  T3D_CUDA_CHECK(cudaStreamSynchronize(s.impl().copy_stream));
}

void compute_after_copies_behind(const Stream& s) {
  Stream::Impl& st = s.impl();
  T3D_CUDA_CHECK(cudaEventRecord(st.copies_mark, st.copy_stream));
  T3D_CUDA_CHECK(cudaStreamWaitEvent(st.stream, st.copies_mark, 0));
}

RoundedBuffer take_rounded_buffer(const Stream& s, std::size_t elems) {
  Stream::Impl& st = s.impl();
  std::size_t slot = 0;
  while (slot < st.rounded_buffers.size() && st.rounded_buffers[slot].taken) ++slot;
  if (slot == st.rounded_buffers.size()) st.rounded_buffers.emplace_back();
  Stream::Impl::RoundedBuffer& b = st.rounded_buffers[slot];
  bf16* data = b.buffer.at_least(st.stream, elems);
  b.taken = true;
  return {data, static_cast<int>(slot)};
}

void give_rounded_buffer(const Stream& s, int slot) noexcept {
  auto& buffers = s.impl().rounded_buffers;
  if (slot >= 0 && static_cast<std::size_t>(slot) < buffers.size())
    buffers[static_cast<std::size_t>(slot)].taken = false;
}

}  // namespace t3d::kernels::cuda
