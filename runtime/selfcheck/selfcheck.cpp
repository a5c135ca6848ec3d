#include "runtime/selfcheck/selfcheck.h"

#include <fmt/format.h>

#include <algorithm>
#include <chrono>
#include <cstring>
#include <functional>
#include <map>
#include <set>
#include <thread>

#include "kernels/check.h"
#include "runtime/selfcheck/selfcheck_internal.h"

namespace t3d::runtime {

using parallel::Comm;
using parallel::Dim;
using parallel::ReduceOp;
using Clock = std::chrono::steady_clock;

namespace selfcheck {

std::string bytes_label(double bytes) {
  const char* units[] = {"B", "KiB", "MiB", "GiB"};
  int u = 0;
  while (bytes >= 1024 && u < 3) bytes /= 1024, ++u;
  return fmt::format("{:g} {}", bytes, units[u]);
}

CheckRow agree_row(const Comm& world, std::string check, std::string group, std::string scope,
                   const Verdict& mine, const std::string& ok_detail, CheckStatus on_failure) {
  // Fixed-size records: one all-gather, no variable-length messages.
  struct Wire {
    int32_t ok, blame;
    char what[248];
  };
  Wire w{};
  w.ok = mine.ok, w.blame = mine.blame;
  std::strncpy(w.what, mine.what.c_str(), sizeof(w.what) - 1);
  std::vector<Wire> all(world.size());
  world.all_gather(reinterpret_cast<const char*>(&w), reinterpret_cast<char*>(all.data()),
                   sizeof(Wire));

  CheckRow row{std::move(check), std::move(group), std::move(scope),
               CheckStatus::ok,  ok_detail,        {}};
  std::map<std::string, std::vector<int>> findings;  // what -> reporting ranks
  std::set<int> blamed, reporters;
  for (int r = 0; r < world.size(); ++r) {
    if (all[r].ok) continue;
    findings[all[r].what].push_back(r);
    reporters.insert(r);
    if (all[r].blame >= 0) blamed.insert(all[r].blame);
  }
  if (findings.empty()) return row;
  row.status = on_failure;
  const auto& culprits = blamed.empty() ? reporters : blamed;
  row.culprits.assign(culprits.begin(), culprits.end());
  row.detail.clear();
  int shown = 0;
  for (const auto& [what, ranks] : findings) {
    if (shown++ == 2) {
      row.detail += fmt::format("; and {} more", findings.size() - 2);
      break;
    }
    row.detail += fmt::format("{}world rank{} {}: {}", row.detail.empty() ? "" : "; ",
                              ranks.size() > 1 ? "s" : "", fmt::join(ranks, ","), what);
  }
  return row;
}

}  // namespace selfcheck

namespace {

using selfcheck::Verdict;

// A group of the mesh as this rank sees it.
struct Group {
  const Comm* comm;
  std::string name;
  std::vector<int> members;  // world ranks, by group rank
  int count = 1;             // groups of this kind in the world
  // Members of any world rank's group of this kind (MeshShape); null for the world.
  std::function<std::vector<int>(int)> members_of;
  std::string scope() const {
    return fmt::format("{} group{} × {}", count, count > 1 ? "s" : "", members.size());
  }
  int me() const { return members.at(comm->rank()); }
};

constexpr size_t kCount = 1003;  // odd, so no algorithm's chunking divides it evenly

// What world rank `w` contributes at element i: small integers, so float sums are exact.
float value(int w, size_t i) { return static_cast<float>((w + 1) * 8 + static_cast<int>(i % 7)); }

Verdict check_all_reduce(const Group& g) {
  Verdict v;
  std::vector<float> x(kCount);
  for (size_t i = 0; i < kCount; ++i) x[i] = value(g.me(), i);
  g.comm->all_reduce(x.data(), kCount);
  for (size_t i = 0; i < kCount && v.ok; ++i) {
    float expected = 0;
    for (int m : g.members) expected += value(m, i);
    if (x[i] != expected)
      v.fail(fmt::format("sum wrong at element {}: got {}, expected {}", i, x[i], expected));
  }
  // A wrong sum says nothing of whose contribution was wrong: reduce each member's alone (the
  // others contribute zeros) and blame the member whose lone contribution arrives changed.
  int bad = v.ok ? 0 : 1;
  g.comm->all_reduce(&bad, 1, ReduceOp::max);
  if (!bad) return v;
  std::vector<int> culprits;
  for (size_t j = 0; j < g.members.size(); ++j) {
    const bool mine = static_cast<int>(j) == g.comm->rank();
    for (size_t i = 0; i < kCount; ++i) x[i] = mine ? value(g.me(), i) : 0.0f;
    g.comm->all_reduce(x.data(), kCount);
    for (size_t i = 0; i < kCount; ++i)
      if (x[i] != value(g.members[j], i)) {
        culprits.push_back(g.members[j]);
        break;
      }
  }
  if (v.ok) v.fail("a peer saw a wrong sum");
  if (culprits.size() == 1) {
    v.blame = culprits[0];
    v.what +=
        fmt::format("; reduced alone, world rank {}'s contribution arrives changed", culprits[0]);
  }
  return v;
}

Verdict check_all_gather(const Group& g) {
  Verdict v;
  const size_t n = g.members.size();
  std::vector<float> mine(kCount), all(n * kCount, -1.0f);
  for (size_t i = 0; i < kCount; ++i) mine[i] = value(g.me(), i);
  g.comm->all_gather(mine.data(), all.data(), kCount);
  for (size_t j = 0; j < n && v.ok; ++j)
    for (size_t i = 0; i < kCount; ++i)
      if (all[j * kCount + i] != value(g.members[j], i)) {
        v.fail(fmt::format("block of world rank {} wrong at element {}: got {}, expected {}",
                           g.members[j], i, all[j * kCount + i], value(g.members[j], i)),
               g.members[j]);
        break;
      }
  return v;
}

Verdict check_reduce_scatter(const Group& g) {
  Verdict v;
  const size_t n = g.members.size();
  std::vector<float> send(n * kCount), recv(kCount, -1.0f);
  // Block j goes to group rank j: value + j, so a block delivered to the wrong rank shows.
  for (size_t j = 0; j < n; ++j)
    for (size_t i = 0; i < kCount; ++i) send[j * kCount + i] = value(g.me(), i) + j;
  g.comm->reduce_scatter(send.data(), recv.data(), kCount);
  const int me = g.comm->rank();
  for (size_t i = 0; i < kCount && v.ok; ++i) {
    float expected = 0;
    for (int m : g.members) expected += value(m, i) + me;
    if (recv[i] != expected)
      v.fail(fmt::format("block wrong at element {}: got {}, expected {}", i, recv[i], expected));
  }
  return v;
}

Verdict check_broadcast(const Group& g) {
  Verdict v;
  const int root = static_cast<int>(g.members.size()) - 1;  // not rank 0: a default hides bugs
  std::vector<float> x(kCount, -1.0f);
  if (g.comm->rank() == root)
    for (size_t i = 0; i < kCount; ++i) x[i] = value(g.me(), i);
  g.comm->broadcast(x.data(), kCount, root);
  for (size_t i = 0; i < kCount; ++i)
    if (x[i] != value(g.members[root], i)) {
      v.fail(
          fmt::format("from world rank {} wrong at element {}: got {}", g.members[root], i, x[i]),
          g.members[root]);
      break;
    }
  return v;
}

// A receive that gives up after `seconds` (cancelled) instead of leaving it to the watchdog, so a
// silent peer becomes a FAILED row naming it rather than an aborted job.
bool recv_before(const Comm& c, float* data, size_t count, int peer, int tag, double seconds) {
  MPI_Request r;
  T3D_MPI(MPI_Irecv(data, static_cast<int>(count), MPI_FLOAT, peer, tag, c.handle(), &r));
  const auto start = Clock::now();
  for (int done = 0;;) {
    T3D_MPI(MPI_Test(&r, &done, MPI_STATUS_IGNORE));
    if (done) return true;
    if (std::chrono::duration<double>(Clock::now() - start).count() > seconds) break;
    std::this_thread::sleep_for(std::chrono::microseconds(200));
  }
  T3D_MPI(MPI_Cancel(&r));
  T3D_MPI(MPI_Wait(&r, MPI_STATUS_IGNORE));
  return false;
}

// Every stage sends to the next and receives from the previous, then the reverse (the
// activations' and the gradients' directions), each message checked element by element.
Verdict check_p2p(const Group& pp, double seconds) {
  Verdict v;
  constexpr size_t n = 4096;
  const int s = pp.comm->rank(), stages = static_cast<int>(pp.members.size());
  std::vector<float> out(n), in(n);
  for (int dir : {+1, -1}) {
    const int to = s + dir, from = s - dir, tag = dir > 0 ? 1 : 2;
    const float offset = dir > 0 ? 0.5f : 0.25f;
    for (size_t i = 0; i < n; ++i) out[i] = value(pp.me(), i) + offset;
    parallel::Request sent;
    if (to >= 0 && to < stages) sent = pp.comm->isend(out.data(), n, to, tag);
    if (from >= 0 && from < stages) {
      const int peer = pp.members[from];
      const char* way = dir > 0 ? "forward" : "backward";
      if (!recv_before(*pp.comm, in.data(), n, from, tag, seconds)) {
        v.fail(fmt::format("{}: nothing from world rank {} (stage {}) within {:g} s", way, peer,
                           from, seconds),
               peer);
      } else {
        for (size_t i = 0; i < n; ++i)
          if (in[i] != value(peer, i) + offset) {
            v.fail(fmt::format("{}: message from world rank {} wrong at element {}", way, peer, i),
                   peer);
            break;
          }
      }
    }
    pp.comm->wait(sent, "selfcheck p2p send", to);
  }
  return v;
}

// ---- Expert parallelism: the all-to-all and every pair of the EP group ----

constexpr size_t kRowFloats = 37;  // odd: rows straddle any chunking

// Rows group rank `from` sends group rank `to`: uneven, zero for some pairs, as routing makes them.
int rows_between(int from, int to) { return (3 * from + 5 * to + 1) % 4; }

// Element k of row i that world rank `from` sends world rank `to`: an integer below 2^24, exact in
// float, different for every sender, receiver and position.
float row_value(int from, int to, int i, size_t k) {
  const int64_t h =
      (int64_t{from} * 7919 + int64_t{to} * 104729 + i * 31 + static_cast<int64_t>(k));
  return static_cast<float>(h % 16777213);
}

// The dispatch's two steps: an all_to_all of row counts, then the all_to_allv of the rows they
// announce. Every count and row is checked; a wrong one blames its sender.
Verdict check_all_to_all(const Group& g) {
  Verdict v;
  const int n = static_cast<int>(g.members.size()), me = g.comm->rank();
  std::vector<int32_t> send_counts(n), counts_seen(n, -1);
  for (int p = 0; p < n; ++p) send_counts[p] = rows_between(me, p);
  g.comm->all_to_all(send_counts.data(), counts_seen.data(), 1);
  for (int p = 0; p < n && v.ok; ++p)
    if (counts_seen[p] != rows_between(p, me))
      v.fail(fmt::format("row count from world rank {} wrong: got {}, expected {}", g.members[p],
                         counts_seen[p], rows_between(p, me)),
             g.members[p]);
  // The rows: received by the counts every rank knows, so a wrong count cannot derail them.
  std::vector<int> send_rows(n), send_displs(n), recv_rows(n), recv_displs(n);
  int sent = 0, received = 0;
  for (int p = 0; p < n; ++p) {
    send_rows[p] = send_counts[p], send_displs[p] = sent, sent += send_rows[p];
    recv_rows[p] = rows_between(p, me), recv_displs[p] = received, received += recv_rows[p];
  }
  std::vector<float> send(sent * kRowFloats), recv(received * kRowFloats, -1.0f);
  for (int p = 0; p < n; ++p)
    for (int i = 0; i < send_rows[p]; ++i)
      for (size_t k = 0; k < kRowFloats; ++k)
        send[(send_displs[p] + i) * kRowFloats + k] = row_value(g.me(), g.members[p], i, k);
  g.comm->all_to_allv(send.data(), send_rows, send_displs, recv.data(), recv_rows, recv_displs,
                      kRowFloats);
  for (int p = 0; p < n && v.ok; ++p)
    for (int i = 0; i < recv_rows[p] && v.ok; ++i)
      for (size_t k = 0; k < kRowFloats; ++k) {
        const float got = recv[(recv_displs[p] + i) * kRowFloats + k];
        if (got != row_value(g.members[p], g.me(), i, k)) {
          v.fail(fmt::format("row {} from world rank {} wrong at element {}: got {}, expected {}",
                             i, g.members[p], k, got, row_value(g.members[p], g.me(), i, k)),
                 g.members[p]);
          break;
        }
      }
  return v;
}

// Partner of group rank i in round r of a round robin over n ranks (the circle method: every pair
// meets once, in n − 1 rounds for even n, n for odd n); -1: i sits this round out.
int round_robin_partner(int n, int r, int i) {
  const int m = n % 2 ? n + 1 : n;  // a phantom rank m − 1 makes the count even
  int j = 0;
  if (i == m - 1) {
    while ((2 * j) % (m - 1) != r % (m - 1)) ++j;  // m − 1 is odd: exactly one j
  } else {
    j = ((r - i) % (m - 1) + (m - 1)) % (m - 1);
    if (j == i) j = m - 1;
  }
  return j < n ? j : -1;
}

// Every pair of every EP group exchanges a message both ways, one round robin round at a time
// (the pairs of a round at once, as an all-to-all loads the links): content checked, then timed
// over a few exchanges. A pair whose message is missing or wrong FAILS naming the sender; a pair
// slower than twice the median pair (and by over 1 ms: timer and scheduling noise) is a WARN
// naming both ranks.
void ep_pair_rows(const Job& job, const Group& g, bool quick, double seconds,
                  std::vector<CheckRow>& rows) {
  const Comm& world = job.mesh->world();
  const auto& shape = job.mesh->shape();
  const int n = static_cast<int>(g.members.size()), me = g.comm->rank();
  const size_t bytes = quick ? 256 << 10 : 4 << 20;
  const size_t count = bytes / sizeof(float);
  const int iters = quick ? 5 : 11;  // odd: one median
  Verdict v;
  std::vector<double> time_with(n, -1.0);  // by the partner's group rank; -1: not timed
  std::vector<float> out(count), in(count);
  const int rounds = n % 2 ? n : n - 1;
  for (int r = 0; r < rounds; ++r) {
    const int p = round_robin_partner(n, r, me);
    int broken = 0;
    if (p >= 0) {
      const int peer = g.members[p];
      for (size_t i = 0; i < count; ++i) out[i] = row_value(g.me(), peer, r, i % 4099);
      parallel::Request sent = g.comm->isend(out.data(), count, p, 1000 + r);
      if (!recv_before(*g.comm, in.data(), count, p, 1000 + r, seconds)) {
        v.fail(fmt::format("nothing from world rank {} within {:g} s", peer, seconds), peer);
        broken = 1;
      } else {
        for (size_t i = 0; i < count; ++i)
          if (in[i] != row_value(peer, g.me(), r, i % 4099)) {
            v.fail(fmt::format("message from world rank {} wrong at element {}", peer, i), peer);
            broken = 1;
            break;
          }
      }
      g.comm->wait(sent, "selfcheck ep pair send", p);
    }
    // A pair is timed only when both of its ranks received intact (the other may not know).
    std::vector<int> broken_by_rank(n);
    g.comm->all_gather(&broken, broken_by_rank.data(), 1);
    if (p < 0 || broken_by_rank[me] || broken_by_rank[p]) continue;
    // The median exchange: a slow link is slow every time, a descheduled rank only now and then.
    std::vector<double> times;
    for (int it = -1; it < iters; ++it) {  // it = -1: warm-up
      const auto t0 = Clock::now();
      parallel::Request s = g.comm->isend(out.data(), count, p, 2000 + r);
      g.comm->recv(in.data(), count, p, 2000 + r);
      g.comm->wait(s, "selfcheck ep pair send", p);
      if (it >= 0) times.push_back(std::chrono::duration<double>(Clock::now() - t0).count());
    }
    std::sort(times.begin(), times.end());
    time_with[p] = times[times.size() / 2];
  }
  rows.push_back(selfcheck::agree_row(world, "p2p", "ep", g.scope(), v,
                                      "every pair of each EP group, both directions, exact"));

  // Each pair's time, seen from both ends (the slower counts), agreed over the world.
  std::vector<double> all(static_cast<size_t>(world.size()) * n);
  world.all_gather(time_with.data(), all.data(), n);
  struct Pair {
    int a, b;
    double seconds;
  };
  std::vector<Pair> pairs;
  for (int a = 0; a < world.size(); ++a) {
    const auto members = shape.ep_group(a);
    const int ia = static_cast<int>(std::find(members.begin(), members.end(), a) - members.begin());
    for (int ib = 0; ib < n; ++ib) {
      const int b = members[ib];
      const double t = std::max(all[a * n + ib], all[b * n + ia]);
      if (b > a && all[a * n + ib] >= 0 && all[b * n + ia] >= 0) pairs.push_back({a, b, t});
    }
  }
  if (pairs.empty()) return;
  std::vector<double> sorted;
  for (const auto& q : pairs) sorted.push_back(q.seconds);
  std::sort(sorted.begin(), sorted.end());
  const double median = (sorted[(sorted.size() - 1) / 2] + sorted[sorted.size() / 2]) / 2;
  const auto slowest = std::max_element(pairs.begin(), pairs.end(),
                                        [](auto& x, auto& y) { return x.seconds < y.seconds; });
  CheckRow summary{"pair_time",
                   "ep",
                   fmt::format("{} pairs", pairs.size()),
                   CheckStatus::info,
                   fmt::format("exchange {} each way: median {:.3f} ms ({:.3f} GB/s), slowest "
                               "{:.3f} ms (world ranks {},{})",
                               selfcheck::bytes_label(bytes), median * 1e3, bytes / median / 1e9,
                               slowest->seconds * 1e3, slowest->a, slowest->b),
                   {}};
  std::vector<CheckRow> slow;
  for (const auto& q : pairs) {
    if (q.seconds <= 2 * median || q.seconds - median <= 1e-3) continue;
    summary.status = CheckStatus::warn;
    summary.culprits.push_back(q.a), summary.culprits.push_back(q.b);
    slow.push_back({"pair_time",
                    "ep",
                    fmt::format("ranks {},{}", q.a, q.b),
                    CheckStatus::warn,
                    fmt::format("world ranks {} <-> {}: {:.3f} ms, {:.1f}x the median pair: "
                                "outlier",
                                q.a, q.b, q.seconds * 1e3, q.seconds / median),
                    {q.a, q.b}});
  }
  std::sort(summary.culprits.begin(), summary.culprits.end());
  summary.culprits.erase(std::unique(summary.culprits.begin(), summary.culprits.end()),
                         summary.culprits.end());
  rows.push_back(std::move(summary));
  rows.insert(rows.end(), slow.begin(), slow.end());
}

// nccl-tests' bus bandwidth factor for an all-reduce of n ranks (docs/selfcheck.md).
double all_reduce_bus_factor(int n) { return 2.0 * (n - 1) / n; }

// Where a kind of group runs, from every rank's host: "intra-host" when every group of the kind
// lies inside one host, "inter-host" when every one spans hosts, else "mixed". Agreed: all ranks
// compute it from the same host table and mesh.
std::string placement(const Job& job, const Group& g) {
  if (!g.members_of) return "world";
  bool any_inside = false, any_across = false;
  for (int r = 0; r < job.mesh->shape().world(); ++r) {
    const auto members = g.members_of(r);
    if (members.front() != r) continue;
    const bool across = std::any_of(members.begin(), members.end(), [&](int m) {
      return job.hosts.at(m) != job.hosts.at(members.front());
    });
    (across ? any_across : any_inside) = true;
  }
  return any_across ? (any_inside ? "mixed" : "inter-host") : "intra-host";
}

// Ping-pong between world rank 0 and one rank on its own host and one on each other host: the
// bandwidth and latency of the links a job's groups use (shared memory inside a host, the network
// between hosts). Pairs run one at a time, the other ranks wait at a barrier.
void host_link_rows(const Job& job, bool quick, std::vector<CheckRow>& rows) {
  const auto& world = job.mesh->world();
  std::vector<std::pair<int, std::string>> peers;  // world rank, kind
  for (int r = 1; r < world.size(); ++r)
    if (job.hosts[r] == job.hosts[0]) {
      peers.emplace_back(r, "intra");
      break;
    }
  std::set<std::string> seen = {job.hosts[0]};
  for (int r = 1; r < world.size(); ++r)
    if (seen.insert(job.hosts[r]).second) peers.emplace_back(r, "inter");
  const size_t bytes = quick ? 1 << 20 : 16 << 20;
  const int iters = quick ? 3 : 10;
  std::vector<char> buf(bytes);
  for (const auto& [peer, kind] : peers) {
    double times[2] = {0, 0};  // small-message round trip, large-message round trip
    const int me = world.rank();
    if (me == 0 || me == peer) {
      const int other = me == 0 ? peer : 0;
      int slot = 0;
      for (size_t size : {size_t{8}, bytes}) {
        for (int it = -1; it < iters; ++it) {  // it = -1: warm-up (connection set-up)
          const auto t0 = Clock::now();
          if (me == 0) {
            world.send(buf.data(), size, other, 7);
            world.recv(buf.data(), size, other, 7);
          } else {
            world.recv(buf.data(), size, other, 7);
            world.send(buf.data(), size, other, 7);
          }
          if (it >= 0) times[slot] += std::chrono::duration<double>(Clock::now() - t0).count();
        }
        times[slot++] /= iters;
      }
    }
    world.broadcast(times, 2, 0);
    const double gbs = 2.0 * bytes / times[1] / 1e9;  // both directions of a round trip
    rows.push_back({"link",
                    kind,
                    fmt::format("ranks 0,{}", peer),
                    CheckStatus::info,
                    fmt::format("{} <-> {} ({}-host): ping-pong {} {:7.3f} GB/s, 8 B round "
                                "trip {:7.1f} us",
                                job.hosts[0], job.hosts[peer], kind, selfcheck::bytes_label(bytes),
                                gbs, times[0] * 1e6),
                    {}});
  }
}

void bandwidth_rows(const Job& job, const std::vector<Group>& groups, bool quick,
                    std::vector<CheckRow>& rows) {
  const Comm& world = job.mesh->world();
  const std::vector<size_t> sizes =
      quick ? std::vector<size_t>{1 << 10, 64 << 10, 1 << 20}
            : std::vector<size_t>{1 << 10, 16 << 10, 256 << 10, 4 << 20, 64 << 20};
  for (const auto& g : groups) {
    const int n = static_cast<int>(g.members.size());
    if (n < 2) continue;
    const std::string where = placement(job, g);
    for (size_t bytes : sizes) {
      std::vector<float> buf(bytes / sizeof(float), 0.0f);  // zeros stay zeros: no overflow
      const int iters = quick ? 3 : bytes <= (256 << 10) ? 20 : bytes <= (4 << 20) ? 10 : 3;
      g.comm->all_reduce(buf.data(), buf.size());  // warm-up: connections, buffers
      world.barrier();
      const auto t0 = Clock::now();
      for (int it = 0; it < iters; ++it) g.comm->all_reduce(buf.data(), buf.size());
      double seconds = std::chrono::duration<double>(Clock::now() - t0).count() / iters;
      world.all_reduce(&seconds, 1, ReduceOp::max);  // the slowest rank of the slowest group
      const double algbw = bytes / seconds / 1e9;
      rows.push_back({"bandwidth",
                      g.name,
                      selfcheck::bytes_label(bytes),
                      CheckStatus::info,
                      fmt::format("all_reduce {:8.3f} ms  algbw {:7.3f} GB/s  busbw {:7.3f} GB/s"
                                  "  {}",
                                  seconds * 1e3, algbw, algbw * all_reduce_bus_factor(n), where),
                      {}});
    }
  }
}

}  // namespace

const char* status_name(CheckStatus s) {
  switch (s) {
    case CheckStatus::ok:
      return "OK";
    case CheckStatus::warn:
      return "WARN";
    case CheckStatus::failed:
      return "FAILED";
    case CheckStatus::info:
      return "-";
  }
  return "?";
}

SelfcheckReport run_selfcheck(const Job& job, const SelfcheckOptions& options) {
  const auto& mesh = *job.mesh;
  const auto& world = mesh.world();
  const auto& shape = mesh.shape();
  SelfcheckReport report;
  report.world = world.size();
  report.mesh = fmt::format("pp={} dp={} cp={} tp={}", shape.size(Dim::pp), shape.size(Dim::dp),
                            shape.size(Dim::cp), shape.size(Dim::tp));

  std::vector<Group> groups;
  for (Dim d : {Dim::tp, Dim::cp, Dim::dp, Dim::pp})
    groups.push_back({&mesh.group(d), parallel::dim_name(d), shape.group(d, mesh.rank()),
                      shape.world() / shape.size(d),
                      [&shape, d](int r) { return shape.group(d, r); }});
  const int ep = shape.ep();
  if (ep > 1) {
    // The expert-parallel groups folded into dp × cp: tokens travel over ep, expert gradients
    // are reduced over edp.
    report.mesh += fmt::format(" ep={}", ep);
    groups.push_back({&mesh.ep(), "ep", shape.ep_group(mesh.rank()), shape.world() / ep,
                      [&shape](int r) { return shape.ep_group(r); }});
    const int edp = static_cast<int>(shape.edp_group(mesh.rank()).size());
    groups.push_back({&mesh.edp(), "edp", shape.edp_group(mesh.rank()), shape.world() / edp,
                      [&shape](int r) { return shape.edp_group(r); }});
  }
  std::vector<int> everyone(world.size());
  for (int r = 0; r < world.size(); ++r) everyone[r] = r;
  groups.push_back({&world, "world", everyone, 1, nullptr});

  auto& rows = report.rows;
  for (const auto& g : groups) {
    rows.push_back(selfcheck::agree_row(world, "all_reduce", g.name, g.scope(), check_all_reduce(g),
                                        fmt::format("{} floats, exact", kCount)));
    rows.push_back(selfcheck::agree_row(world, "all_gather", g.name, g.scope(), check_all_gather(g),
                                        "every block exact"));
    rows.push_back(selfcheck::agree_row(world, "reduce_scatter", g.name, g.scope(),
                                        check_reduce_scatter(g), "every block exact"));
    rows.push_back(selfcheck::agree_row(world, "broadcast", g.name, g.scope(), check_broadcast(g),
                                        "from the last member, exact"));
  }
  const Group& pp = groups[3];
  if (pp.members.size() > 1) {
    const double seconds = std::min(10.0, world.timeout_s() / 2);
    rows.push_back(selfcheck::agree_row(world, "p2p", "pp", pp.scope(), check_p2p(pp, seconds),
                                        "next and previous stage, both directions, exact"));
  }
  if (ep > 1) {
    const Group& ep_group = groups[4];
    const double seconds = std::min(10.0, world.timeout_s() / 2);
    rows.push_back(selfcheck::agree_row(
        world, "all_to_all", "ep", ep_group.scope(), check_all_to_all(ep_group),
        fmt::format("counts, then uneven rows of {} floats (zeros included), exact, in source "
                    "rank order",
                    kRowFloats)));
    ep_pair_rows(job, ep_group, options.quick, seconds, rows);
  }
  selfcheck::check_replicas(job, rows);
  selfcheck::check_memory(job, rows);
  selfcheck::check_idle_experts(job, rows);
  selfcheck::check_gemm(job, options.quick, rows);
  bandwidth_rows(job, groups, options.quick, rows);
  if (world.size() > 1) host_link_rows(job, options.quick, rows);
  selfcheck::host_map(job, rows);
  return report;
}

}  // namespace t3d::runtime
