// A rank's memory as one bump-allocated arena. The device arena (its capacity the rank's HBM
// budget) holds the model's state, activations and scratch; a second one holds the host staging
// of snapshots (runtime/train/snapshots.cpp).
//
// Layout (llm.c style): parameters, gradients and the AdamW moments m and v each live in ONE
// contiguous region, so zeroing, the optimizer step, checkpoint I/O and ZeRO slicing are each one
// operation over a float range. Named views into a region come from a `{name, shape}` table
// (`ParamLayout`), never from parallel arrays kept in order by hand.
//
// The arena is a bump allocator filled once when a stage is built: parameter regions, gradient
// and optimizer state, activation slots and scratch. Nothing is allocated inside a step.
#pragma once

#include <cstddef>
#include <cstdint>
#include <memory>
#include <string>
#include <string_view>
#include <unordered_map>
#include <vector>

#include "kernels/exec.h"

namespace t3d::kernels {

// Every allocation starts on a 64-byte boundary (one cache line, one AVX-512 register).
inline constexpr std::size_t kAlignment = 64;
inline constexpr std::size_t kAlignmentFloats = kAlignment / sizeof(float);
// `bytes` rounded up to kAlignment: what an allocation of that many bytes (at least one) takes.
inline constexpr std::size_t aligned_bytes(std::size_t bytes) {
  return (bytes + kAlignment - 1) / kAlignment * kAlignment;
}

// Bytes -> "12.0 MiB" for messages.
std::string format_bytes(std::size_t bytes);

// Where an arena's memory is: host memory (the CPU backend, and host staging), or one GPU's memory
// (the CUDA backend: kernels/exec.h; only ops given a GPU Exec may touch it), or the CPU backend's
// device memory guarded as a GPU's is (host memory only ops may touch: kernels/memory_guard.h).
enum class Memory { kHost, kDevice, kGuardedHost };

// The memory an Exec's device state lives in (its arena, Buffers): the GPU's for a GPU Exec; on
// the CPU host memory, guarded where memory_guard_on().
Memory device_memory(const Exec& exec);
// Whether code outside the ops may read and write an Exec's device memory in place (the CPU,
// unguarded). Where not, data crosses by copy_to_host and copy_from_host (kernels/ops.h).
bool host_shares_device_memory(const Exec& exec);

class Arena {
 public:
  // kHost: reserves `capacity_bytes` of address space. Pages are committed lazily by the OS as
  // they are first touched, so an 80 GiB budget on a smaller test machine costs nothing until
  // used. kDevice: cudaMalloc's the whole capacity on the current GPU at once and zeroes it
  // (UserError naming the bytes when the GPU lacks them, or when the build has no CUDA backend).
  // kGuardedHost: as kHost, guarded (kernels/memory_guard.h) until the Arena ends.
  explicit Arena(std::size_t capacity_bytes, Memory memory = Memory::kHost);
  ~Arena();
  Arena(const Arena&) = delete;
  Arena& operator=(const Arena&) = delete;

  // Allocates `bytes` (rounded up to kAlignment) for the tensor called `name`. Throws UserError
  // naming the tensor, the bytes asked and the bytes left when the budget is exceeded.
  // Memory is zero (fresh pages from the OS, or the device block zeroed when it was made).
  void* alloc_bytes(std::string_view name, std::size_t bytes);
  float* alloc_floats(std::string_view name, std::size_t count) {
    return static_cast<float*>(alloc_bytes(name, count * sizeof(float)));
  }

  Memory memory() const { return memory_; }
  std::size_t capacity() const { return capacity_; }
  std::size_t used() const { return used_; }
  std::size_t available() const { return capacity_ - used_; }
  std::size_t peak() const { return peak_; }
  void reset_peak() { peak_ = used_; }

