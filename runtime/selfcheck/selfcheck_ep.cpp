// Expert parallelism's checks: the dispatch's all-to-all (counts, then uneven rows) and every pair
// of each EP group, content then time.
#include <fmt/format.h>

#include <algorithm>
#include <chrono>

#include "runtime/selfcheck/selfcheck_internal.h"

namespace t3d::runtime {
namespace {

using parallel::Comm;
using selfcheck::Group;
using selfcheck::recv_before;
using selfcheck::Verdict;
using EpClock = std::chrono::steady_clock;

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

// Every pair of an EP group exchanges a message both ways, one round robin round at a time (the
// pairs of a round at once, as an all-to-all loads the links): content checked into `v` (a
// missing or wrong message blames its sender), then timed over `iters` exchanges. Returns the
// median time with each partner, by its group rank; -1 where the pair was not timed.
std::vector<double> exchange_pairs(const Group& g, size_t bytes, int iters, double seconds,
                                   Verdict& v) {
  const int n = static_cast<int>(g.members.size()), me = g.comm->rank();
  const size_t count = bytes / sizeof(float);
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
      const auto t0 = EpClock::now();
      parallel::Request s = g.comm->isend(out.data(), count, p, 2000 + r);
      g.comm->recv(in.data(), count, p, 2000 + r);
      g.comm->wait(s, "selfcheck ep pair send", p);
      if (it >= 0) times.push_back(std::chrono::duration<double>(EpClock::now() - t0).count());
    }
    std::sort(times.begin(), times.end());
    time_with[p] = times[times.size() / 2];
  }
  return time_with;
}

// The pairs' times as rows: a summary (median, slowest) and a WARN row per outlier, a pair slower
// than twice the median pair and by over 1 ms (timer and scheduling noise), naming both ranks.
// `time_with` is this rank's, by the partner's group rank (exchange_pairs). Collective.
void pair_time_rows(const Job& job, const Group& g, size_t bytes,
                    const std::vector<double>& time_with, std::vector<CheckRow>& rows) {
  const Comm& world = job.mesh->world();
  const auto& shape = job.mesh->shape();
  const int n = static_cast<int>(g.members.size());
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

}  // namespace

void selfcheck::ep_rows(const Job& job, const Group& ep_group, bool quick, double seconds,
                        std::vector<CheckRow>& rows) {
  const Comm& world = job.mesh->world();
  rows.push_back(agree_row(
      world, "all_to_all", "ep", ep_group.scope(), check_all_to_all(ep_group),
      fmt::format("counts, then uneven rows of {} floats (zeros included), exact, in source "
                  "rank order",
                  kRowFloats)));
  const size_t bytes = quick ? 256 << 10 : 4 << 20;
  const int iters = quick ? 5 : 11;  // odd: one median
  Verdict v;
  const std::vector<double> time_with = exchange_pairs(ep_group, bytes, iters, seconds, v);
  rows.push_back(agree_row(world, "p2p", "ep", ep_group.scope(), v,
                           "every pair of each EP group, both directions, exact"));
  pair_time_rows(job, ep_group, bytes, time_with, rows);
}

}  // namespace t3d::runtime
