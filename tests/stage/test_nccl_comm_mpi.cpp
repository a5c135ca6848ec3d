// The NCCL device communicator (parallel/nccl_comm.h) on a GPU, and the choice of path for ranks
// that share one (runtime/stage/device_comm.h). Needs a GPU and NCCL (T3D_NCCL_LIBRARY or
// libnccl.so.2): each test skips saying which is missing. Under mpirun -np 1 and -np 2; a
// one-GPU machine gives every rank a group of its own for NcclComm, and the two ranks share the
// GPU for the choice.
#include <gtest/gtest.h>

#include <cstring>
#include <memory>
#include <string>
#include <vector>

#include "kernels/arena.h"
#include "kernels/check.h"
#include "kernels/device.h"
#include "kernels/ops.h"
#include "parallel/comm.h"
#include "parallel/nccl_comm.h"
#include "parallel/nccl_library.h"
#include "parallel/staged_comm.h"
#include "runtime/stage/device_comm.h"
#include "tests/kernels/the_gpu.h"

namespace t3d::parallel {
namespace {

const Comm& world() {
  static const Comm w = Comm::world(60.0);
  return w;
}

#define REQUIRE_GPU_AND_NCCL()                                                         \
  do {                                                                                 \
    REQUIRE_GPU();                                                                     \
    if (!nccl_library().loaded) GTEST_SKIP() << "no NCCL: " << nccl_library().why_not; \
  } while (0)

// Device buffers of one test on the rank's GPU, filled from and read back to host vectors.
struct OnGpu {
  std::unique_ptr<kernels::Device> device =
      kernels::Device::open(kernels::DeviceChoice::kCuda, world().rank());
  kernels::Exec exec = device->exec(kernels::GemmKind::kOpenBlasF32);
  kernels::Arena arena{size_t{64} << 20, kernels::Memory::kDevice};
  template <class T>
  T* put(const std::vector<T>& host) {
    T* d = static_cast<T*>(arena.alloc_bytes("buffer", host.size() * sizeof(T)));
    kernels::copy_from_host(exec, d, host.data(), host.size() * sizeof(T));
    return d;
  }
  template <class T>
  std::vector<T> get(const T* d, size_t n) {
    std::vector<T> host(n);
    kernels::copy_to_host(exec, host.data(), d, n * sizeof(T));
    return host;
  }
};

std::vector<float> values(size_t n, int salt) {
  std::vector<float> v(n);
  for (size_t i = 0; i < n; ++i) v[i] = 1.0f / static_cast<float>(3 + i + salt) + 1e3f * (i % 3);
  return v;
}

std::vector<uint16_t> halves(size_t n, int salt) {
  std::vector<uint16_t> v(n);
  for (size_t i = 0; i < n; ++i) v[i] = static_cast<uint16_t>(0x3f00 + ((i * 13 + salt) % 0x100));
  return v;
}

// A group of one rank: every call gives its input back (a sum, max or gather over one rank),
// blocking and started, on device memory.
TEST(NcclComm, EveryCallOnAGroupOfOneRank) {
  REQUIRE_GPU_AND_NCCL();
  const Comm self = world().split(world().rank(), 0, "self");
  OnGpu g;
  const NcclComm nccl(self, g.exec);
  ASSERT_EQ(nccl.size(), 1);
  const size_t n = 1000;
  const auto x = values(n, 1);
  for (const ReduceOp op : {ReduceOp::sum, ReduceOp::max, ReduceOp::min}) {
    float* d = g.put(x);
    nccl.all_reduce(d, n, op);
    EXPECT_EQ(g.get(d, n), x);
  }
  const auto h = halves(n, 2);
  uint16_t* dh = g.put(h);
  nccl.all_reduce_bf16(dh, n);
  EXPECT_EQ(g.get(dh, n), h);
  float* out = g.put(std::vector<float>(n, -1.0f));
  nccl.all_gather(g.put(x), out, n);
  EXPECT_EQ(g.get(out, n), x);
  uint16_t* out16 = g.put(std::vector<uint16_t>(n, 0));
  nccl.all_gather(g.put(h), out16, n);
  EXPECT_EQ(g.get(out16, n), h);
  nccl.reduce_scatter(g.put(x), out, n);
  EXPECT_EQ(g.get(out, n), x);
  nccl.reduce_scatter_bf16(g.put(h), out16, n);
  EXPECT_EQ(g.get(out16, n), h);
  {
    float* d = g.put(x);
    Request r = nccl.iall_reduce_sum(d, n, "bucket", 0);
    nccl.wait(r, "bucket");
    EXPECT_FALSE(r.pending);
    EXPECT_EQ(g.get(d, n), x);
    Request s = nccl.ireduce_scatter_sum(d, {static_cast<int>(n)}, "bucket", 1);
    while (!nccl.test(s)) {
    }
    EXPECT_EQ(g.get(d, n), x);
  }
  {
    std::vector<float> into(n + 5, -1.0f);
    float* recv = g.put(into);
    Request r = nccl.iall_gatherv(g.put(x), recv, {static_cast<int>(n)}, {5}, "gather");
    nccl.wait(r, "gather");
    std::copy(x.begin(), x.end(), into.begin() + 5);
    EXPECT_EQ(g.get(recv, n + 5), into);
    Request q = nccl.iall_gatherv(nullptr, recv, {static_cast<int>(n)}, {5}, "gather");
    nccl.wait(q, "gather");
    EXPECT_EQ(g.get(recv, n + 5), into);
  }
  {
    // Rows to itself: 3 rows of 4 from row 1 land at row 2.
    const auto rows = values(6 * 4, 3);
    std::vector<float> expect(6 * 4, 0.0f);
    std::copy(rows.begin() + 4, rows.begin() + 16, expect.begin() + 8);
    float* recv = g.put(std::vector<float>(6 * 4, 0.0f));
    Exchange ex;
    nccl.start_all_to_allv(ex, g.put(rows), {3}, {1}, recv, {3}, {2}, 4);
    nccl.wait(ex);
    EXPECT_EQ(g.get(recv, 6 * 4), expect);
  }
}

// A started reduction overlapping compute on the rank's stream: the compute enqueued after the
// start runs while it is in flight, and after wait() the compute stream sees the reduced values.
TEST(NcclComm, AStartedReductionOverlapsCompute) {
  REQUIRE_GPU_AND_NCCL();
  const Comm self = world().split(world().rank(), 0, "self");
  OnGpu g;
  const NcclComm nccl(self, g.exec);
  const size_t n = size_t{4} << 20;
  const auto x = values(n, 4);
  float* bucket = g.put(x);
  float* other = g.put(values(n, 5));
  Request r = nccl.iall_reduce_sum(bucket, n, "bucket", 0);
  for (int i = 0; i < 20; ++i) kernels::zero(g.exec, other, static_cast<int64_t>(n));
  nccl.wait(r, "bucket");
  kernels::add_inplace(g.exec, other, bucket, static_cast<int64_t>(n));  // reads the result
  EXPECT_EQ(g.get(other, n), x);
  Request done;
  EXPECT_TRUE(nccl.test(done));  // a default request is done already
}

// Ranks sharing the GPU (a one-GPU machine, -np 2): the group is staged, and the log line says
// which ranks share which GPU; "nccl" is refused naming them.
TEST(DeviceCommChoice, RanksSharingTheGpuAreStaged) {
  REQUIRE_GPU();
  if (world().size() < 2) GTEST_SKIP() << "needs two ranks (mpirun -np 2)";
  OnGpu g;
  if (g.device->visible_gpus() >= world().size())
    GTEST_SKIP() << "each rank has a GPU of its own here";
  const auto ranks = runtime::gather_devices(world(), *g.device);
  const runtime::DeviceCommPath path =
      runtime::choose_device_comm(runtime::DeviceComm::kAuto, "world", ranks, nccl_library());
  EXPECT_FALSE(path.nccl);
  EXPECT_NE(path.detail.find("ranks 0 and 1 share GPU " + ranks[0].gpu), std::string::npos)
      << path.detail;
  EXPECT_THROW(
      runtime::choose_device_comm(runtime::DeviceComm::kNccl, "world", ranks, nccl_library()),
      UserError);
  const auto comm = runtime::open_device_comm(path, "world", world(), *g.device);
  ASSERT_NE(dynamic_cast<const StagedComm*>(comm.get()), nullptr);
  const size_t n = 64;
  float* d = g.put(std::vector<float>(n, 1.0f));
  comm->all_reduce(d, n);
  EXPECT_EQ(g.get(d, n), std::vector<float>(n, static_cast<float>(world().size())));
}

}  // namespace
}  // namespace t3d::parallel