 private:
  struct Live {
    std::string name;
    std::size_t bytes;
  };
  std::byte* base_ = nullptr;
  Memory memory_ = Memory::kHost;
  std::size_t capacity_ = 0;
  std::size_t used_ = 0;
  std::size_t peak_ = 0;
  std::vector<Live> live_;  // for the OOM message: what is holding the memory
};

// A buffer of its own in the memory of an Exec (host for the CPU, the GPU's for a GPU Exec), for
// the few buffers whose number is known only while running: the pipeline executor's hand-over and
// send staging, made during the first step and reused afterwards. reserve() grows it (zeroed,
// like arena memory), dropping what it held. On a GPU it lives in the order of the Exec's stream
// (cuda::stream_alloc_zeroed): growing it mid-step synchronises neither the host nor the device,
// and what it held is freed behind the work enqueued before (work of another stream that reads
// it must have been ordered before the stream's current work), also by the destructor, which
// therefore waits for nothing (unwinding from an error with NCCL operations in flight) and needs
// the Exec's stream (its kernels::Device) to outlive the Buffer, as all that is built on it does.
class Buffer {
 public:
  Buffer() = default;
  Buffer(Buffer&& other) noexcept;
  Buffer& operator=(Buffer&& other) noexcept;
  Buffer(const Buffer&) = delete;
  Buffer& operator=(const Buffer&) = delete;
  ~Buffer();
  void reserve(const Exec& exec, std::size_t bytes, std::string_view name);
  std::size_t bytes() const { return bytes_; }
  template <typename T>
  T* as() const {
    return static_cast<T*>(data_);
  }

 private:
  void release() noexcept;
  std::unique_ptr<Arena> memory_;         // host memory: an arena of its own
  const cuda::Stream* stream_ = nullptr;  // device memory: in this stream's order
  void* data_ = nullptr;
  std::size_t bytes_ = 0;
};

// One entry of a parameter table: a Hugging Face name and its (global or local) shape, e.g.
// {"model.layers.3.self_attn.q_proj.weight", {4096, 4096}} stored [out, in] row-major.
struct TensorSpec {
  std::string name;
  std::vector<std::int64_t> shape;
};

std::int64_t numel(const std::vector<std::int64_t>& shape);

// A view into a flat region: pointer plus shape. Does not own memory.
struct TensorView {
  float* data = nullptr;
  const std::vector<std::int64_t>* shape = nullptr;
  std::int64_t numel = 0;
  std::int64_t dim(int i) const { return (*shape)[static_cast<std::size_t>(i)]; }
};

// Lays a `{name, shape}` table out as offsets in one flat float region, in table order. Each
// tensor starts on a kAlignment boundary; the padding floats between tensors stay zero (they are
// zeroed with the region and neither gradients nor the optimizer make them non-zero), so
// range operations over the whole region (AdamW, norms) are unaffected by them.
class ParamLayout {
 public:
  struct Entry {
    TensorSpec spec;
    std::int64_t offset = 0;  // in floats from the start of the region
    std::int64_t numel = 0;
  };

  ParamLayout() = default;
  explicit ParamLayout(std::vector<TensorSpec> table);

  const std::vector<Entry>& entries() const { return entries_; }
  const Entry& at(std::string_view name) const;  // UserError listing a few names if absent
  bool contains(std::string_view name) const;
  std::int64_t total_floats() const { return total_floats_; }  // including alignment padding
  std::int64_t total_params() const { return total_params_; }  // excluding padding

 private:
  std::vector<Entry> entries_;
  std::unordered_map<std::string, std::size_t> index_;
  std::int64_t total_floats_ = 0;
  std::int64_t total_params_ = 0;
};

// A contiguous float region laid out by a ParamLayout.
class Region {
 public:
  Region() = default;
  Region(float* data, const ParamLayout* layout) : data_(data), layout_(layout) {}

  float* data() const { return data_; }
  std::int64_t size() const { return layout_ ? layout_->total_floats() : 0; }
  const ParamLayout& layout() const { return *layout_; }
  TensorView view(std::string_view name) const;
  void zero() const;  // host memory only (a CPU Region); on a GPU: kernels::zero with its Exec

 private:
  float* data_ = nullptr;
  const ParamLayout* layout_ = nullptr;
};

// The persistent training state of one rank: four regions with one layout. The layout must
// outlive the state. Optimizer moments are optional (inference, or ZeRO keeping only a shard,
// which the caller then allocates as a plain float range).
struct ModelState {
  Region params;
  Region grads;
  Region adam_m;
  Region adam_v;

  // Allocates the regions named "parameters", "gradients", "optimizer.exp_avg",
  // "optimizer.exp_avg_sq" from `arena`, all zeroed. Without `with_grads` (ZeRO-2, which keeps
  // only a shard) `grads` stays empty; without `with_params` (ZeRO-3) `params` too.
  static ModelState allocate(Arena& arena, const ParamLayout& layout, bool with_optimizer,
                             bool with_grads = true, bool with_params = true);
};

}  // namespace t3d::kernels
