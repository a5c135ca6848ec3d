// Comm::all_to_all and all_to_allv on 4 ranks against a reference computed from the formula every
// rank knows: on the world (4 ranks), on the EP groups of dp=4, ep=2 (2 ranks) and of ep=1 (the
// rank alone). Row counts include zeros, a rank that receives every row, and displacements with
// gaps, which must stay untouched. The byte counters must count what left the rank. Run by ctest
// under mpirun -np 4.
#include <gtest/gtest.h>
#include <mpi.h>

#include <cstdint>
#include <functional>
#include <vector>

#include "kernels/check.h"
#include "parallel/comm.h"

namespace t3d::parallel {
namespace {

// The value of element k of row i that group rank `from` sends to group rank `to` (exact in
// float and in uint16_t).
int element(int from, int to, int i, int k) { return 1 + from * 97 + to * 31 + i * 5 + k; }

using RowCounts = std::function<int(int from, int to)>;

// One all_to_allv of rows of `row_size` elements over `comm`, with `rows(from, to)` rows per pair
// and a gap of `gap` rows before every peer's block on both sides; checks every received element,
// that gaps stay untouched, and the byte counter.
template <typename T>
void check_rows(const Comm& comm, const RowCounts& rows, size_t row_size, int gap) {
  const int n = comm.size(), me = comm.rank();
  std::vector<int> send_counts(n), send_displs(n), recv_counts(n), recv_displs(n);
  int send_rows = 0, recv_rows = 0;
  for (int p = 0; p < n; ++p) {
    send_displs[p] = send_rows + gap;
    send_counts[p] = rows(me, p);
    send_rows = send_displs[p] + send_counts[p];
    recv_displs[p] = recv_rows + gap;
    recv_counts[p] = rows(p, me);
    recv_rows = recv_displs[p] + recv_counts[p];
  }
  const T sentinel = static_cast<T>(60000);
  std::vector<T> send(send_rows * row_size + 1, sentinel), recv(recv_rows * row_size + 1, sentinel);
  for (int p = 0; p < n; ++p)
    for (int i = 0; i < send_counts[p]; ++i)
      for (size_t k = 0; k < row_size; ++k)
        send[(send_displs[p] + i) * row_size + k] =
            static_cast<T>(element(me, p, i, static_cast<int>(k)));

  const uint64_t bytes_before = comm.counters().bytes;
  comm.all_to_allv(send.data(), send_counts, send_displs, recv.data(), recv_counts, recv_displs,
                   row_size);

  std::vector<T> expected(recv.size(), sentinel);  // the reference: source rank order
  for (int p = 0; p < n; ++p)
    for (int i = 0; i < recv_counts[p]; ++i)
      for (size_t k = 0; k < row_size; ++k)
        expected[(recv_displs[p] + i) * row_size + k] =
            static_cast<T>(element(p, me, i, static_cast<int>(k)));
  EXPECT_EQ(recv, expected) << "group " << comm.name() << " rank " << me;

  uint64_t moved = 0;  // the rows to itself stay on the rank
  for (int p = 0; p < n; ++p)
    if (p != me) moved += static_cast<uint64_t>(send_counts[p]) * row_size * sizeof(T);
  EXPECT_EQ(comm.counters().bytes - bytes_before, moved) << "group " << comm.name();
}

template <typename T>
void check_counts(const Comm& comm, size_t count) {
  const int n = comm.size(), me = comm.rank();
  std::vector<T> send(n * count), recv(n * count, T(-1));
  for (int p = 0; p < n; ++p)
    for (size_t k = 0; k < count; ++k)
      send[p * count + k] = static_cast<T>(element(me, p, 0, static_cast<int>(k)));
  const uint64_t bytes_before = comm.counters().bytes;
  comm.all_to_all(send.data(), recv.data(), count);
  for (int p = 0; p < n; ++p)
    for (size_t k = 0; k < count; ++k)
      EXPECT_EQ(recv[p * count + k], static_cast<T>(element(p, me, 0, static_cast<int>(k))))
          << "from group rank " << p << " element " << k;
  EXPECT_EQ(comm.counters().bytes - bytes_before, count * (n - 1) * sizeof(T));
}

// The groups every test runs on: the world, an EP group of 2, an EP group of the rank alone.
struct Groups {
  Mesh ep2{MeshShape(1, 4, 1, 1, 2), Comm::world(60.0)};
  Mesh ep1{MeshShape(1, 4, 1, 1, 1), Comm::world(60.0)};
  std::vector<const Comm*> all() const { return {&ep2.world(), &ep2.ep(), &ep1.ep()}; }
};

TEST(AllToAllMpi, CountsArriveTransposed) {
  const Groups g;
  for (const Comm* c : g.all()) {
    check_counts<int32_t>(*c, 1);
    check_counts<int64_t>(*c, 5);
  }
}

TEST(AllToAllMpi, RowsLandAtTheirDisplacementsInSourceRankOrder) {
  const Groups g;
  // Uneven counts with zeros: pair (from, to) sends (3·from + 5·to + 1) mod 4 rows.
  const RowCounts uneven = [](int from, int to) { return (3 * from + 5 * to + 1) % 4; };
  for (const Comm* c : g.all()) {
    check_rows<float>(*c, uneven, 3, 0);
    check_rows<float>(*c, uneven, 7, 2);
    check_rows<uint16_t>(*c, uneven, 4, 1);  // bf16 bits on the wire
  }
}

TEST(AllToAllMpi, ZeroRowsAndOneRankReceivingEverything) {
  const Groups g;
  const RowCounts none = [](int, int) { return 0; };
  const RowCounts only_first_sends = [](int from, int) { return from == 0 ? 2 : 0; };
  for (const Comm* c : g.all()) {
    const RowCounts to_last = [&](int, int to) { return to == c->size() - 1 ? 6 : 0; };
    check_rows<float>(*c, none, 8, 0);
    check_rows<float>(*c, none, 8, 1);
    check_rows<float>(*c, to_last, 5, 0);  // one expert's rank receives every token
    check_rows<uint16_t>(*c, only_first_sends, 3, 1);
  }
}

TEST(AllToAllMpi, EpGroupExchangesWithItsFoldedMembers) {
  // dp=4, ep=2: the EP groups are world ranks {0,1} and {2,3}; every rank sends its world rank.
  const Groups g;
  const Comm& ep = g.ep2.ep();
  ASSERT_EQ(ep.size(), 2);
  EXPECT_EQ(ep.name(), "ep");
  EXPECT_EQ(g.ep2.edp().name(), "edp");
  const int me = g.ep2.rank();
  std::vector<int32_t> send(2, me), recv(2, -1);
  ep.all_to_all(send.data(), recv.data(), 1);
  const int first = me / 2 * 2;
  EXPECT_EQ(recv, (std::vector<int32_t>{first, first + 1}));
}

// Exchanges started one after another in one Exchange (as the model's EP exchanges are) each
// deliver their own rows, and after the first its count buffer is reused, not reallocated: the
// steady state of a training step allocates nothing for them. A start while the previous exchange
// is in flight is a bug the Comm refuses.
TEST(AllToAllMpi, OneExchangeCarriesManyInTurn) {
  const Groups g;
  for (const Comm* c : g.all()) {
    const int n = c->size(), me = c->rank();
    Comm::Exchange exchange;
    const int* buffer = nullptr;
    for (int round = 0; round < 3; ++round) {
      // round + 1 rows of 2 floats from every rank to every rank, valued by (from, to, round).
      const int rows = round + 1;
      std::vector<int> counts(n, rows), displs(n);
      for (int p = 0; p < n; ++p) displs[p] = p * rows;
      std::vector<float> send(static_cast<size_t>(n * rows * 2)), recv(send.size(), -1.0f);
      for (int p = 0; p < n; ++p)
        for (int k = 0; k < rows * 2; ++k) send[p * rows * 2 + k] = element(me, p, round, k);
      c->start_all_to_allv(exchange, send.data(), counts, displs, recv.data(), counts, displs, 2);
      EXPECT_THROW(c->start_all_to_allv(exchange, send.data(), counts, displs, recv.data(), counts,
                                        displs, 2),
                   InternalError);
      c->wait(exchange);
      EXPECT_FALSE(exchange.request.pending);
      for (int p = 0; p < n; ++p)
        for (int k = 0; k < rows * 2; ++k)
          EXPECT_EQ(recv[p * rows * 2 + k], element(p, me, round, k))
              << "round " << round << " from " << p;
      if (round > 0) {
        EXPECT_EQ(exchange.elements.data(), buffer) << "round " << round;
      }
      buffer = exchange.elements.data();
    }
  }
}

}  // namespace
}  // namespace t3d::parallel
