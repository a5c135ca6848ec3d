// StagedComm (parallel/staged_comm.h) against the communicator it stages over: every tensor
// operation, blocking and started, gives the inner one's bits when its buffers are staged
// through host copies (here on a CPU Exec, so the copies are plain copies; on a GPU the same
// code copies device memory). Run under mpirun -np 3 (uneven counts, a ring of sends).
#include <gtest/gtest.h>

#include <numeric>
#include <vector>

#include "kernels/exec.h"
#include "parallel/comm.h"
#include "parallel/staged_comm.h"

namespace t3d::parallel {
namespace {

const Comm& world() {
  static const Comm w = Comm::world(60.0);
  return w;
}

// Values that differ by rank and position and whose sums round (so an order change would show).
std::vector<float> values(size_t n, int salt) {
  std::vector<float> v(n);
  for (size_t i = 0; i < n; ++i)
    v[i] = 1.0f / static_cast<float>(3 + i + 7 * (world().rank() + 1) + salt) + 1e3f * (i % 3);
  return v;
}

std::vector<uint16_t> halves(size_t n, int salt) {
  std::vector<uint16_t> v(n);
  for (size_t i = 0; i < n; ++i)  // bf16 values in [0.5, 2): exponents 126 and 127
    v[i] = static_cast<uint16_t>(0x3f00 + ((i * 13 + world().rank() * 5 + salt) % 0x100));
  return v;
}

TEST(StagedComm, BlockingOperationsGiveTheInnerOnesBits) {
  const Comm& w = world();
  const StagedComm staged(w, kernels::kCpu);
  EXPECT_EQ(staged.rank(), w.rank());
  EXPECT_EQ(staged.size(), w.size());
  const size_t n = 37, p = static_cast<size_t>(w.size());
  for (const ReduceOp op : {ReduceOp::sum, ReduceOp::max}) {
    auto a = values(n, 1), b = a;
    w.all_reduce(a.data(), n, op);
    staged.all_reduce(b.data(), n, op);
    EXPECT_EQ(a, b);
  }
  {
    auto a = halves(n, 2), b = a;
    w.all_reduce_bf16(a.data(), n);
    staged.all_reduce_bf16(b.data(), n);
    EXPECT_EQ(a, b);
  }
  {
    const auto mine = values(n, 3);
    std::vector<float> a(n * p), b(n * p, -1.0f);
    w.all_gather(mine.data(), a.data(), n);
    staged.all_gather(mine.data(), b.data(), n);
    EXPECT_EQ(a, b);
    const auto mine16 = halves(n, 4);
    std::vector<uint16_t> a16(n * p), b16(n * p, 7);
    w.all_gather(mine16.data(), a16.data(), n);
    staged.all_gather(mine16.data(), b16.data(), n);
    EXPECT_EQ(a16, b16);
  }
  {
    const auto all = values(n * p, 5);
    std::vector<float> a(n), b(n, -1.0f);
    w.reduce_scatter(all.data(), a.data(), n);
    staged.reduce_scatter(all.data(), b.data(), n);
    EXPECT_EQ(a, b);
    const auto all16 = halves(n * p, 6);
    std::vector<uint16_t> a16(n), b16(n, 7);
    w.reduce_scatter_bf16(all16.data(), a16.data(), n);
    staged.reduce_scatter_bf16(all16.data(), b16.data(), n);
    EXPECT_EQ(a16, b16);
  }
}

TEST(StagedComm, SendsAndReceivesGoAroundARing) {
  const Comm& w = world();
  const StagedComm staged(w, kernels::kCpu);
  const int next = (w.rank() + 1) % w.size(), prev = (w.rank() + w.size() - 1) % w.size();
  const size_t n = 29;
  // The staged send copies its input: overwriting the caller's buffer before the wait is safe.
  auto out = values(n, 7);
  const auto sent = out;
  Request r = staged.isend(out.data(), n, next, 11);
  std::fill(out.begin(), out.end(), 0.0f);
  std::vector<float> in(n);
  staged.recv(in.data(), n, prev, 11);
  staged.wait(r, "ring");
  EXPECT_FALSE(r.pending);
  std::vector<float> expected(n);  // what prev sent: values(n, 7) on rank prev
  for (size_t i = 0; i < n; ++i)
    expected[i] = 1.0f / static_cast<float>(3 + i + 7 * (prev + 1) + 7) + 1e3f * (i % 3);
  EXPECT_EQ(in, expected);
  EXPECT_EQ(sent, values(n, 7));
  auto out16 = halves(n, 8);
  Request r16 = staged.isend(out16.data(), n, next, 12);
  std::vector<uint16_t> in16(n);
  staged.recv(in16.data(), n, prev, 12);
  staged.wait(r16, "ring16");
  std::vector<uint16_t> direct(n);
  Request rd = w.isend(out16.data(), n, next, 13);
  w.recv(direct.data(), n, prev, 13);
  w.wait(rd, "direct");
  EXPECT_EQ(in16, direct);
}

TEST(StagedComm, StartedCollectivesLandWhenWaitedOrTested) {
  const Comm& w = world();
  const StagedComm staged(w, kernels::kCpu);
  const int p = w.size();
  std::vector<int> counts(static_cast<size_t>(p)), displs(static_cast<size_t>(p));
  for (int i = 0; i < p; ++i) counts[static_cast<size_t>(i)] = 5 + 3 * i;  // uneven
  std::exclusive_scan(counts.begin(), counts.end(), displs.begin(), 0);
  const size_t whole = static_cast<size_t>(displs.back() + counts.back());
  {  // all-reduce, finished by wait
    auto a = values(41, 9), b = a;
    Request ra = w.iall_reduce_sum(a.data(), a.size(), "direct");
    w.wait(ra, "direct");
    Request rb = staged.iall_reduce_sum(b.data(), b.size(), "staged", 3);
    staged.wait(rb, "staged");
    EXPECT_EQ(a, b);
  }
  {  // reduce-scatter in place, finished by test
    auto a = values(whole, 10), b = a;
    Request ra = w.ireduce_scatter_sum(a.data(), counts, "direct");
    w.wait(ra, "direct");
    Request rb = staged.ireduce_scatter_sum(b.data(), counts, "staged");
    while (!staged.test(rb)) {
    }
    const size_t mine = static_cast<size_t>(counts[static_cast<size_t>(w.rank())]);
    EXPECT_EQ(std::vector<float>(a.begin(), a.begin() + mine),
              std::vector<float>(b.begin(), b.begin() + mine));
  }
  for (const bool in_place : {false, true}) {  // all-gatherv, this rank's part given or in place
    const size_t own = static_cast<size_t>(w.rank());
    const auto mine = values(static_cast<size_t>(counts[own]), 11);
    std::vector<float> a(whole, -1.0f), b(whole, -2.0f);
    std::copy(mine.begin(), mine.end(), a.begin() + displs[own]);
    Request ra = w.iall_gatherv(nullptr, a.data(), counts, displs, "direct");
    w.wait(ra, "direct");
    if (in_place) std::copy(mine.begin(), mine.end(), b.begin() + displs[own]);
    Request rb =
        staged.iall_gatherv(in_place ? nullptr : mine.data(), b.data(), counts, displs, "staged");
    staged.wait(rb, "staged");
    EXPECT_EQ(a, b) << (in_place ? "in place" : "given");
  }
  {  // all-to-allv of rows: rank r sends r + q + 1 rows of 3 floats to rank q
    const size_t row = 3;
    std::vector<int> sc(static_cast<size_t>(p)), sd(static_cast<size_t>(p)),
        rc(static_cast<size_t>(p)), rd(static_cast<size_t>(p));
    for (int q = 0; q < p; ++q) {
      sc[static_cast<size_t>(q)] = w.rank() + q + 1;
      rc[static_cast<size_t>(q)] = q + w.rank() + 1;
    }
    std::exclusive_scan(sc.begin(), sc.end(), sd.begin(), 0);
    std::exclusive_scan(rc.begin(), rc.end(), rd.begin(), 0);
    const auto send = values(static_cast<size_t>(sd.back() + sc.back()) * row, 12);
    std::vector<float> a(static_cast<size_t>(rd.back() + rc.back()) * row, -1.0f), b(a.size());
    Exchange ea, eb;
    w.start_all_to_allv(ea, send.data(), sc, sd, a.data(), rc, rd, row);
    w.wait(ea);
    staged.start_all_to_allv(eb, send.data(), sc, sd, b.data(), rc, rd, row);
    staged.wait(eb);
    EXPECT_EQ(a, b);
  }
  {  // all-to-allv where rank 0 sends nothing and receives from everyone (expert parallelism's
     // return when its experts took no rows): the staged send and receive buffers stay apart, or
     // MPI would take the exchange for an in-place one and send rows nobody receives (rows of
     // 16 KiB: past the shared-memory transport's eager limit, where such a send never finishes)
    const size_t row = 4096;
    std::vector<int> sc(static_cast<size_t>(p), 0), sd(static_cast<size_t>(p), 0),
        rc(static_cast<size_t>(p), 0), rd(static_cast<size_t>(p), 0);
    for (int q = 0; q < p; ++q) {
      if (w.rank() != 0) sc[static_cast<size_t>(q)] = q == 0 ? 3 : 0;
      if (w.rank() == 0) rc[static_cast<size_t>(q)] = q == 0 ? 0 : 3;
    }
    std::exclusive_scan(sc.begin(), sc.end(), sd.begin(), 0);
    std::exclusive_scan(rc.begin(), rc.end(), rd.begin(), 0);
    const auto send = values(static_cast<size_t>(sd.back() + sc.back()) * row + 1, 13);
    std::vector<float> a(static_cast<size_t>(rd.back() + rc.back()) * row + 1, -1.0f), b(a);
    Exchange ea, eb;
    w.start_all_to_allv(ea, send.data(), sc, sd, a.data(), rc, rd, row);
    w.wait(ea);
    staged.start_all_to_allv(eb, send.data(), sc, sd, b.data(), rc, rd, row);
    staged.wait(eb);
    EXPECT_EQ(a, b);
  }
}

}  // namespace
}  // namespace t3d::parallel
