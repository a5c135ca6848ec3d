#include "runtime/selfcheck/selfcheck.h"

#include <fmt/format.h>

#include <algorithm>
#include <chrono>
#include <cmath>
#include <cstring>
#include <map>
#include <set>
#include <thread>

#include "kernels/check.h"
#include "kernels/ops.h"
#include "runtime/selfcheck/selfcheck_internal.h"

namespace t3d::runtime {

using parallel::Comm;
using parallel::Dim;
using parallel::ReduceOp;
using Clock = std::chrono::steady_clock;

namespace selfcheck {

Spread spread_of(const std::vector<double>& all) {
  std::vector<double> sorted = all;
  std::sort(sorted.begin(), sorted.end());
  const size_t n = sorted.size();
  Spread s;
  s.median = (sorted[(n - 1) / 2] + sorted[n / 2]) / 2;
  double var = 0;
  for (double x : all) var += (x - s.median) * (x - s.median);
  s.sd = std::sqrt(var / static_cast<double>(n));
  return s;
}

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

double all_reduce_bus_factor(int n) { return 2.0 * (n - 1) / n; }

std::vector<size_t> bandwidth_sizes(bool quick) {
  return quick ? std::vector<size_t>{1 << 10, 64 << 10, 1 << 20}
               : std::vector<size_t>{1 << 10, 16 << 10, 256 << 10, 4 << 20, 64 << 20};
}

int bandwidth_iters(bool quick, size_t bytes) {
  return quick ? 3 : bytes <= (256 << 10) ? 20 : bytes <= (4 << 20) ? 10 : 3;
}

double time_all_reduce(const parallel::TensorComm& comm, const Comm& world,
                       const kernels::Exec& exec, float* data, size_t count, int iters) {
  float probe = 0;  // a copy back of one float: returns once the device's stream has finished
  comm.all_reduce(data, count);  // warm-up: connections, buffers
  kernels::copy_to_host(exec, &probe, data, sizeof(float));
  world.barrier();
  const auto t0 = Clock::now();
  for (int it = 0; it < iters; ++it) comm.all_reduce(data, count);
  kernels::copy_to_host(exec, &probe, data, sizeof(float));
  double seconds = std::chrono::duration<double>(Clock::now() - t0).count() / iters;
  world.all_reduce(&seconds, 1, ReduceOp::max);  // the slowest rank of the slowest group
  return seconds;
}

CheckRow bandwidth_row(const std::string& group, size_t bytes, double seconds, int n,
                       const std::string& where) {
  const double algbw = static_cast<double>(bytes) / seconds / 1e9;
  return {"bandwidth",
          group,
          bytes_label(static_cast<double>(bytes)),
          CheckStatus::info,
          fmt::format("all_reduce {:8.3f} ms  algbw {:7.3f} GB/s  busbw {:7.3f} GB/s  {}",
                      seconds * 1e3, algbw, algbw * all_reduce_bus_factor(n), where),
          {}};
}

}  // namespace selfcheck

namespace {

using selfcheck::Verdict;

using selfcheck::Group;
using selfcheck::recv_before;

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
  for (const auto& g : groups) {
    const int n = static_cast<int>(g.members.size());
    if (n < 2) continue;
    const std::string where = placement(job, g);
    for (size_t bytes : selfcheck::bandwidth_sizes(quick)) {
      std::vector<float> buf(bytes / sizeof(float), 0.0f);  // zeros stay zeros: no overflow
      const double seconds =
          selfcheck::time_all_reduce(*g.comm, world, kernels::kCpu, buf.data(), buf.size(),
                                     selfcheck::bandwidth_iters(quick, bytes));
      rows.push_back(selfcheck::bandwidth_row(g.name, bytes, seconds, n, where));
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
    selfcheck::ep_rows(job, ep_group, options.quick, seconds, rows);
  }
  selfcheck::check_replicas(job, rows);
  selfcheck::check_memory(job, rows);
  selfcheck::check_idle_experts(job, rows);
  selfcheck::check_gemm(job, options.quick, rows);
  selfcheck::check_device(job, options.quick, rows);
  bandwidth_rows(job, groups, options.quick, rows);
  selfcheck::device_comm_rows(job, options.quick, rows);
  if (world.size() > 1) host_link_rows(job, options.quick, rows);
  selfcheck::host_map(job, rows);
  return report;
}

}  // namespace t3d::runtime
