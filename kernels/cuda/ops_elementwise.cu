// Element-wise range operations and the deterministic sum of squares on the GPU.
#include "kernels/cuda/cuda_internal.cuh"
#include "kernels/cuda/multi_tensor.h"
#include "kernels/row_math.h"
#include "kernels/xxh3_words.h"

namespace t3d::kernels::cuda {
namespace {

__global__ void add_kernel(float* out, const float* x, const float* y, std::int64_t n) {
  for (std::int64_t i = blockIdx.x * std::int64_t{blockDim.x} + threadIdx.x; i < n;
       i += std::int64_t{gridDim.x} * blockDim.x)
    out[i] = x[i] + y[i];
}

// Up to kSquareRanges ranges of one launch of the sum of squares, passed by value (1 KiB).
constexpr int kSquareRanges = 64;
struct SquareRanges {
  const float* x[kSquareRanges];
  std::int64_t n[kSquareRanges];
};

// For range j = blockIdx.y: block b's threads sum x[i]^2 for i ≡ b·kBlock + t (mod
// kSumBlocks·kBlock) in increasing i, in double; then the block's kBlock sums pairwise (halves
// folded onto the first half) into partial[j·kSumBlocks + b]. A range's sum does not depend on
// the others in its launch.
__global__ void sum_squares_partial(double* partial, const SquareRanges ranges) {
  __shared__ double acc[kBlock];
  const float* x = ranges.x[blockIdx.y];
  const std::int64_t n = ranges.n[blockIdx.y];
  double s = 0.0;
  for (std::int64_t i = blockIdx.x * std::int64_t{kBlock} + threadIdx.x; i < n;
       i += std::int64_t{kSumBlocks} * kBlock)
    s += static_cast<double>(x[i]) * x[i];
  acc[threadIdx.x] = s;
  __syncthreads();
  for (int w = kBlock / 2; w > 0; w /= 2) {
    if (threadIdx.x < w) acc[threadIdx.x] += acc[threadIdx.x + w];
    __syncthreads();
  }
  if (threadIdx.x == 0) partial[blockIdx.y * std::int64_t{kSumBlocks} + blockIdx.x] = acc[0];
}

// Block j (kSumBlocks threads) folds range j's partial sums the same way into out[j].
__global__ void sum_partials(double* out, const double* partials) {
  __shared__ double acc[kSumBlocks];
  const double* partial = partials + blockIdx.x * std::int64_t{kSumBlocks};
  acc[threadIdx.x] = partial[threadIdx.x];
  __syncthreads();
  for (int w = kSumBlocks / 2; w > 0; w /= 2) {
    if (threadIdx.x < w) acc[threadIdx.x] += acc[threadIdx.x + w];
    __syncthreads();
  }
  if (threadIdx.x == 0) out[blockIdx.x] = acc[0];
}

// out[j] = the sum of squares of range j (in device memory) for `count` ranges, each in the order
// of the two kernels above, in launches of kSquareRanges ranges.
void sums_of_squares(const Stream& s, double* out, const float* const* x, const std::int64_t* n,
                     std::int64_t count) {
  for (std::int64_t j0 = 0; j0 < count; j0 += kSquareRanges) {
    const int m = static_cast<int>(count - j0 < kSquareRanges ? count - j0 : kSquareRanges);
    SquareRanges ranges{};
    for (int j = 0; j < m; ++j) ranges.x[j] = x[j0 + j], ranges.n[j] = n[j0 + j];
    double* partials =
        s.impl().partial_sums.at_least(s.impl().stream, static_cast<std::size_t>(m) * kSumBlocks);
    sum_squares_partial<<<dim3(kSumBlocks, static_cast<unsigned>(m)), kBlock, 0, s.impl().stream>>>(
        partials, ranges);
    T3D_CUDA_LAUNCHED();
    sum_partials<<<static_cast<unsigned>(m), kSumBlocks, 0, s.impl().stream>>>(out + j0, partials);
    T3D_CUDA_LAUNCHED();
  }
}

// The CPU's loop (s += x[i] in double, i ascending), so its bits, by thread 0 of one block; the
// block's threads first load each chunk of x into shared memory together, so the one thread's
// chain waits on shared memory, not on a global load per element.
constexpr int kInOrderChunk = 8 * kBlock;
__global__ void sum_in_order_kernel(double* out, const float* x, std::int64_t n) {
  __shared__ float chunk[kInOrderChunk];
  double s = 0.0;
  for (std::int64_t i0 = 0; i0 < n; i0 += kInOrderChunk) {
    const int m = n - i0 < kInOrderChunk ? static_cast<int>(n - i0) : kInOrderChunk;
    for (int j = threadIdx.x; j < m; j += blockDim.x) chunk[j] = x[i0 + j];
    __syncthreads();
    if (threadIdx.x == 0)
      for (int j = 0; j < m; ++j) s += chunk[j];
    __syncthreads();
  }
  if (threadIdx.x == 0) *out = s;
}

// An integer count: atomics on integers are exact in any order.
__global__ void count_nonfinite_kernel(unsigned long long* out, const float* x, std::int64_t n) {
  unsigned long long mine = 0;
  for (std::int64_t i = blockIdx.x * std::int64_t{blockDim.x} + threadIdx.x; i < n;
       i += std::int64_t{gridDim.x} * blockDim.x)
    mine += !isfinite(x[i]);
  if (mine) atomicAdd(out, mine);
}

__global__ void adamw_kernel(float* params, const float* grads, float* m, float* v, std::int64_t n,
                             detail::AdamWScalars s) {
  for (std::int64_t i = blockIdx.x * std::int64_t{blockDim.x} + threadIdx.x; i < n;
       i += std::int64_t{gridDim.x} * blockDim.x)
    detail::adamw_element(params[i], grads[i], m[i], v[i], s);
}

// One launch of multi_tensor.h's plan: block b, its range and chunk found in the launch.
__global__ void adamw_many_kernel(const multi_tensor::AdamWLaunch launch) {
  std::int64_t lo = 0, hi = 0;
  const multi_tensor::AdamWRange& t = launch.ranges[launch.range_of(blockIdx.x, lo, hi)];
  for (std::int64_t i = lo + threadIdx.x; i < hi; i += blockDim.x)
    detail::adamw_element(t.params[i], t.grads[i], t.m[i], t.v[i], t.scalars);
}

__global__ void to_bf16_many_kernel(const multi_tensor::CastLaunch launch) {
  std::int64_t lo = 0, hi = 0;
  const Bf16Cast& t = launch.ranges[launch.range_of(blockIdx.x, lo, hi)];
  for (std::int64_t i = lo + threadIdx.x; i < hi; i += blockDim.x)
    t.out[i] = detail::bf16_of(t.in[i]);
}

__global__ void to_bf16_kernel(bf16* out, const float* in, std::int64_t n) {
  for (std::int64_t i = blockIdx.x * std::int64_t{blockDim.x} + threadIdx.x; i < n;
       i += std::int64_t{gridDim.x} * blockDim.x)
    out[i] = detail::bf16_of(in[i]);
}

__global__ void from_bf16_kernel(float* out, const bf16* in, std::int64_t n) {
  for (std::int64_t i = blockIdx.x * std::int64_t{blockDim.x} + threadIdx.x; i < n;
       i += std::int64_t{gridDim.x} * blockDim.x)
    out[i] = detail::float_of(in[i]);
}

}  // namespace

void zero(const Stream& s, float* x, std::int64_t n) {
  if (n <= 0) return;
  T3D_CUDA_CHECK(
      cudaMemsetAsync(x, 0, static_cast<std::size_t>(n) * sizeof(float), s.impl().stream));
}

void copy(const Stream& s, float* dst, const float* src, std::int64_t n) {
  if (n <= 0) return;
  T3D_CUDA_CHECK(cudaMemcpyAsync(dst, src, static_cast<std::size_t>(n) * sizeof(float),
                                 cudaMemcpyDeviceToDevice, s.impl().stream));
}

// A step scalar the stream computed, waited for and copied to the host.
template <class T>
T read_back(const Stream& s, const T* device_value) {
  T host{};
  copy_to_host(s, &host, device_value, sizeof host);
  s.synchronize();
  return host;
}

std::int64_t count_nonfinite_to_host(const Stream& s, const float* x, std::int64_t n) {
  unsigned long long* count = s.impl().scalar_count;
  T3D_CUDA_CHECK(cudaMemsetAsync(count, 0, sizeof *count, s.impl().stream));
  if (n > 0) {
    count_nonfinite_kernel<<<grid_for(n), kBlock, 0, s.impl().stream>>>(count, x, n);
    T3D_CUDA_LAUNCHED();
  }
  return static_cast<std::int64_t>(read_back(s, count));
}

__constant__ unsigned char kXxh3Secret[xxh3::kSecretBytes] = T3D_XXH3_SECRET;

// Eight threads per piece of `piece` floats (the last may be shorter), one per XXH3 accumulator
// (kernels/xxh3_words.h: long_hash_lane), the piece's first thread merging them: its XXH3, as the
// CPU's libxxhash computes it. A piece's eight lanes read each 64-byte stripe together.
constexpr int kHashThreads = 256;
__global__ void hash_pieces_kernel(std::uint64_t* out, const float* x, std::int64_t n,
                                   std::int64_t piece, std::int64_t pieces) {
  __shared__ std::uint64_t acc[kHashThreads];
  const std::int64_t t = blockIdx.x * std::int64_t{blockDim.x} + threadIdx.x;
  const std::int64_t p = t / 8;
  const int lane = static_cast<int>(t % 8);
  const std::int64_t lo = p * piece, len = p < pieces ? (n - lo < piece ? n - lo : piece) : 0;
  const auto* words = reinterpret_cast<const std::uint32_t*>(p < pieces ? x + lo : x);
  const bool long_path = 4 * len > xxh3::kLongBytes;
  if (long_path) acc[threadIdx.x] = xxh3::long_hash_lane(words, 4 * len, kXxh3Secret, lane);
  __syncthreads();  // every thread of the block reaches it: none returned early
  if (p >= pieces || lane != 0) return;
  out[p] = long_path ? xxh3::merge_lanes(acc + threadIdx.x, 4 * len, kXxh3Secret)
                     : xxh3::hash_words(words, len, kXxh3Secret);
}

void hash_pieces_to_host(const Stream& s, std::uint64_t* host_out, const float* x, std::int64_t n,
                         std::int64_t piece) {
  const std::int64_t pieces = (n + piece - 1) / piece;
  if (pieces <= 0) return;
  const std::size_t bytes = sizeof(std::uint64_t) * static_cast<std::size_t>(pieces);
  // Stream-ordered: no device-wide synchronisation.
  auto* hashes = static_cast<std::uint64_t*>(
      stream_alloc(s.impl().stream, bytes, "the hashes of a tensor's pieces"));
  constexpr std::int64_t kPiecesPerBlock = kHashThreads / 8;
  hash_pieces_kernel<<<static_cast<unsigned>((pieces + kPiecesPerBlock - 1) / kPiecesPerBlock),
                       kHashThreads, 0, s.impl().stream>>>(hashes, x, n, piece, pieces);
  T3D_CUDA_LAUNCHED();
  copy_to_host(s, host_out, hashes, bytes);
  stream_free(s, hashes);
  s.synchronize();
}

void sum_in_order(const Stream& s, double* out, const float* x, std::int64_t n) {
  sum_in_order_kernel<<<1, kBlock, 0, s.impl().stream>>>(out, x, n);
  T3D_CUDA_LAUNCHED();
}

void add(const Stream& s, float* out, const float* x, const float* y, std::int64_t n) {
  if (n <= 0) return;
  add_kernel<<<grid_for(n), kBlock, 0, s.impl().stream>>>(out, x, y, n);
  T3D_CUDA_LAUNCHED();
}

void add_inplace(const Stream& s, float* x, const float* y, std::int64_t n) { add(s, x, x, y, n); }

void sum_of_squares(const Stream& s, double* out, const float* x, std::int64_t n) {
  sums_of_squares(s, out, &x, &n, 1);
}

double sum_of_squares_to_host(const Stream& s, const float* x, std::int64_t n) {
  sum_of_squares(s, s.impl().scalar_sum, x, n);
  return read_back(s, s.impl().scalar_sum);
}

void sum_of_squares_each_to_host(const Stream& s, double* host_out, const float* const* x,
                                 const std::int64_t* n, std::int64_t count) {
  if (count <= 0) return;
  double* sums = s.impl().range_sums.at_least(s.impl().stream, static_cast<std::size_t>(count));
  sums_of_squares(s, sums, x, n, count);
  copy_to_host(s, host_out, sums, static_cast<std::size_t>(count) * sizeof(double));
  s.synchronize();
}

void adamw_step(const Stream& s, float* params, const float* grads, float* m, float* v,
                std::int64_t n, const AdamWConfig& cfg, std::int64_t step) {
  T3D_ASSERT(step >= 1, "AdamW step counts from 1, got ", step);
  if (n <= 0) return;
  adamw_kernel<<<grid_for(n), kBlock, 0, s.impl().stream>>>(params, grads, m, v, n,
                                                            detail::adamw_scalars(cfg, step));
  T3D_CUDA_LAUNCHED();
}

void adamw_step_many(const Stream& s, const AdamWTensor* tensors, std::int64_t count,
                     std::int64_t step) {
  T3D_ASSERT(step >= 1, "AdamW step counts from 1, got ", step);
  for (const multi_tensor::AdamWLaunch& launch : multi_tensor::plan_adamw(tensors, count, step)) {
    T3D_ASSERT(launch.blocks < (std::int64_t{1} << 31), "AdamW chunks ", launch.blocks);
    adamw_many_kernel<<<static_cast<unsigned>(launch.blocks), kBlock, 0, s.impl().stream>>>(launch);
    T3D_CUDA_LAUNCHED();
  }
}

void float_to_bf16(const Stream& s, bf16* out, const float* in, std::int64_t n) {
  if (n <= 0) return;
  to_bf16_kernel<<<grid_for(n), kBlock, 0, s.impl().stream>>>(out, in, n);
  T3D_CUDA_LAUNCHED();
}

void float_to_bf16_many(const Stream& s, const Bf16Cast* casts, std::int64_t count) {
  for (const multi_tensor::CastLaunch& launch : multi_tensor::plan_casts(casts, count)) {
    T3D_ASSERT(launch.blocks < (std::int64_t{1} << 31), "cast chunks ", launch.blocks);
    to_bf16_many_kernel<<<static_cast<unsigned>(launch.blocks), kBlock, 0, s.impl().stream>>>(
        launch);
    T3D_CUDA_LAUNCHED();
  }
}

void bf16_to_float(const Stream& s, float* out, const bf16* in, std::int64_t n) {
  if (n <= 0) return;
  from_bf16_kernel<<<grid_for(n), kBlock, 0, s.impl().stream>>>(out, in, n);
  T3D_CUDA_LAUNCHED();
}

}  // namespace t3d::kernels::cuda
