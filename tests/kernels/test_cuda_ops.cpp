// The CUDA backend against the CPU backend, op by op, on random inputs: bit for bit where
// kernels/cuda/cuda_ops.h promises it, within stated tolerances where sums run in another order,
// and every GPU op twice with the same bits (determinism). Each test needs a GPU and skips with
// the reason where the process sees none.
#include <gtest/gtest.h>

#include <algorithm>
#include <cmath>
#include <cstring>
#include <limits>
#include <string>
#include <type_traits>
#include <utility>
#include <vector>

#include "kernels/arena.h"
#include "kernels/check.h"
#include "kernels/cuda/cuda_ops.h"
#include "kernels/cuda/multi_tensor.h"
#include "kernels/cuda/op_timer.h"
#include "kernels/device.h"
#include "kernels/hash.h"
#include "kernels/ops.h"
#include "kernels/ops_decode.h"
#include "kernels/row_math.h"
#include "tests/kernels/gpu_compare.h"
#include "tests/kernels/reference.h"
#include "tests/kernels/the_gpu.h"

namespace t3d::kernels {
namespace {

namespace gpu = cuda;
using ref::random_floats;

using cuda::testing::the_gpu;

using cuda::testing::Dev;
using cuda::testing::expect_close;
using cuda::testing::expect_same_bits;
using cuda::testing::S;
using cuda::testing::same_bits;

std::vector<std::int32_t> random_tokens(std::size_t n, int lo, int hi, std::uint32_t seed) {
  std::mt19937 rng(seed);
  std::uniform_int_distribution<int> dist(lo, hi - 1);
  std::vector<std::int32_t> t(n);
  for (auto& x : t) x = dist(rng);
  return t;
}

TEST(CudaDevice, RanksShareGpusByLocalRank) {  // host logic: runs everywhere
  EXPECT_EQ(gpu::device_for_local_rank(0, 1), 0);
  EXPECT_EQ(gpu::device_for_local_rank(7, 1), 0);
  EXPECT_EQ(gpu::device_for_local_rank(5, 4), 1);
  EXPECT_THROW(gpu::device_for_local_rank(0, 0), UserError);
}

TEST(CudaDevice, ADeviceArenaNeedsAGpu) {  // runs everywhere: without a GPU it must say so
  if (!the_gpu().devices.empty()) {
    Arena arena(std::size_t{1} << 20, Memory::kDevice);
    EXPECT_EQ(arena.memory(), Memory::kDevice);
    float* x = arena.alloc_floats("x", 1000);
    float* y = arena.alloc_floats("y", 24);
    std::vector<float> h(1024, 1.0f);
    gpu::copy_to_host(S(), h.data(), x, 1024 * sizeof(float));  // x and y lie back to back
    S().synchronize();
    for (float v : h) ASSERT_EQ(v, 0.0f) << "a device arena starts zeroed";
    (void)y;
    EXPECT_THROW(arena.alloc_floats("model.norm.weight", 1 << 20), UserError);
    // The model's regions come from it zeroed, without a host write (which would crash here).
    Arena state_arena(std::size_t{1} << 20, Memory::kDevice);
    const ParamLayout layout({{"w", {3, 5}}, {"b", {7}}});
    const ModelState st = ModelState::allocate(state_arena, layout, true);
    std::vector<float> m(static_cast<std::size_t>(layout.total_floats()), 1.0f);
    gpu::copy_to_host(S(), m.data(), st.adam_m.data(), m.size() * sizeof(float));
    S().synchronize();
    for (float v : m) ASSERT_EQ(v, 0.0f);
    return;
  }
  try {
    Arena arena(std::size_t{1} << 20, Memory::kDevice);
    FAIL() << "a device arena without a GPU";
  } catch (const UserError& e) {
    EXPECT_NE(std::string(e.what()).find("GPU"), std::string::npos) << e.what();
  }
}

TEST(CudaDevice, NamesTheGpu) {
  REQUIRE_GPU();
  const auto& d = the_gpu().devices[0];
  const std::string text = gpu::describe(d);
  std::printf("GPU 0: %s\n", text.c_str());
  EXPECT_NE(text.find(d.name), std::string::npos);
  EXPECT_GT(d.total_bytes, std::size_t{1} << 30);
  EXPECT_GE(d.cc_major, 7);
  // The list asks no GPU for its free memory (that would make a context on each); the GPU a
  // rank uses is asked alone.
  EXPECT_EQ(d.free_bytes, 0u);
  const std::size_t free = gpu::free_bytes_on(0);
  EXPECT_GT(free, 0u);
  EXPECT_LE(free, d.total_bytes);
}

TEST(CudaDevice, OutOfMemoryNamesTheTensor) {
  REQUIRE_GPU();
  try {
    gpu::DeviceMemory huge(std::size_t{1} << 50, "model.layers.0.mlp.up_proj.weight");
    FAIL() << "1 PiB was allocated";
  } catch (const UserError& e) {
    EXPECT_NE(std::string(e.what()).find("up_proj"), std::string::npos) << e.what();
  }
  Dev<float> still_works(std::vector<float>{1.0f, 2.0f});
  EXPECT_EQ(still_works.host()[1], 2.0f);
}

TEST(CudaElementwise, AddAndCastsAreTheCpuBits) {
  REQUIRE_GPU();
  const std::size_t n = 100003;
  auto x = random_floats(n, 1, -3, 3), y = random_floats(n, 2, -3, 3);
  // Rounding edge cases for the casts: NaN, infinities, denormals, ties.
  x[0] = std::numeric_limits<float>::quiet_NaN();
  x[1] = std::numeric_limits<float>::infinity();
  x[2] = -std::numeric_limits<float>::infinity();
  x[3] = std::numeric_limits<float>::denorm_min();
  x[4] = 1.0f + 1.0f / 256.0f;  // a tie in bf16
  x[5] = std::numeric_limits<float>::max();
  Dev<float> dx(x), dy(y), dout(n);
  gpu::add(S(), dout.p(), dx.p(), dy.p(), n);
  std::vector<float> cpu(n);
  add(kCpu, cpu.data(), x.data(), y.data(), n);
  expect_same_bits(dout.host(), cpu, "add");

  Dev<bf16> d16(n);
  gpu::float_to_bf16(S(), d16.p(), dx.p(), n);
  std::vector<bf16> cpu16(n);
  float_to_bf16(cpu16.data(), x.data(), n);
  expect_same_bits(d16.host(), cpu16, "float_to_bf16");
  gpu::bf16_to_float(S(), dout.p(), d16.p(), n);
  bf16_to_float(cpu.data(), cpu16.data(), n);
  expect_same_bits(dout.host(), cpu, "bf16_to_float");
}

TEST(CudaElementwise, StepScalarsAndCopyAreTheCpus) {
  REQUIRE_GPU();
  auto x = random_floats(100001, 51, -3, 3);
  x[3] = std::numeric_limits<float>::quiet_NaN();
  x[99999] = -std::numeric_limits<float>::infinity();
  const Exec exec(GemmKind::kOpenBlasF32, S());
  Dev<float> gx(x), gy(x.size());
  EXPECT_EQ(count_nonfinite(exec, gx.p(), x.size()), 2);
  Dev<double> kept(1);
  sum_in_order_into(exec, kept.p(), gx.p() + 4, 99990);
  const double gpu_sum = kept.host()[0];
  double cpu_sum = 0;
  sum_in_order_into(kCpu, &cpu_sum, x.data() + 4, 99990);
  EXPECT_EQ(std::memcmp(&gpu_sum, &cpu_sum, sizeof gpu_sum), 0) << gpu_sum << " " << cpu_sum;
  copy(exec, gy.p(), gx.p(), x.size());
  expect_same_bits(gy.host(), x, "copy");
}

// A Buffer of a GPU Exec is made, zeroed and grown in the stream's order (no device-wide wait,
// docs/gpu.md): a smaller request keeps what it holds, the grown buffer is zero and
// usable at once by the stream's ops, and a moved Buffer keeps its memory.
TEST(CudaElementwise, ABufferGrowsInTheStreamsOrderZeroed) {
  REQUIRE_GPU();
  const Exec exec(GemmKind::kOpenBlasF32, S());
  Buffer b;
  b.reserve(exec, 1000 * sizeof(float), "test buffer");
  const std::vector<float> ones(1000, 1.0f);
  copy_from_host(exec, b.as<float>(), ones.data(), ones.size() * sizeof(float));
  b.reserve(exec, 500 * sizeof(float), "test buffer (smaller: kept)");
  std::vector<float> back(1000);
  copy_to_host(exec, back.data(), b.as<float>(), back.size() * sizeof(float));
  expect_same_bits(back, ones, "kept");
  b.reserve(exec, 300000 * sizeof(float), "test buffer (grown)");
  Dev<float> copied(300000);
  copy(exec, copied.p(), b.as<float>(), 300000);
  expect_same_bits(copied.host(), std::vector<float>(300000, 0.0f), "grown: zero");
  Buffer moved = std::move(b);
  EXPECT_EQ(b.as<float>(), nullptr);
  EXPECT_EQ(moved.bytes(), 300000 * sizeof(float));
  copy_to_host(exec, back.data(), moved.as<float>(), back.size() * sizeof(float));
  expect_same_bits(back, std::vector<float>(1000, 0.0f), "moved");
}

// Small uploads go through the stream's pinned ring without a wait: more of them than the ring has
// slots, each from a host buffer rewritten at once after the call, each followed by a kernel
// reading what it wrote, land in order and intact; a large upload waits as before. Loss sums kept
// in device memory (sum_in_order_into) cost no wait and have the CPU's bits.
TEST(CudaElementwise, SmallUploadsAreStagedInOrderAndSumsKeptOnTheDevice) {
  REQUIRE_GPU();
  const Exec exec(GemmKind::kOpenBlasF32, S());
  constexpr std::int64_t n = 1000;
  constexpr int kUploads = 3 * gpu::kUploadSlots + 1;
  Dev<float> landed(n), copies(kUploads * n);
  std::vector<float> host(n), want(static_cast<size_t>(kUploads * n));
  for (int u = 0; u < kUploads; ++u) {
    for (std::int64_t i = 0; i < n; ++i)
      host[i] = want[u * n + i] = static_cast<float>(u * 100000 + i);
    copy_from_host(exec, landed.p(), host.data(), n * sizeof(float));
    copy(exec, copies.p() + u * n, landed.p(), n);  // ordered after its upload on the stream
  }
  expect_same_bits(copies.host(), want, "staged uploads, in order");
  const std::int64_t big_n = static_cast<std::int64_t>(kUnwaitedUploadBytes / sizeof(float)) + 5;
  const auto big = random_floats(static_cast<int>(big_n), 54, -1, 1);
  Dev<float> big_landed(big_n);
  const std::int64_t waits = host_waits();
  copy_from_host(exec, big_landed.p(), big.data(), big.size() * sizeof(float));
  EXPECT_EQ(host_waits(), waits + 1) << "a large upload waits";
  expect_same_bits(big_landed.host(), big, "a large upload");
  Dev<double> kept(3);
  for (int i = 0; i < 3; ++i) sum_in_order_into(exec, kept.p() + i, big_landed.p() + i, big_n - 9);
  EXPECT_EQ(host_waits(), waits + 1) << "kept sums";
  const auto sums = kept.host();
  for (int i = 0; i < 3; ++i) {
    double cpu = 0;
    sum_in_order_into(kCpu, &cpu, big.data() + i, big_n - 9);
    EXPECT_EQ(std::memcmp(&sums[i], &cpu, sizeof cpu), 0) << i << ": " << sums[i] << " " << cpu;
  }
}

// The replay's hashes: hash_floats of device memory (each 1 MiB piece hashed by eight GPU
// threads, one per XXH3 accumulator: kernels/xxh3_words.h) is the CPU's libxxhash value, at an
// offset that is only 4-byte aligned, for a part of a piece and for several pieces with a short
// last one, over more pieces than a block takes; a flipped bit changes it.
TEST(CudaElementwise, HashFloatsIsTheCpus) {
  REQUIRE_GPU();
  // 33 pieces and a part: two blocks of the kernel (32 pieces a block).
  const std::int64_t piece = std::int64_t{1} << 18, n = piece * 33 + 77;
  auto x = random_floats(static_cast<int>(n + 1), 52, -3, 3);
  const Exec exec(GemmKind::kOpenBlasF32, S());
  Dev<float> gx(x);
  // Whole inputs on XXH3's short (<= 16 bytes), middle (<= 240) and long paths; pieces with a
  // last one on the long path, on the middle path (20 floats) and on the short one (3).
  for (const std::int64_t len :
       {std::int64_t{0}, std::int64_t{1}, std::int64_t{3}, std::int64_t{59}, std::int64_t{1000},
        piece + 3, piece + 20, piece * 2 + 77, n}) {
    Hash64Stream gpu_hash, cpu_hash;
    hash_floats(exec, gpu_hash, gx.p() + 1, len);
    hash_floats(kCpu, cpu_hash, x.data() + 1, len);
    EXPECT_EQ(gpu_hash.value(), cpu_hash.value()) << len << " floats";
  }
  Hash64Stream before, after;
  hash_floats(exec, before, gx.p(), n);
  flip_bit(exec, gx.p(), n - 5, 3);
  hash_floats(exec, after, gx.p(), n);
  EXPECT_NE(before.value(), after.value());
}

// Snapshot staging's crossing: pieces started into pinned host memory, one wait, the bytes there;
// and the region unpinned at its end (registering the same memory again works).
TEST(CudaElementwise, StartedCopiesIntoPinnedMemoryHoldTheBytesAfterOneWait) {
  REQUIRE_GPU();
  const auto x = random_floats(1 << 20, 53, -3, 3);
  const Exec exec(GemmKind::kOpenBlasF32, S());
  Dev<float> gx(x);
  std::vector<float> host(x.size() + 8, 0.0f);
  for (int round = 0; round < 2; ++round) {
    const PinnedHostRegion pinned(exec, host.data(), host.size() * sizeof(float));
    const std::size_t half = x.size() / 2;
    copy_to_host_started(exec, host.data() + 8, gx.p() + half, half * sizeof(float));
    copy_to_host_started(exec, host.data() + 8 + half, gx.p(), half * sizeof(float));
    wait_for_copies(exec);
    std::vector<float> got(host.begin() + 8, host.end()), want(x.begin() + half, x.end());
    want.insert(want.end(), x.begin(), x.begin() + half);
    expect_same_bits(got, want, "staged pieces");
  }
}

// The multi-tensor plan (host code, runs everywhere): ranges in order, 24 a launch, empty ones
// skipped, a block per 4096-element chunk numbered through the launch, each range's scalars.
TEST(CudaElementwise, MultiTensorAdamWPlansItsLaunches) {
  std::vector<float> buf(10);
  std::vector<AdamWTensor> tensors;
  std::int64_t blocks_wanted = 0;
  for (int j = 0; j < 30; ++j) {
    const std::int64_t n = j == 5 ? 0 : j == 7 ? 3 * cuda::multi_tensor::kChunk + 1 : 100 + j;
    AdamWConfig cfg;
    cfg.lr = 1e-3f * (j + 1);
    tensors.push_back({buf.data() + j % 10, buf.data(), buf.data(), buf.data(), n, cfg});
    if (j < 25) blocks_wanted += (n + cuda::multi_tensor::kChunk - 1) / cuda::multi_tensor::kChunk;
  }
  const auto launches = cuda::multi_tensor::plan_adamw(tensors.data(), 30, 4);
  ASSERT_EQ(launches.size(), 2u);
  EXPECT_EQ(launches[0].count, 24);
  EXPECT_EQ(launches[1].count, 5);               // 29 non-empty ranges
  EXPECT_EQ(launches[0].blocks, blocks_wanted);  // ranges 0..24 less the empty 5th
  EXPECT_EQ(launches[0].first_block[0], 0);
  EXPECT_EQ(launches[0].first_block[6], 6);   // range 7 (the 7th kept): after six 1-chunk ones
  EXPECT_EQ(launches[0].first_block[7], 10);  // range 7 took 4 chunks
  EXPECT_EQ(launches[0].ranges[5].n, tensors[6].n);  // range 5 skipped
  EXPECT_EQ(launches[1].ranges[0].params, tensors[25].params);
  const auto want = detail::adamw_scalars(tensors[29].cfg, 4);
  EXPECT_EQ(launches[1].ranges[4].scalars.step_size, want.step_size);
  EXPECT_EQ(launches[1].ranges[4].scalars.inv_sqrt_bc2, want.inv_sqrt_bc2);
}

// Many ranges in few launches: each range the CPU's per-range bits, over more ranges than one
// launch takes, ranges longer than a chunk, an empty one, two settings (decay and none).
TEST(CudaElementwise, MultiTensorAdamWIsTheCpuBits) {
  REQUIRE_GPU();
  const std::size_t total = 200000;
  auto p = random_floats(total, 31), g = random_floats(total, 32, -1e-2f, 1e-2f);
  std::vector<float> m(total, 0.0f), v(total, 0.0f);
  Dev<float> dp(p), dg(g), dm(m), dv(v);
  std::vector<AdamWTensor> cpu, gpu_ranges;
  std::size_t at = 0;
  for (int j = 0; j < 40; ++j) {
    const std::size_t n = j == 3 ? 0 : j % 9 == 0 ? 9000 + j : 1000 + 37 * j;
    AdamWConfig cfg;
    cfg.lr = 1e-3f;
    cfg.weight_decay = j % 2 ? 0.0f : 0.1f;
    cfg.grad_scale = 0.7f;
    const auto n64 = static_cast<std::int64_t>(n);
    cpu.push_back({p.data() + at, g.data() + at, m.data() + at, v.data() + at, n64, cfg});
    gpu_ranges.push_back({dp.p() + at, dg.p() + at, dm.p() + at, dv.p() + at, n64, cfg});
    at += n;
  }
  ASSERT_LE(at, total);
  for (std::int64_t step = 1; step <= 3; ++step) {
    adamw_step_many(kCpu, cpu.data(), 40, step);
    adamw_step_many(Exec(GemmKind::kOpenBlasF32, S()), gpu_ranges.data(), 40, step);
  }
  expect_same_bits(dp.host(), p, "params");
  expect_same_bits(dm.host(), m, "exp_avg");
  expect_same_bits(dv.host(), v, "exp_avg_sq");
}

// 130 casts over one buffer, as the weights' bf16 copy has them (Model::round_weights): one empty,
// one of three chunks, gaps between them that no cast writes, ties to even among the values.
struct ManyCasts {
  std::vector<float> x = random_floats(400000, 41);
  std::vector<std::int64_t> at, n;
  ManyCasts() {
    for (std::size_t i = 0; i < x.size(); i += 97) x[i] = 1.0f + 1.0f / 256.0f;  // ties in bf16
    std::int64_t used = 0;
    for (int j = 0; j < 130; ++j) {
      at.push_back(used);
      n.push_back(j == 4 ? 0 : j == 9 ? 2 * cuda::multi_tensor::kChunk + 5 : 700 + 13 * j);
      used += n.back() + 3;
    }
    EXPECT_LE(used, static_cast<std::int64_t>(x.size()));
  }
  std::vector<Bf16Cast> casts(bf16* out, const float* in) const {
    std::vector<Bf16Cast> c;
    for (std::size_t j = 0; j < at.size(); ++j) c.push_back({out + at[j], in + at[j], n[j]});
    return c;
  }
};

// The plan (host code): 96 ranges a launch, empty ones skipped, chunks numbered through the
// launch as AdamW's; and on the CPU many casts are the single casts.
TEST(CudaElementwise, ManyCastsPlanTheirLaunches) {
  ManyCasts m;
  std::vector<bf16> out(m.x.size(), 0);
  const std::vector<Bf16Cast> casts = m.casts(out.data(), m.x.data());
  const auto launches = cuda::multi_tensor::plan_casts(casts.data(), 130);
  ASSERT_EQ(launches.size(), 2u);
  EXPECT_EQ(launches[0].count, 96);
  EXPECT_EQ(launches[1].count, 33);           // 129 non-empty ranges
  EXPECT_EQ(launches[0].first_block[8], 8);   // range 9, the 9th kept: after eight 1-chunk ones
  EXPECT_EQ(launches[0].first_block[9], 11);  // range 9 took 3 chunks
  EXPECT_EQ(launches[1].ranges[0].in, casts[97].in);
  std::int64_t lo = 0, hi = 0;
  EXPECT_EQ(launches[0].range_of(10, lo, hi), 8);  // range 9's last chunk: its 5 elements
  EXPECT_EQ(lo, 2 * cuda::multi_tensor::kChunk);
  EXPECT_EQ(hi, 2 * cuda::multi_tensor::kChunk + 5);
  float_to_bf16_many(kCpu, casts.data(), 130);
  for (std::size_t j = 0; j < casts.size(); ++j) {
    std::vector<bf16> one(static_cast<std::size_t>(casts[j].n));
    float_to_bf16(one.data(), casts[j].in, casts[j].n);
    ASSERT_TRUE(std::equal(one.begin(), one.end(), casts[j].out)) << "range " << j;
  }
  EXPECT_EQ(out[static_cast<std::size_t>(m.at[1]) - 1], 0);  // a gap: untouched
}

// On the GPU: every range the CPU's rounding, the gaps untouched, over two launches.
TEST(CudaElementwise, ManyCastsAreTheCpuBits) {
  REQUIRE_GPU();
  ManyCasts m;
  std::vector<bf16> cpu(m.x.size(), 0);
  const std::vector<Bf16Cast> cpu_casts = m.casts(cpu.data(), m.x.data());
  float_to_bf16_many(kCpu, cpu_casts.data(), 130);
  Dev<float> dx(m.x);
  Dev<bf16> d16(std::vector<bf16>(m.x.size(), 0));
  const std::vector<Bf16Cast> gpu_casts = m.casts(d16.p(), dx.p());
  float_to_bf16_many(Exec(GemmKind::kOpenBlasF32, S()), gpu_casts.data(), 130);
  expect_same_bits(d16.host(), cpu, "float_to_bf16_many");
}

TEST(CudaElementwise, AdamWIsTheCpuBits) {
  REQUIRE_GPU();
  const std::size_t n = 50021;
  auto p = random_floats(n, 3), g = random_floats(n, 4, -1e-2f, 1e-2f);
  std::vector<float> m(n, 0.0f), v(n, 0.0f);
  Dev<float> dp(p), dg(g), dm(m), dv(v);
  AdamWConfig cfg;
  cfg.lr = 1e-3f;
  cfg.weight_decay = 0.1f;
  cfg.grad_scale = 0.7f;
  for (std::int64_t step = 1; step <= 5; ++step) {
    adamw_step(kCpu, p.data(), g.data(), m.data(), v.data(), n, cfg, step);
    gpu::adamw_step(S(), dp.p(), dg.p(), dm.p(), dv.p(), n, cfg, step);
  }
  expect_same_bits(dp.host(), p, "params");
  expect_same_bits(dm.host(), m, "exp_avg");
  expect_same_bits(dv.host(), v, "exp_avg_sq");
}

TEST(CudaElementwise, SumOfSquaresIsDeterministicAndClose) {
  REQUIRE_GPU();
  for (std::size_t n : {std::size_t{1}, std::size_t{1000}, std::size_t{3000017}}) {
    const auto x = random_floats(n, 5);
    Dev<float> dx(x);
    Dev<double> out(2);
    gpu::sum_of_squares(S(), out.p(), dx.p(), n);
    gpu::sum_of_squares(S(), out.p() + 1, dx.p(), n);
    const auto got = out.host();
    const double cpu = sum_of_squares(kCpu, x.data(), n);
    EXPECT_EQ(std::memcmp(&got[0], &got[1], sizeof(double)), 0) << "n=" << n;
    EXPECT_NEAR(got[0], cpu, 1e-12 * cpu) << "n=" << n;  // double sums of n <= 3e6 terms
  }
}

// The ranges' sums in one crossing: each the bits of sum_of_squares alone (ranges of 0, 1 and
// many floats, one range twice, more ranges than one launch takes (64) and than any earlier call:
// the device slots grow).
TEST(CudaElementwise, SumOfSquaresOfEachRangeIsTheSingleSum) {
  REQUIRE_GPU();
  const auto x = random_floats(200000, 15);
  Dev<float> dx(x);
  std::vector<const float*> ranges;
  std::vector<std::int64_t> sizes;
  for (std::int64_t j = 0; j < 70; ++j) {
    ranges.push_back(dx.p() + 2000 * j);
    sizes.push_back(j == 3 ? 0 : j == 4 ? 1 : 1000 + 37 * j);
  }
  ranges.push_back(ranges[7]), sizes.push_back(sizes[7]);
  std::vector<double> got(ranges.size(), -1.0);
  sum_of_squares_each(Exec(GemmKind::kOpenBlasF32, S()), got.data(), ranges.data(), sizes.data(),
                      static_cast<std::int64_t>(ranges.size()));
  for (std::size_t j = 0; j < ranges.size(); ++j) {
    const double single = gpu::sum_of_squares_to_host(S(), ranges[j], sizes[j]);
    EXPECT_EQ(std::memcmp(&got[j], &single, sizeof single), 0) << "range " << j;
  }
  EXPECT_EQ(got[3], 0.0);
}

TEST(CudaRows, EmbeddingIsTheCpuBits) {
  REQUIRE_GPU();
  const int N = 301, C = 96, V = 50, lo = 10, hi = 35;  // a vocab slice [10, 35), repeated tokens
  const auto tokens = random_tokens(N, 0, V, 6);
  const auto wte = random_floats(static_cast<std::size_t>(hi - lo) * C, 7);
  const auto dout = random_floats(static_cast<std::size_t>(N) * C, 8);
  auto dwte = random_floats(wte.size(), 9);  // accumulated into
  Dev<std::int32_t> dt(tokens);
  Dev<float> dw(wte), dd(dout), ddw(dwte), dout_e(static_cast<std::size_t>(N) * C);
  gpu::embedding_forward(S(), dout_e.p(), dt.p(), dw.p(), N, C, lo, hi);
  gpu::embedding_backward(S(), ddw.p(), dd.p(), dt.p(), N, C, lo, hi);
  std::vector<float> out(static_cast<std::size_t>(N) * C);
  embedding_forward(kCpu, out.data(), tokens.data(), wte.data(), N, C, lo, hi);
  embedding_backward(kCpu, dwte.data(), dout.data(), tokens.data(), N, C, lo, hi);
  expect_same_bits(dout_e.host(), out, "embedding_forward");
  expect_same_bits(ddw.host(), dwte, "embedding_backward");
}

TEST(CudaRows, RmsNormIsTheCpuBitsItsWeightGradientWithinRounding) {
  REQUIRE_GPU();
  for (const auto& [N, C] : {std::pair{37, 7}, std::pair{300, 64}, std::pair{37, 1000}}) {
    // 300 rows: 3 chunks of the GPU's weight gradient
    const auto x = random_floats(static_cast<std::size_t>(N) * C, 10, -2, 2);
    const auto w = random_floats(C, 11, 0.5f, 1.5f);
    const auto dy = random_floats(x.size(), 12);
    auto dx = random_floats(x.size(), 13), dw = random_floats(C, 14);
    Dev<float> gx(x), gw(w), gdy(dy), gdx(dx), gdw(dw), gout(x.size()), grstd(N);
    std::vector<float> out(x.size()), rstd(N);
    std::vector<bf16> out16(x.size());
    Dev<bf16> gout16(x.size());
    rmsnorm_forward(kCpu, out.data(), rstd.data(), x.data(), w.data(), N, C, 1e-5f, out16.data());
    gpu::rmsnorm_forward(S(), gout.p(), grstd.p(), gx.p(), gw.p(), N, C, 1e-5f, gout16.p());
    expect_same_bits(gout.host(), out, "rmsnorm out");
    expect_same_bits(grstd.host(), rstd, "rmsnorm rstd");
    EXPECT_EQ(gout16.host(), out16) << "rmsnorm out's bf16 copy";
    for (Out mode : {Out::kAccumulate, Out::kWrite}) {
      rmsnorm_backward(kCpu, dx.data(), dw.data(), dy.data(), x.data(), w.data(), rstd.data(), N, C,
                       mode);
      gpu::rmsnorm_backward(S(), gdx.p(), gdw.p(), gdy.p(), gx.p(), gw.p(), grstd.p(), N, C, mode);
      expect_same_bits(gdx.host(), dx, "rmsnorm dinp");
      // dweight sums the rows in chunks of 128 on the GPU, in one sequence on the CPU: the same
      // fp32 terms regrouped, |difference| <= N 2^-24 max_c sum_i |term| (~1e-4 here), seen ~1e-6.
      expect_close(gdw.host(), dw, 1e-5, 1e-4, "rmsnorm dweight");
    }
  }
}

TEST(CudaRows, RopeIsTheCpuBits) {
  REQUIRE_GPU();
  const int B = 2, T = 19, H = 3, D = 16, offset = 40;
  std::vector<float> table(static_cast<std::size_t>(offset + T) * D);
  rope_table(table.data(), offset + T, D, 10000.0);
  const auto x = random_floats(static_cast<std::size_t>(B) * T * H * D, 15);
  Dev<float> gt(table), gx(x), gy(x.size()), gback(x.size());
  std::vector<float> y(x.size()), back(x.size());
  rope_forward(kCpu, y.data(), x.data(), table.data(), B, T, H, D, offset);
  rope_backward(kCpu, back.data(), y.data(), table.data(), B, T, H, D, offset);
  gpu::rope_forward(S(), gy.p(), gx.p(), gt.p(), B, T, H, D, offset);
  gpu::rope_backward(S(), gback.p(), gy.p(), gt.p(), B, T, H, D, offset);
  expect_same_bits(gy.host(), y, "rope_forward");
  expect_same_bits(gback.host(), back, "rope_backward");
}

// SwiGLU: the GPU evaluates row_math.h as written; this file is baseline x86-64 (no FMA), so the
// same functions here give the GPU's bits. The CPU op may contract to FMAs (AVX2/AVX-512): close.
TEST(CudaRows, SwiGluIsRowMathBitsAndCloseToTheCpu) {
  REQUIRE_GPU();
  const std::size_t n = 70001;
  const auto g = random_floats(n, 16, -8, 8), u = random_floats(n, 17), dh = random_floats(n, 18);
  Dev<float> gg(g), gu(u), gdh(dh), gh(n), gdg(n), gdu(n);
  gpu::swiglu_forward(S(), gh.p(), gg.p(), gu.p(), n);
  gpu::swiglu_backward(S(), gdg.p(), gdu.p(), gdh.p(), gg.p(), gu.p(), n);
  std::vector<float> h(n), dg(n), du(n), h_cpu(n), dg_cpu(n), du_cpu(n);
  for (std::size_t i = 0; i < n; ++i) {
    h[i] = detail::swiglu_value(g[i], u[i]);
    detail::swiglu_grads(dh[i], g[i], u[i], dg[i], du[i]);
  }
  expect_same_bits(gh.host(), h, "swiglu h");
  expect_same_bits(gdg.host(), dg, "swiglu dgate");
  expect_same_bits(gdu.host(), du, "swiglu dup");
  swiglu_forward(kCpu, h_cpu.data(), g.data(), u.data(), n);
  swiglu_backward(kCpu, dg_cpu.data(), du_cpu.data(), dh.data(), g.data(), u.data(), n);
  expect_close(gh.host(), h_cpu, 1e-6, 1e-7, "swiglu h vs CPU");
  expect_close(gdg.host(), dg_cpu, 1e-6, 1e-7, "swiglu dgate vs CPU");

  Dev<bf16> h16(n), g16(n), u16(n), dg16(n), du16(n);
  gpu::swiglu_forward_bf16(S(), h16.p(), g16.p(), u16.p(), gg.p(), gu.p(), n);
  gpu::swiglu_backward_bf16(S(), dg16.p(), du16.p(), gdh.p(), g16.p(), u16.p(), n);
  std::vector<bf16> eh(n), eg(n), eu(n), edg(n), edu(n);
  for (std::size_t i = 0; i < n; ++i) {
    eh[i] = detail::bf16_of(detail::swiglu_value(g[i], u[i]));
    eg[i] = detail::bf16_of(g[i]);
    eu[i] = detail::bf16_of(u[i]);
    float a, b;
    detail::swiglu_grads(dh[i], detail::float_of(eg[i]), detail::float_of(eu[i]), a, b);
    edg[i] = detail::bf16_of(a);
    edu[i] = detail::bf16_of(b);
  }
  expect_same_bits(h16.host(), eh, "swiglu_bf16 h");
  expect_same_bits(g16.host(), eg, "swiglu_bf16 gate");
  expect_same_bits(dg16.host(), edg, "swiglu_bf16 dgate");
  expect_same_bits(du16.host(), edu, "swiglu_bf16 dup");
}

// The three GEMMs of a linear layer against the CPU's OpenBLAS fp32 (and, for bf16, against the
// CPU fed the same rounded inputs): the sums run in another order, so within fp32 rounding of a
// K-term sum; and twice on the GPU with the same bits.
TEST(CudaLinear, GemmsMatchTheCpuAndRepeatTheirBits) {
  REQUIRE_GPU();
  const int N = 129, in = 200, out = 72;
  for (auto p : {gpu::GemmPrecision::kFp32, gpu::GemmPrecision::kBf16}) {
    const bool bf = p == gpu::GemmPrecision::kBf16;
    auto x = random_floats(static_cast<std::size_t>(N) * in, 19);
    auto w = random_floats(static_cast<std::size_t>(out) * in, 20);
    auto dy = random_floats(static_cast<std::size_t>(N) * out, 21);
    const auto dw0 = random_floats(w.size(), 22);
    Dev<float> gx(x), gw(w), gdy(dy), gy(static_cast<std::size_t>(N) * out), gdx(x.size()),
        gdw(dw0), gy2(static_cast<std::size_t>(N) * out);
    gpu::linear_forward(S(), p, gy.p(), gx.p(), gw.p(), N, in, out);
    gpu::linear_forward(S(), p, gy2.p(), gx.p(), gw.p(), N, in, out);
    gpu::linear_backward_input(S(), p, gdx.p(), gdy.p(), gw.p(), N, in, out);
    gpu::linear_backward_weight(S(), p, gdw.p(), gdy.p(), gx.p(), N, in, out);
    expect_same_bits(gy.host(), gy2.host(), "GPU forward twice");
    if (bf) {  // the CPU reference gets the inputs the GPU's GEMMs read
      x = ref::widened(ref::rounded(x));
      w = ref::widened(ref::rounded(w));
      dy = ref::widened(ref::rounded(dy));
    }
    std::vector<float> y(static_cast<std::size_t>(N) * out), dx(x.size()), dw = dw0;
    linear_forward(ref::kFp32, y.data(), x.data(), w.data(), N, in, out);
    linear_backward_input(ref::kFp32, dx.data(), dy.data(), w.data(), N, in, out);
    linear_backward_weight(ref::kFp32, dw.data(), dy.data(), x.data(), N, in, out);
    // |terms| <= 1, K <= 200 terms: fp32 sums in any order agree to ~K·2^-24 of the sum of |terms|.
    expect_close(gy.host(), y, 1e-5, 2e-5, bf ? "bf16 forward" : "fp32 forward");
    expect_close(gdx.host(), dx, 1e-5, 2e-5, bf ? "bf16 backward input" : "fp32 backward input");
    expect_close(gdw.host(), dw, 1e-5, 2e-5, bf ? "bf16 backward weight" : "fp32 backward weight");
  }
}

// y = residual + x wᵀ in one cuBLASLt call (the epilogue's C): the CPU's product plus the
// residual within the GEMM's rounding, twice the same bits, the residual left as it was.
TEST(CudaLinear, TheResidualInTheEpilogueIsTheProductPlusTheResidual) {
  REQUIRE_GPU();
  const int N = 129, in = 200, out = 72;
  for (auto p : {gpu::GemmPrecision::kFp32, gpu::GemmPrecision::kBf16}) {
    const bool bf = p == gpu::GemmPrecision::kBf16;
    auto x = random_floats(static_cast<std::size_t>(N) * in, 23);
    auto w = random_floats(static_cast<std::size_t>(out) * in, 24);
    const auto residual = random_floats(static_cast<std::size_t>(N) * out, 25, -3, 3);
    Dev<float> gx(x), gw(w), gr(residual), gy(residual.size()), gy2(residual.size());
    gpu::linear_forward(S(), p, gy.p(), gx.p(), gw.p(), N, in, out, Out::kWrite, nullptr, nullptr,
                        gr.p());
    gpu::linear_forward(S(), p, gy2.p(), gx.p(), gw.p(), N, in, out, Out::kWrite, nullptr, nullptr,
                        gr.p());
    expect_same_bits(gy.host(), gy2.host(), "GPU residual forward twice");
    expect_same_bits(gr.host(), residual, "the residual, read only");
    if (bf) {
      x = ref::widened(ref::rounded(x));
      w = ref::widened(ref::rounded(w));
    }
    std::vector<float> y(residual.size());
    linear_forward(ref::kFp32, y.data(), x.data(), w.data(), N, in, out);
    for (std::size_t i = 0; i < y.size(); ++i) y[i] += residual[i];
    expect_close(gy.host(), y, 1e-5, 2e-5, bf ? "bf16 residual forward" : "fp32 residual forward");
  }
}

TEST(CudaLoss, CrossEntropyMatchesTheCpuWholeAndVocabParallel) {
  REQUIRE_GPU();
  const int N = 41, V = 1003;
  const auto logits = random_floats(static_cast<std::size_t>(N) * V, 23, -6, 6);
  auto targets = random_tokens(N, 0, V, 24);
  targets[3] = kIgnoreIndex;
  const float scale = 1.0f / (N - 1);
  Dev<float> gl(logits), glosses(N);
  Dev<std::int32_t> gt(targets);
  gpu::cross_entropy_fused(S(), gl.p(), glosses.p(), gt.p(), N, V, scale);
  std::vector<float> l = logits, losses(N);
  cross_entropy_fused(kCpu, l.data(), losses.data(), targets.data(), N, V, scale);
  expect_close(glosses.host(), losses, 1e-6, 1e-6, "fused losses");
  expect_close(gl.host(), l, 1e-5, 1e-9, "fused dlogits");
  // Two vocab halves, the all-reduces done here on the host: the fused result again.
  const int V0 = 500;
  std::vector<float> maxes[2], sums[2], tls[2], grads[2];
  for (int part = 0; part < 2; ++part) {
    const int lo = part ? V0 : 0, width = part ? V - V0 : V0;
    std::vector<float> slice(static_cast<std::size_t>(N) * width);
    for (int i = 0; i < N; ++i)
      std::memcpy(&slice[static_cast<std::size_t>(i) * width],
                  &logits[static_cast<std::size_t>(i) * V + lo], width * sizeof(float));
    Dev<float> gs(slice), gm(N), gtl(N);
    gpu::ce_local_max(S(), gm.p(), gs.p(), N, width);
    gpu::ce_local_target_logit(S(), gtl.p(), gs.p(), gt.p(), N, width, lo);
    maxes[part] = gm.host();
    tls[part] = gtl.host();
    grads[part] = slice;
  }
  std::vector<float> row_max(N), target_logit(N), sum_exp(N, 0.0f), losses_vp(N);
  for (int i = 0; i < N; ++i) {
    row_max[i] = std::max(maxes[0][i], maxes[1][i]);
    target_logit[i] = tls[0][i] + tls[1][i];
  }
  for (int part = 0; part < 2; ++part) {
    const int lo = part ? V0 : 0, width = part ? V - V0 : V0;
    Dev<float> gs(grads[part]), gm(row_max), gse(N);
    gpu::ce_local_sum_exp(S(), gse.p(), gs.p(), gm.p(), N, width);
    sums[part] = gse.host();
    (void)lo;
  }
  for (int i = 0; i < N; ++i) sum_exp[i] = sums[0][i] + sums[1][i];
  for (int part = 0; part < 2; ++part) {
    const int lo = part ? V0 : 0, width = part ? V - V0 : V0;
    Dev<float> gs(grads[part]), gm(row_max), gse(sum_exp), gtl(target_logit), gls(N);
    gpu::ce_loss_and_grad(S(), gs.p(), gls.p(), gt.p(), gm.p(), gse.p(), gtl.p(), N, width, lo,
                          scale);
    const auto g = gs.host();
    losses_vp = gls.host();
    for (int i = 0; i < N; ++i)
      for (int j = 0; j < width; ++j)
        EXPECT_NEAR(g[static_cast<std::size_t>(i) * width + j],
                    l[static_cast<std::size_t>(i) * V + lo + j], 1e-5 * scale + 1e-9)
            << "row " << i << " column " << lo + j;
  }
  expect_close(losses_vp, losses, 1e-6, 1e-6, "vocab-parallel losses");
}

// A target outside the vocabulary (which the CPU op refuses) touches nothing outside its row on the
// GPU: its loss is NaN, and the rows around it are as with a valid target there.
TEST(CudaLoss, ATargetOutsideTheVocabularyGivesNanAndStaysInItsRow) {
  REQUIRE_GPU();
  const int N = 3, V = 257;
  const auto logits = random_floats(static_cast<std::size_t>(N) * V, 25, -6, 6);
  for (const std::int32_t bad : {-5, V, V + 40}) {
    std::vector<std::int32_t> good = {7, 8, 9}, targets = {7, bad, 9};
    Dev<float> gl(logits), glosses(N), wl(logits), wlosses(N);
    Dev<std::int32_t> gt(targets), wt(good);
    gpu::cross_entropy_fused(S(), gl.p(), glosses.p(), gt.p(), N, V, 0.5f);
    gpu::cross_entropy_fused(S(), wl.p(), wlosses.p(), wt.p(), N, V, 0.5f);
    const auto losses = glosses.host(), want_losses = wlosses.host();
    EXPECT_TRUE(std::isnan(losses[1])) << bad;
    EXPECT_EQ(losses[0], want_losses[0]) << bad;
    EXPECT_EQ(losses[2], want_losses[2]) << bad;
    const auto g = gl.host(), want = wl.host();
    for (int r : {0, 2})
      for (int j = 0; j < V; ++j)
        ASSERT_EQ(g[static_cast<std::size_t>(r) * V + j], want[static_cast<std::size_t>(r) * V + j])
            << "target " << bad << ": row " << r << " column " << j;
  }
}

// The fp32 tiles' rows by what a block may hold: the large tiles where their backward fits (H100
// and H200: 227 KiB; A100: 163 KiB), half as many on sm_86 and sm_89 (99 KiB), whose blocks
// cannot opt in to the large ones' 162 KiB and 137 KiB.
TEST(CudaAttention, TilesFitTheGpusSharedMemory) {  // host code: runs everywhere
  constexpr std::size_t kHopper = 232448, kA100 = 166912, kAda = 101376;
  EXPECT_EQ(gpu::attention_fp32_tile(128, kHopper), 64);
  EXPECT_EQ(gpu::attention_fp32_tile(64, kHopper), 64);
  EXPECT_EQ(gpu::attention_fp32_tile(256, kHopper), 32);
  EXPECT_EQ(gpu::attention_fp32_tile(128, kA100), 64);
  EXPECT_EQ(gpu::attention_fp32_tile(160, kA100), 32);
  EXPECT_EQ(gpu::attention_fp32_tile(128, kAda), 32);
  EXPECT_EQ(gpu::attention_fp32_tile(40, kAda), 32);
  EXPECT_EQ(gpu::attention_fp32_tile(256, kAda), 16);
}

// Attention against the CPU's fp32 tiles: grouped heads, several key chunks, a context-parallel
// chunk (queries at positions 70.., keys 0..), head dims below, at and above one chunk of threads;
// with this GPU's tiles and with the small ones of GPUs with less shared memory a block.
TEST(CudaAttention, MatchesTheCpuAndRepeatsItsBits) {
  REQUIRE_GPU();
  struct Case {
    std::int64_t B, T, H, Hkv, D, q_pos, kv_len;
  };
  for (const Case c : {Case{2, 150, 4, 2, 64, 0, 0}, Case{1, 60, 2, 1, 40, 70, 130},
                       Case{1, 33, 2, 2, 160, 0, 0}}) {
    AttentionShape s;
    s.B = c.B, s.T = c.T, s.n_heads = c.H, s.n_kv_heads = c.Hkv, s.head_dim = c.D;
    s.q_pos = c.q_pos, s.kv_len = c.kv_len, s.tile = 32;
    const std::size_t nq = c.B * c.T * c.H * c.D, nkv = c.B * s.keys() * c.Hkv * c.D;
    const auto q = random_floats(nq, 25, -2, 2), k = random_floats(nkv, 26, -2, 2),
               v = random_floats(nkv, 27), dout = random_floats(nq, 28);
    std::vector<float> out(nq), lse(c.B * c.H * c.T), dq(nq), dk(nkv), dv(nkv),
        scratch(attention_scratch_floats(s));
    ref::with_threads(1, [&] {
      attention_forward(ref::kFp32, out.data(), lse.data(), q.data(), k.data(), v.data(),
                        scratch.data(), s);
      attention_backward(ref::kFp32, dq.data(), dk.data(), dv.data(), dout.data(), q.data(),
                         k.data(), v.data(), out.data(), lse.data(), scratch.data(), s);
    });
    for (const int tile : {0, c.D <= 128 ? 32 : 16}) {  // 0: this GPU's
      Dev<float> gq(q), gk(k), gv(v), gdo(dout), go(nq), glse(lse.size()), gdq(nq), gdk(nkv),
          gdv(nkv), gdq2(nq);
      gpu::attention_forward(S(), go.p(), glse.p(), gq.p(), gk.p(), gv.p(), s, tile);
      gpu::attention_backward(S(), gdq.p(), gdk.p(), gdv.p(), gdo.p(), gq.p(), gk.p(), gv.p(),
                              go.p(), glse.p(), s, tile);
      const std::string at = "B" + std::to_string(c.B) + " T" + std::to_string(c.T) + " D" +
                             std::to_string(c.D) + " q_pos" + std::to_string(c.q_pos) + " tile " +
                             std::to_string(tile);
      expect_close(go.host(), out, 1e-4, 1e-5, ("out " + at).c_str());
      expect_close(glse.host(), lse, 1e-5, 1e-5, ("lse " + at).c_str());
      expect_close(gdq.host(), dq, 1e-4, 1e-4, ("dq " + at).c_str());
      expect_close(gdk.host(), dk, 1e-4, 1e-4, ("dk " + at).c_str());
      expect_close(gdv.host(), dv, 1e-4, 1e-4, ("dv " + at).c_str());
      Dev<float> gdk2(nkv), gdv2(nkv);
      gpu::attention_backward(S(), gdq2.p(), gdk2.p(), gdv2.p(), gdo.p(), gq.p(), gk.p(), gv.p(),
                              go.p(), glse.p(), s, tile);
      expect_same_bits(gdq2.host(), gdq.host(), ("dq twice " + at).c_str());
      expect_same_bits(gdk2.host(), gdk.host(), ("dk twice " + at).c_str());
    }
  }
}

TEST(CudaAttention, DecodingMatchesTheCpu) {
  REQUIRE_GPU();
  const std::int64_t n = 150, H = 4, Hkv = 2, D = 64;
  const auto q = random_floats(H * D, 29, -2, 2), kc = random_floats(n * Hkv * D, 30, -2, 2),
             vc = random_floats(n * Hkv * D, 31);
  std::vector<float> out(H * D), scores(n);
  attention_decode(kCpu, out.data(), q.data(), kc.data(), vc.data(), scores.data(), n, H, Hkv, D);
  Dev<float> gq(q), gk(kc), gv(vc), gout(H * D), glse(H), gout2(H * D), gscratch(n);
  gpu::attention_decode(S(), gout.p(), gq.p(), gk.p(), gv.p(), glse.p(), n, H, Hkv, D);
  expect_close(gout.host(), out, 1e-5, 1e-6, "decode");
  // The op given a GPU Exec is the twin.
  attention_decode(Exec(GemmKind::kOpenBlasF32, S()), gout2.p(), gq.p(), gk.p(), gv.p(),
                   gscratch.p(), n, H, Hkv, D);
  expect_same_bits(gout2.host(), gout.host(), "attention_decode dispatched");
}

// The kernel layer's own ops (kernels/ops.h) given a GPU Exec run the CUDA twins on device memory:
// the same bits as calling the twins, and the CPU's results within their tolerances.
TEST(CudaDispatch, OpsGivenAGpuExecRunOnTheGpu) {
  REQUIRE_GPU();
  const int N = 64, in = 96, out = 80;
  const auto x = random_floats(static_cast<std::size_t>(N) * in, 32);
  const auto w = random_floats(static_cast<std::size_t>(out) * in, 33);
  Arena arena(std::size_t{8} << 20, Memory::kDevice);
  float* dx = arena.alloc_floats("x", x.size());
  float* dw = arena.alloc_floats("w", w.size());
  float* dy = arena.alloc_floats("y", static_cast<std::size_t>(N) * out);
  float* dy2 = arena.alloc_floats("y2", static_cast<std::size_t>(N) * out);
  gpu::copy_to_device(S(), dx, x.data(), x.size() * sizeof(float));
  gpu::copy_to_device(S(), dw, w.data(), w.size() * sizeof(float));
  for (GemmKind kind : {GemmKind::kOpenBlasF32, GemmKind::kOneDnnBf16}) {
    const Exec exec(kind, S());
    linear_forward(exec, dy, dx, dw, N, in, out);
    gpu::linear_forward(S(), gpu::gemm_precision(exec), dy2, dx, dw, N, in, out);
    std::vector<float> got(static_cast<std::size_t>(N) * out), twin(got.size());
    gpu::copy_to_host(S(), got.data(), dy, got.size() * sizeof(float));
    gpu::copy_to_host(S(), twin.data(), dy2, twin.size() * sizeof(float));
    S().synchronize();
    expect_same_bits(got, twin, gemm_kind_name(kind));
    if (kind == GemmKind::kOpenBlasF32) {
      std::vector<float> cpu(got.size());
      linear_forward(ref::kFp32, cpu.data(), x.data(), w.data(), N, in, out);
      expect_close(got, cpu, 1e-5, 2e-5, "dispatched forward vs CPU");
    }
  }
  AttentionShape s;
  s.B = 1, s.T = 70, s.n_heads = 2, s.n_kv_heads = 1, s.head_dim = 32;
  const auto q = random_floats(70 * 2 * 32, 34), kv = random_floats(70 * 32, 35);
  Dev<float> gq(q), gk(kv), gv(kv), go(q.size()), glse(2 * 70), go2(q.size()), glse2(2 * 70);
  attention_forward(Exec(GemmKind::kOpenBlasF32, S()), go.p(), glse.p(), gq.p(), gk.p(), gv.p(),
                    nullptr, s);
  gpu::attention_forward(S(), go2.p(), glse2.p(), gq.p(), gk.p(), gv.p(), s);
  expect_same_bits(go.host(), go2.host(), "dispatched attention");
}

// Every other op with a CUDA twin, given a GPU Exec: the twin's bits (so the dispatch passes each
// argument where the twin expects it).
// T3D_GPU_OP_TIMES's timing (kernels/cuda/op_timer.h): while on, each dispatched op's GPU time
// is kept under its name; off, nothing is.
TEST(CudaDispatch, TimedOpsAreKeptByName) {
  REQUIRE_GPU();
  const Exec exec(GemmKind::kOpenBlasF32, S());
  const int N = 256, in = 512, out = 512;
  Dev<float> x(random_floats(static_cast<std::size_t>(N) * in, 50)),
      w(random_floats(static_cast<std::size_t>(out) * in, 51)),
      y(static_cast<std::size_t>(N) * out);
  gpu::take_op_seconds(S());  // whatever earlier tests left
  linear_forward(exec, y.p(), x.p(), w.p(), N, in, out);
  EXPECT_TRUE(gpu::take_op_seconds(S()).empty()) << "timed while off";
  gpu::set_op_timing(true);
  linear_forward(exec, y.p(), x.p(), w.p(), N, in, out);
  linear_forward(exec, y.p(), x.p(), w.p(), N, in, out);
  zero(exec, y.p(), N * out);
  gpu::set_op_timing(false);
  const auto seconds = gpu::take_op_seconds(S());
  ASSERT_EQ(seconds.count("linear_forward"), 1u);
  ASSERT_EQ(seconds.count("zero"), 1u);
  EXPECT_GT(seconds.at("linear_forward"), 0.0);
  EXPECT_LT(seconds.at("linear_forward"), 1.0);
  EXPECT_EQ(seconds.size(), 2u);
  EXPECT_TRUE(gpu::take_op_seconds(S()).empty()) << "taken twice";
}

// Snapshot copies in the background (kernels/ops.h): a copy started after an op sees its result;
// an op enqueued after compute_after_copies does not change what a started copy reads.
TEST(CudaDispatch, BackgroundCopiesAreOrderedWithTheCompute) {
  REQUIRE_GPU();
  const Exec exec(GemmKind::kOpenBlasF32, S());
  const std::size_t n = std::size_t{16} << 20;  // 64 MiB: a copy long enough to overlap
  const std::vector<float> ones(n, 1.0f);
  Dev<float> x(ones);
  std::vector<float> host(n, -1.0f), zeros(n, -1.0f);
  const PinnedHostRegion pin(exec, host.data(), n * sizeof(float));
  copy_to_host_started(exec, host.data(), x.p(), n * sizeof(float));
  compute_after_copies(exec);
  zero(exec, x.p(), static_cast<std::int64_t>(n));  // must wait for the copy
  wait_for_copies(exec);
  EXPECT_EQ(host, ones) << "an op after compute_after_copies changed what the copy read";
  copy_to_host_started(exec, zeros.data(), x.p(), n * sizeof(float));  // behind the zero
  wait_for_copies(exec);
  EXPECT_EQ(zeros, std::vector<float>(n, 0.0f)) << "a copy started before an earlier op's end";
}

TEST(CudaDispatch, EveryDispatchedOpIsItsTwin) {
  REQUIRE_GPU();
  const Exec exec(GemmKind::kOpenBlasF32, S());
  const int N = 24, C = 40, V = 30, B = 2, T = 12, H = 2, D = 20;  // N = B·T; C = H·D
  const auto a = random_floats(N * C, 40), b = random_floats(N * C, 41), w = random_floats(C, 42);
  const auto tokens = random_tokens(N, 0, V, 43);
  std::vector<float> table(T * D);
  rope_table(table.data(), T, D, 10000.0);
  Dev<float> ga(a), gb(b), gw(w), gt(table), x1(N * C), x2(N * C), r1(N), r2(N), w1(w), w2(w);
  Dev<std::int32_t> gtok(tokens);
  const auto same = [](const Dev<float>& p, const Dev<float>& q, const char* what) {
    expect_same_bits(p.host(), q.host(), what);
  };
  zero(exec, x1.p(), N * C);
  gpu::zero(S(), x2.p(), N * C);
  same(x1, x2, "zero");
  add(exec, x1.p(), ga.p(), gb.p(), N * C);
  gpu::add(S(), x2.p(), ga.p(), gb.p(), N * C);
  add_inplace(exec, x1.p(), ga.p(), N * C);
  gpu::add_inplace(S(), x2.p(), ga.p(), N * C);
  same(x1, x2, "add, add_inplace");
  rmsnorm_forward(exec, x1.p(), r1.p(), ga.p(), gw.p(), N, C, 1e-5f);
  gpu::rmsnorm_forward(S(), x2.p(), r2.p(), ga.p(), gw.p(), N, C, 1e-5f);
  same(x1, x2, "rmsnorm_forward");
  rmsnorm_backward(exec, x1.p(), w1.p(), gb.p(), ga.p(), gw.p(), r1.p(), N, C, Out::kAccumulate);
  gpu::rmsnorm_backward(S(), x2.p(), w2.p(), gb.p(), ga.p(), gw.p(), r2.p(), N, C,
                        Out::kAccumulate);
  same(x1, x2, "rmsnorm_backward dinp");
  same(w1, w2, "rmsnorm_backward dweight");
  rope_forward(exec, x1.p(), ga.p(), gt.p(), B, T, H, D, 0);
  gpu::rope_forward(S(), x2.p(), ga.p(), gt.p(), B, T, H, D, 0);
  rope_backward(exec, x1.p(), x1.p(), gt.p(), B, T, H, D, 0);
  gpu::rope_backward(S(), x2.p(), x2.p(), gt.p(), B, T, H, D, 0);
  same(x1, x2, "rope");
  swiglu_forward(exec, x1.p(), ga.p(), gb.p(), N * C);
  gpu::swiglu_forward(S(), x2.p(), ga.p(), gb.p(), N * C);
  same(x1, x2, "swiglu_forward");
  Dev<float> y1(N * C), y2(N * C);
  swiglu_backward(exec, x1.p(), y1.p(), gw.p(), ga.p(), gb.p(), C);
  gpu::swiglu_backward(S(), x2.p(), y2.p(), gw.p(), ga.p(), gb.p(), C);
  same(x1, x2, "swiglu_backward dgate");
  same(y1, y2, "swiglu_backward dup");
  embedding_forward(exec, x1.p(), gtok.p(), ga.p(), N, C, 0, V - 7);
  gpu::embedding_forward(S(), x2.p(), gtok.p(), ga.p(), N, C, 0, V - 7);
  same(x1, x2, "embedding_forward");
  embedding_backward(exec, y1.p(), gb.p(), gtok.p(), N, C, 0, V - 7);
  gpu::embedding_backward(S(), y2.p(), gb.p(), gtok.p(), N, C, 0, V - 7);
  same(y1, y2, "embedding_backward");
  Dev<float> l1(a), l2(a), loss1(N), loss2(N);  // logits (N, V = C here)
  cross_entropy_fused(exec, l1.p(), loss1.p(), gtok.p(), N, C, 0.5f);
  gpu::cross_entropy_fused(S(), l2.p(), loss2.p(), gtok.p(), N, C, 0.5f);
  same(l1, l2, "cross_entropy_fused dlogits");
  same(loss1, loss2, "cross_entropy_fused losses");
  Dev<float> m1(N), m2(N), e1(N), e2(N), t1(N), t2(N);
  ce_local_max(exec, m1.p(), ga.p(), N, C);
  gpu::ce_local_max(S(), m2.p(), ga.p(), N, C);
  ce_local_sum_exp(exec, e1.p(), ga.p(), m1.p(), N, C);
  gpu::ce_local_sum_exp(S(), e2.p(), ga.p(), m2.p(), N, C);
  ce_local_target_logit(exec, t1.p(), ga.p(), gtok.p(), N, C, 3);
  gpu::ce_local_target_logit(S(), t2.p(), ga.p(), gtok.p(), N, C, 3);
  same(m1, m2, "ce_local_max");
  same(e1, e2, "ce_local_sum_exp");
  same(t1, t2, "ce_local_target_logit");
  Dev<float> g1(a), g2(a);
  ce_loss_and_grad(exec, g1.p(), loss1.p(), gtok.p(), m1.p(), e1.p(), t1.p(), N, C, 3, 0.25f);
  gpu::ce_loss_and_grad(S(), g2.p(), loss2.p(), gtok.p(), m2.p(), e2.p(), t2.p(), N, C, 3, 0.25f);
  same(g1, g2, "ce_loss_and_grad");
  same(loss1, loss2, "ce_loss_and_grad losses");
  AdamWConfig cfg;
  cfg.weight_decay = 0.1f;
  Dev<float> p1(a), p2(a), mm1(N * C), mm2(N * C), v1(N * C), v2(N * C);
  adamw_step(exec, p1.p(), gb.p(), mm1.p(), v1.p(), N * C, cfg, 2);
  gpu::adamw_step(S(), p2.p(), gb.p(), mm2.p(), v2.p(), N * C, cfg, 2);
  same(p1, p2, "adamw_step");
  Dev<std::uint16_t> h1(N * C), h2(N * C);
  float_to_bf16(exec, h1.p(), ga.p(), N * C);
  gpu::float_to_bf16(S(), h2.p(), ga.p(), N * C);
  EXPECT_EQ(h1.host(), h2.host()) << "float_to_bf16";
  bf16_to_float(exec, x1.p(), h1.p(), N * C);
  gpu::bf16_to_float(S(), x2.p(), h2.p(), N * C);
  same(x1, x2, "bf16_to_float");
  copy_from_host(exec, x1.p(), b.data(), b.size() * sizeof(float));
  std::vector<float> back(b.size());
  copy_to_host(exec, back.data(), x1.p(), back.size() * sizeof(float));
  expect_same_bits(back, b, "copy_from_host, copy_to_host");
  Buffer buffer;
  buffer.reserve(exec, N * C * sizeof(float), "test");
  copy(exec, buffer.as<float>(), ga.p(), N * C);
  copy_to_host(exec, back.data(), buffer.as<float>(), back.size() * sizeof(float));
  expect_same_bits(back, a, "a Buffer of a GPU Exec");
  Dev<double> sq(1);
  gpu::sum_of_squares(S(), sq.p(), ga.p(), N * C);
  const double twin = sq.host()[0], dispatched = sum_of_squares(exec, ga.p(), N * C);
  EXPECT_EQ(std::memcmp(&twin, &dispatched, sizeof twin), 0) << "sum_of_squares";
}

TEST(CudaAttention, RefusesAHeadDimItCannotHold) {
  REQUIRE_GPU();
  AttentionShape s;
  s.B = 1, s.T = 4, s.n_heads = 1, s.n_kv_heads = 1, s.head_dim = gpu::kMaxHeadDim + 2;
  EXPECT_THROW(gpu::attention_forward(S(), nullptr, nullptr, nullptr, nullptr, nullptr, s),
               UserError);
}

}  // namespace
}  // namespace t3d::kernels
