#include "kernels/arena.h"

#include <sys/mman.h>

#include <algorithm>
#include <cerrno>
#include <cstdio>
#include <cstring>
#include <utility>

#include "kernels/check.h"
#include "kernels/cuda/cuda_ops.h"
#include "kernels/memory_guard.h"

namespace t3d::kernels {
namespace {

std::size_t round_up(std::size_t n, std::size_t a) { return (n + a - 1) / a * a; }

}  // namespace

std::string format_bytes(std::size_t bytes) {
  static const char* kUnits[] = {"B", "KiB", "MiB", "GiB", "TiB"};
  double v = static_cast<double>(bytes);
  int u = 0;
  while (v >= 1024.0 && u < 4) {
    v /= 1024.0;
    ++u;
  }
  char buf[64];
  std::snprintf(buf, sizeof buf, u == 0 ? "%.0f %s" : "%.1f %s", v, kUnits[u]);
  return buf;
}

Arena::Arena(std::size_t capacity_bytes, Memory memory)
    : memory_(memory), capacity_(round_up(capacity_bytes, kAlignment)) {
  if (capacity_ == 0) return;
  if (memory == Memory::kDevice) {
#ifdef T3D_HAVE_CUDA
    base_ = static_cast<std::byte*>(cuda::device_alloc_zeroed(capacity_, "the device arena"));
    return;
#else
    throw UserError(
        "a GPU arena was asked of a titan3d built without the CUDA backend: build "
        "where the CUDA toolkit is installed (docs/gpu.md)");
#endif
  }
  // MAP_NORESERVE: reserve address space only. Physical pages arrive on first touch, so several
  // oversubscribed ranks with large budgets can coexist on a small machine until they really use
  // the memory. mmap memory is page-aligned, hence kAlignment-aligned.
  void* p = mmap(nullptr, capacity_, PROT_READ | PROT_WRITE,
                 MAP_PRIVATE | MAP_ANONYMOUS | MAP_NORESERVE, -1, 0);
  T3D_USER_CHECK(p != MAP_FAILED, "cannot reserve a device arena of ", format_bytes(capacity_),
                 " (", capacity_, " bytes): ", std::strerror(errno),
                 "; lower hardware.hbm_gib or run fewer ranks per node");
  base_ = static_cast<std::byte*>(p);
  // Transparent huge pages where the kernel offers them on request (THP "madvise" mode): a first
  // touch then faults in 2 MiB, not 4 KiB; on a virtual machine, where every fault is costly,
  // that is seconds per GiB at start-up. Advice only: ignored where THP is off.
  madvise(p, capacity_, MADV_HUGEPAGE);
  if (memory == Memory::kGuardedHost) guard_memory(base_, capacity_);
}

Memory device_memory(const Exec& exec) {
  if (exec.on_gpu()) return Memory::kDevice;
  return memory_guard_on() ? Memory::kGuardedHost : Memory::kHost;
}

bool host_shares_device_memory(const Exec& exec) { return device_memory(exec) == Memory::kHost; }

Arena::~Arena() {
  if (!base_) return;
#ifdef T3D_HAVE_CUDA
  if (memory_ == Memory::kDevice) {
    cuda::device_free(base_);
    return;
  }
#endif
  if (memory_ == Memory::kGuardedHost) unguard_memory(base_);
  munmap(base_, capacity_);
}

void Buffer::reserve(const Exec& exec, std::size_t bytes, std::string_view name) {
  if (bytes <= bytes_) return;
  release();  // what it held, in the memory it held it (a Buffer may change Exec)
#ifdef T3D_HAVE_CUDA
  if (exec.on_gpu()) {
    data_ = cuda::stream_alloc_zeroed(*exec.stream, bytes, name);
    stream_ = exec.stream;
    bytes_ = bytes;
    return;
  }
#endif
  memory_ = std::make_unique<Arena>(bytes, device_memory(exec));  // the old one freed first
  data_ = memory_->alloc_bytes(name, bytes);
  bytes_ = bytes;
}

Buffer::Buffer(Buffer&& other) noexcept
    : memory_(std::move(other.memory_)),
      stream_(std::exchange(other.stream_, nullptr)),
      data_(std::exchange(other.data_, nullptr)),
      bytes_(std::exchange(other.bytes_, 0)) {}

Buffer& Buffer::operator=(Buffer&& other) noexcept {
  if (this != &other) {
    release();
    memory_ = std::move(other.memory_);
    stream_ = std::exchange(other.stream_, nullptr);
    data_ = std::exchange(other.data_, nullptr);
    bytes_ = std::exchange(other.bytes_, 0);
  }
  return *this;
}

Buffer::~Buffer() { release(); }

void Buffer::release() noexcept {
#ifdef T3D_HAVE_CUDA
  if (stream_) cuda::stream_free(*stream_, data_);
#endif
  memory_.reset();
  stream_ = nullptr;
  data_ = nullptr;
  bytes_ = 0;
}

void* Arena::alloc_bytes(std::string_view name, std::size_t bytes) {
  const std::size_t rounded = aligned_bytes(std::max<std::size_t>(bytes, 1));
  if (rounded > available()) {
    // Name the largest holders: the usual fix is obvious once you see what fills the budget.
    std::vector<Live> top = live_;
    std::sort(top.begin(), top.end(),
              [](const Live& a, const Live& b) { return a.bytes > b.bytes; });
    std::string holders;
    for (std::size_t i = 0; i < std::min<std::size_t>(top.size(), 4); ++i) {
      holders += (i ? ", " : "") + top[i].name + " " + format_bytes(top[i].bytes);
    }
    throw UserError(detail::concat(
        "device memory exhausted allocating '", name, "': asked ", format_bytes(bytes), " (", bytes,
        " bytes), ", format_bytes(available()), " (", available(), " bytes) left of ",
        format_bytes(capacity_), " (peak so far ", format_bytes(peak_), ")",
        holders.empty() ? "" : "; largest allocations: ", holders,
        ". Raise hardware.hbm_gib, or shard the model further (more tp or pp), or use smaller "
        "micro-batches"));
  }
  void* p = base_ + used_;
  used_ += rounded;
  peak_ = std::max(peak_, used_);
  live_.push_back({std::string(name), rounded});
  return p;
}

std::int64_t numel(const std::vector<std::int64_t>& shape) {
  std::int64_t n = 1;
  for (auto d : shape) n *= d;
  return n;
}

ParamLayout::ParamLayout(std::vector<TensorSpec> table) {
  entries_.reserve(table.size());
  std::int64_t offset = 0;
  for (auto& spec : table) {
    for (auto d : spec.shape) {
      T3D_USER_CHECK(d > 0, "parameter '", spec.name, "' has a non-positive dimension ", d);
    }
    const std::int64_t n = numel(spec.shape);
    const auto [it, inserted] = index_.emplace(spec.name, entries_.size());
    T3D_USER_CHECK(inserted, "parameter '", spec.name, "' appears twice in the parameter table");
    entries_.push_back({std::move(spec), offset, n});
    total_params_ += n;
    offset += static_cast<std::int64_t>(round_up(static_cast<std::size_t>(n), kAlignmentFloats));
  }
  total_floats_ = offset;
}

bool ParamLayout::contains(std::string_view name) const {
  return index_.count(std::string(name)) != 0;
}

const ParamLayout::Entry& ParamLayout::at(std::string_view name) const {
  auto it = index_.find(std::string(name));
  if (it == index_.end()) {
    std::string some;
    for (std::size_t i = 0; i < std::min<std::size_t>(entries_.size(), 3); ++i) {
      some += (i ? ", " : "") + entries_[i].spec.name;
    }
    throw UserError(detail::concat("no parameter named '", name, "' in the parameter table (",
                                   entries_.size(), " entries, e.g. ", some, ")"));
  }
  return entries_[it->second];
}

TensorView Region::view(std::string_view name) const {
  const auto& e = layout_->at(name);
  return {data_ + e.offset, &e.spec.shape, e.numel};
}

void Region::zero() const {
  if (data_) std::memset(data_, 0, static_cast<std::size_t>(size()) * sizeof(float));
}

ModelState ModelState::allocate(Arena& arena, const ParamLayout& layout, bool with_optimizer,
                                bool with_grads, bool with_params) {
  const auto n = static_cast<std::size_t>(layout.total_floats());
  ModelState s;
  if (with_params) s.params = Region(arena.alloc_floats("parameters", n), &layout);
  if (with_grads) s.grads = Region(arena.alloc_floats("gradients", n), &layout);
  if (with_optimizer) {
    s.adam_m = Region(arena.alloc_floats("optimizer.exp_avg", n), &layout);
    s.adam_v = Region(arena.alloc_floats("optimizer.exp_avg_sq", n), &layout);
  }
  // Padding must be zero (see ParamLayout): host regions are zeroed explicitly; a device arena's
  // memory was zeroed when the arena was made, and a bump allocator never hands it out twice.
  if (arena.memory() == Memory::kHost)
    for (const Region* r : {&s.params, &s.grads, &s.adam_m, &s.adam_v}) r->zero();
  return s;
}

}  // namespace t3d::kernels
