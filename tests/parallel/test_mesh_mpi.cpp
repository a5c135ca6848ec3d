// 8 ranks: each group's all-reduce of the world rank equals the sum over exactly the expected
// members, for pp2×dp2×tp2, pp1×dp2×cp2×tp2 and dp8, and so do the flattened dp×cp group and the
// expert-parallel groups folded into it (ep = 1, 2, 4, 8). Run by ctest under mpirun -np 8.
#include <gtest/gtest.h>
#include <mpi.h>

#include "parallel/comm.h"

using namespace t3d::parallel;

namespace {
void check_groups(const MeshShape& shape) {
  Mesh mesh(shape, Comm::world(60.0));
  for (Dim d : kDims) {
    const Comm& g = mesh.group(d);
    EXPECT_EQ(g.size(), shape.size(d)) << dim_name(d);
    EXPECT_EQ(g.rank(), mesh.coord()[d]) << dim_name(d);
    int64_t sum = mesh.rank();
    g.all_reduce(&sum, 1);
    int64_t expected = 0;
    for (int member : shape.group(d, mesh.rank())) expected += member;
    EXPECT_EQ(sum, expected) << "group " << dim_name(d) << " of rank " << mesh.rank();
    // Members by world rank, gathered, equal the pure function's table.
    std::vector<int> members(g.size());
    const int me = mesh.rank();
    g.all_gather(&me, members.data(), 1);
    EXPECT_EQ(members, shape.group(d, mesh.rank()));
    EXPECT_EQ(g.world_ranks(), shape.group(d, mesh.rank()));
  }
  // dp × cp flattened: the ranks sharing pp and tp, ordered cp-major (dp neighbours adjacent).
  const Comm& flat = mesh.dp_cp();
  const Coord me = mesh.coord();
  EXPECT_EQ(flat.size(), shape.size(Dim::dp) * shape.size(Dim::cp));
  EXPECT_EQ(flat.rank(), me.cp * shape.size(Dim::dp) + me.dp);
  std::vector<int> expected;
  for (int cp = 0; cp < shape.size(Dim::cp); ++cp)
    for (int dp = 0; dp < shape.size(Dim::dp); ++dp)
      expected.push_back(shape.rank_of(Coord{me.pp, dp, cp, me.tp}));
  EXPECT_EQ(flat.world_ranks(), expected);
  EXPECT_EQ(flat.world_ranks(), shape.dp_cp_group(mesh.rank()));
  // Expert parallelism folded into dp × cp: the communicators hold the pure function's members,
  // in its order, under the names a stuck collective reports.
  EXPECT_EQ(mesh.ep().world_ranks(), shape.ep_group(mesh.rank()));
  EXPECT_EQ(mesh.edp().world_ranks(), shape.edp_group(mesh.rank()));
  EXPECT_EQ(mesh.ep().name(), "ep");
  EXPECT_EQ(mesh.edp().name(), "edp");
  int64_t sum = mesh.rank();
  mesh.edp().all_reduce(&sum, 1);
  int64_t edp_expected = 0;
  for (int member : shape.edp_group(mesh.rank())) edp_expected += member;
  EXPECT_EQ(sum, edp_expected);
}
}  // namespace

TEST(MeshMpi, Pp2Dp2Tp2GroupsHoldExactlyTheExpectedMembers) {
  check_groups(MeshShape(2, 2, 1, 2, 1));
  check_groups(MeshShape(2, 2, 1, 2, 2));
}

TEST(MeshMpi, Dp2Cp2Tp2GroupsHoldExactlyTheExpectedMembers) {
  check_groups(MeshShape(1, 2, 2, 2, 1));
  check_groups(MeshShape(1, 2, 2, 2, 2));
  check_groups(MeshShape(1, 2, 2, 2, 4));
}

TEST(MeshMpi, Dp8ExpertGroups) {
  check_groups(MeshShape(1, 8, 1, 1, 4));
  check_groups(MeshShape(1, 8, 1, 1, 8));
}

TEST(MeshMpi, CollectivesComputeTheRightValues) {
  Mesh mesh(MeshShape(2, 2, 1, 2, 1), Comm::world(60.0));
  const Comm& w = mesh.world();
  // reduce_scatter: rank r contributes (r+1)·(i+1) to block i; block r sums to (i+1)·Σ(r+1).
  std::vector<float> send(w.size() * 3), recv(3);
  for (int i = 0; i < w.size(); ++i)
    for (int k = 0; k < 3; ++k) send[i * 3 + k] = float((w.rank() + 1) * (i + 1) + k);
  w.reduce_scatter(send.data(), recv.data(), 3);
  const float ranks_sum = w.size() * (w.size() + 1) / 2.0f;
  for (int k = 0; k < 3; ++k) EXPECT_FLOAT_EQ(recv[k], ranks_sum * (w.rank() + 1) + k * w.size());
  double mx = w.rank();
  w.all_reduce(&mx, 1, ReduceOp::max);
  EXPECT_EQ(mx, w.size() - 1);
  int64_t value = w.rank() == 3 ? 42 : -1;
  w.broadcast(&value, 1, 3);
  EXPECT_EQ(value, 42);
  // P2P along the pipeline: stage 0 sends its world rank to stage 1.
  const Comm& pp = mesh.group(Dim::pp);
  int token = mesh.rank();
  if (pp.rank() == 0)
    pp.send(&token, 1, 1, 7);
  else {
    pp.recv(&token, 1, 0, 7);
    EXPECT_EQ(token, mesh.rank() - 4);
  }
}

TEST(MeshMpi, NonBlockingSendsAndReceivesGoAroundARing) {
  Mesh mesh(MeshShape(2, 2, 1, 2, 1), Comm::world(60.0));
  const Comm& w = mesh.world();
  const int next = (w.rank() + 1) % w.size(), prev = (w.rank() + w.size() - 1) % w.size();
  // Each rank sends 2 values to the next; its receive asks for 4 (a message may be shorter),
  // and an empty message completes a receive too (what memory tier copies of unreadable files
  // rely on).
  const int64_t mine[2] = {w.rank(), 10 * w.rank()};
  int64_t got[4] = {-1, -1, -1, -1}, nothing = -1;
  Request sent = w.isend(mine, 2, next, 9), empty = w.isend(mine, 0, next, 9);
  Request received = w.irecv(got, 4, prev, 9), none = w.irecv(&nothing, 1, prev, 9);
  for (Request* r : {&sent, &empty, &received, &none}) w.wait(*r, "ring", -1);
  EXPECT_EQ(got[0], prev);
  EXPECT_EQ(got[1], 10 * prev);
  EXPECT_EQ(got[2], -1);
  EXPECT_EQ(nothing, -1);
}
