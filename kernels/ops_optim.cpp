// Element-wise range operations: residual add, scaling, norms, AdamW. They run over whole flat
// regions (all parameters at once), which is why the regions are contiguous.
#include <algorithm>
#include <chrono>
#include <cmath>
#include <condition_variable>
#include <cstdint>
#include <cstdio>
#include <cstring>
#include <mutex>
#include <thread>
#include <vector>

#include "kernels/check.h"
#include "kernels/cuda/cuda_ops.h"
#include "kernels/ops.h"
#include "kernels/simd_rows.h"
#include "kernels/threads.h"

namespace t3d::kernels {

void zero(const Exec& exec, float* x, std::int64_t n) {
  T3D_ON_GPU(exec, cuda::zero(*exec.stream, x, n));
  if (n <= 0) return;
  detail::split_range(n, [&](std::int64_t lo, std::int64_t hi) {
    std::memset(x + lo, 0, static_cast<std::size_t>(hi - lo) * sizeof(float));
  });
}

void copy(const Exec& exec, float* dst, const float* src, std::int64_t n) {
  T3D_ON_GPU(exec, cuda::copy(*exec.stream, dst, src, n));
  if (n > 0) std::memcpy(dst, src, static_cast<std::size_t>(n) * sizeof(float));
}

void float_to_bf16(const Exec& exec, bf16* out, const float* in, std::int64_t n) {
  T3D_ON_GPU(exec, cuda::float_to_bf16(*exec.stream, out, in, n));
  float_to_bf16_threads(out, in, n);
}

void bf16_to_float(const Exec& exec, float* out, const bf16* in, std::int64_t n) {
  T3D_ON_GPU(exec, cuda::bf16_to_float(*exec.stream, out, in, n));
  bf16_to_float_threads(out, in, n);
}

namespace {
thread_local std::int64_t host_waits_made = 0;
}  // namespace

std::int64_t host_waits() { return host_waits_made; }

void count_host_wait() { ++host_waits_made; }

void copy_from_host(const Exec& exec, void* dst, const void* host_src, std::size_t bytes) {
  const bool waited = bytes > kUnwaitedUploadBytes;
  if (waited) count_host_wait();
  // Above the unwaited size synchronised: the host buffer may be pinned (then the copy is async).
  T3D_ON_GPU(exec, waited ? (cuda::copy_to_device(*exec.stream, dst, host_src, bytes),
                             exec.stream->synchronize())
                          : cuda::copy_to_device_staged(*exec.stream, dst, host_src, bytes));
  if (bytes) std::memcpy(dst, host_src, bytes);
}

void copy_to_host(const Exec& exec, void* host_dst, const void* src, std::size_t bytes) {
  count_host_wait();
  T3D_ON_GPU(exec,
             (cuda::copy_to_host(*exec.stream, host_dst, src, bytes), exec.stream->synchronize()));
  if (bytes) std::memcpy(host_dst, src, bytes);
}

namespace {

// Guarded device memory (kernels/memory_guard.h) also stands in for a GPU's copy stream: a
// started copy is made at the latest moment a GPU could make it, and its host bytes are all ones
// (NaN) until then. That moment is the starting thread's next wait_for_copies or
// compute_after_copies; another thread's wait_for_copies (a snapshot's I/O thread) waits for it,
// as a GPU's copy may still be queued behind compute when the other thread asks. So a reader of
// the host bytes that did not wait reads NaN, and an op that overwrites a copied source before
// compute_after_copies changes what is copied, whichever thread runs first: either changes a
// snapshot's bits against the same run unguarded (use_device_memory_guard). A waiting thread
// that the starting thread never releases makes the copies itself after kCopiesLatest.
struct DeferredCopy {
  void* host_dst;
  const void* src;
  std::size_t bytes;
  std::thread::id starter;
};
struct DeferredCopies {
  std::mutex mutex;
  std::condition_variable made;
  std::vector<DeferredCopy> pending;
  std::int64_t started = 0, done = 0;  // copies, in start order
};
DeferredCopies deferred_copies;
constexpr std::chrono::seconds kCopiesLatest{60};

void make_deferred_copies(bool wait_for_starter) {
  DeferredCopies& d = deferred_copies;
  std::unique_lock<std::mutex> lock(d.mutex);
  const std::thread::id me = std::this_thread::get_id();
  const bool mine = std::any_of(d.pending.begin(), d.pending.end(),
                                [&](const DeferredCopy& c) { return c.starter == me; });
  if (wait_for_starter && !mine && !d.pending.empty()) {
    const std::int64_t until = d.started;
    if (!d.made.wait_for(lock, kCopiesLatest, [&] { return d.done >= until; }))
      std::fprintf(stderr,
                   "guarded device memory: %zu started copies were waited for from another thread "
                   "for %llds without their thread's wait_for_copies or compute_after_copies; "
                   "made now\n",
                   d.pending.size(), static_cast<long long>(kCopiesLatest.count()));
  }
  if (d.pending.empty()) return;
  const GuardedMemoryOpen open;  // from any thread, as a GPU's copy stream runs beside the compute
  for (const DeferredCopy& c : d.pending) std::memcpy(c.host_dst, c.src, c.bytes);
  d.done += static_cast<std::int64_t>(d.pending.size());
  d.pending.clear();
  d.made.notify_all();
}

}  // namespace

void copy_to_host_started(const Exec& exec, void* host_dst, const void* src, std::size_t bytes) {
  T3D_ON_GPU(exec, cuda::copy_to_host_behind(*exec.stream, host_dst, src, bytes));
  if (bytes == 0) return;
  if (guarded_memories.load(std::memory_order_relaxed) > 0) {
    std::memset(host_dst, 0xFF, bytes);
    const std::lock_guard<std::mutex> lock(deferred_copies.mutex);
    deferred_copies.pending.push_back({host_dst, src, bytes, std::this_thread::get_id()});
    ++deferred_copies.started;
    return;
  }
  std::memcpy(host_dst, src, bytes);
}

void wait_for_copies(const Exec& exec) {
  count_host_wait();
  // Not T3D_ON_GPU: called from any thread (a snapshot's I/O thread), where the op timer, which
  // keeps its events per stream for the thread that computes, must not run.
#ifdef T3D_HAVE_CUDA
  if (exec.on_gpu()) {
    cuda::wait_for_copies_behind(*exec.stream);
    return;
  }
#else
  (void)exec;
#endif
  make_deferred_copies(true);
}

void compute_after_copies(const Exec& exec) {
  T3D_ON_GPU(exec, cuda::compute_after_copies_behind(*exec.stream));
  make_deferred_copies(false);
}

namespace {

constexpr std::int64_t kHashPiece = std::int64_t{1} << 18;  // floats per piece hash (1 MiB)

// The XXH3 of each piece, where the floats are (in place over the rank's threads on the CPU; in
// device memory on a GPU, only the hashes crossing).
void piece_hashes(const Exec& exec, std::uint64_t* out, const float* x, std::int64_t n) {
  T3D_ON_GPU(exec, cuda::hash_pieces_to_host(*exec.stream, out, x, n, kHashPiece));
  detail::split_rows(
      (n + kHashPiece - 1) / kHashPiece, kHashPiece, [&](std::int64_t lo, std::int64_t hi) {
        for (std::int64_t p = lo; p < hi; ++p) {
          const std::int64_t floats = std::min(kHashPiece, n - p * kHashPiece);
          out[p] =
              hash64_xxh3(x + p * kHashPiece, sizeof(float) * static_cast<std::size_t>(floats));
        }
      });
}

}  // namespace

void hash_floats(const Exec& exec, Hash64Stream& h, const float* x, std::int64_t n) {
  count_host_wait();
  // Kept per calling thread (every step hashes); the workers write through the pointer, not their
  // own thread_local copies.
  thread_local std::vector<std::uint64_t> kept;
  kept.assign(static_cast<std::size_t>((n + kHashPiece - 1) / kHashPiece), 0);
  piece_hashes(exec, kept.data(), x, n);
  h.update(kept.data(), kept.size() * sizeof(std::uint64_t));
}

void flip_bit(const Exec& exec, float* x, std::int64_t i, int bit) {
  T3D_ASSERT(bit >= 0 && bit < 32 && i >= 0, "flip_bit: bit ", bit, " of element ", i);
  std::uint32_t word = 0;
  copy_to_host(exec, &word, x + i, sizeof(word));
  word ^= std::uint32_t{1} << bit;
  copy_from_host(exec, x + i, &word, sizeof(word));
}

std::int64_t count_nonfinite(const Exec& exec, const float* x, std::int64_t n) {
  count_host_wait();
  T3D_ON_GPU(exec, cuda::count_nonfinite_to_host(*exec.stream, x, n));
  std::int64_t bad = 0;
  for (std::int64_t i = 0; i < n; ++i) bad += !std::isfinite(x[i]);
  return bad;
}

void sum_in_order_into(const Exec& exec, double* out, const float* x, std::int64_t n) {
  T3D_ON_GPU(exec, cuda::sum_in_order(*exec.stream, out, x, n));
  double s = 0.0;
  for (std::int64_t i = 0; i < n; ++i) s += x[i];
  *out = s;
}

void add_inplace(const Exec& exec, float* x, const float* y, std::int64_t n) {
  add(exec, x, x, y, n);
}

void add(const Exec& exec, float* out, const float* x, const float* y, std::int64_t n) {
  T3D_ON_GPU(exec, cuda::add(*exec.stream, out, x, y, n));
#pragma omp parallel for simd num_threads(detail::op_threads(n)) schedule(static)
  for (std::int64_t i = 0; i < n; ++i) out[i] = x[i] + y[i];
}

namespace {

double sum_of_squares_on_cpu(const float* x, std::int64_t n) {
  // Double accumulation: ~1e9 squared gradients summed in fp32 would lose the small ones.
  // Four partial sums break the dependency chain so the loop is not latency-bound.
  double s0 = 0, s1 = 0, s2 = 0, s3 = 0;
  std::int64_t i = 0;
  for (; i + 4 <= n; i += 4) {
    s0 += static_cast<double>(x[i]) * x[i];
    s1 += static_cast<double>(x[i + 1]) * x[i + 1];
    s2 += static_cast<double>(x[i + 2]) * x[i + 2];
    s3 += static_cast<double>(x[i + 3]) * x[i + 3];
  }
  for (; i < n; ++i) s0 += static_cast<double>(x[i]) * x[i];
  return (s0 + s1) + (s2 + s3);
}

}  // namespace

double sum_of_squares(const Exec& exec, const float* x, std::int64_t n) {
  count_host_wait();
  T3D_ON_GPU(exec, cuda::sum_of_squares_to_host(*exec.stream, x, n));
  return sum_of_squares_on_cpu(x, n);
}

void sum_of_squares_each(const Exec& exec, double* out, const float* const* x,
                         const std::int64_t* n, std::int64_t count) {
  count_host_wait();
  T3D_ON_GPU(exec, cuda::sum_of_squares_each_to_host(*exec.stream, out, x, n, count));
  for (std::int64_t j = 0; j < count; ++j) out[j] = sum_of_squares_on_cpu(x[j], n[j]);
}

void float_to_bf16_many(const Exec& exec, const Bf16Cast* casts, std::int64_t count) {
  T3D_ON_GPU(exec, cuda::float_to_bf16_many(*exec.stream, casts, count));
  for (std::int64_t j = 0; j < count; ++j)
    float_to_bf16(exec, casts[j].out, casts[j].in, casts[j].n);
}

void adamw_step_many(const Exec& exec, const AdamWTensor* tensors, std::int64_t count,
                     std::int64_t step) {
  T3D_ON_GPU(exec, cuda::adamw_step_many(*exec.stream, tensors, count, step));
  for (std::int64_t j = 0; j < count; ++j) {
    const AdamWTensor& t = tensors[j];
    adamw_step(exec, t.params, t.grads, t.m, t.v, t.n, t.cfg, step);
  }
}

void adamw_step(const Exec& exec, float* params, const float* grads, float* m, float* v,
                std::int64_t n, const AdamWConfig& cfg, std::int64_t step) {
  T3D_ON_GPU(exec, cuda::adamw_step(*exec.stream, params, grads, m, v, n, cfg, step));
  T3D_ASSERT(step >= 1, "AdamW step counts from 1, got ", step);
  const detail::AdamWScalars scalars = detail::adamw_scalars(cfg, step);
  const auto& rows = detail::simd_rows();
  detail::split_range(n, [&](std::int64_t lo, std::int64_t hi) {
    rows.adamw(params + lo, grads + lo, m + lo, v + lo, hi - lo, scalars);
  });
}

}  // namespace t3d::kernels
