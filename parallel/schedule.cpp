#include "parallel/schedule.h"

#include <algorithm>
#include <cmath>
#include <limits>
#include <map>
#include <optional>
#include <tuple>

#include "kernels/check.h"
#include "parallel/pipeline_split.h"
#include "parallel/simulator.h"

namespace t3d::parallel {

std::string to_string(Op op) {
  switch (op) {
    case Op::kF:
      return "F";
    case Op::kB:
      return "B";
    case Op::kW:
      return "W";
    case Op::kBW:
      return "BW";
  }
  return "?";
}

std::string to_string(const Action& a) {
  return detail::concat(to_string(a.op), "(", a.mb, ",", a.chunk, ")");
}

ScheduleKind parse_schedule_kind(std::string_view text, std::string_view key) {
  std::string names;
  for (const auto& [kind, name] : kScheduleKindNames) {
    if (text == name) return kind;
    names += (names.empty() ? "" : ", ") + std::string(name);
  }
  throw UserError(
      detail::concat(key, " = '", text, "' is not a pipeline schedule; use one of ", names));
}

std::vector<int> placement(ScheduleKind kind, int pp, int v) {
  std::vector<int> chunk_stage(static_cast<size_t>(pp * v));
  for (int k = 0; k < pp * v; ++k)
    chunk_stage[k] = static_cast<int>(stage_of_chunk(k, pp, kind == ScheduleKind::kZBV));
  return chunk_stage;
}

namespace {

Schedule empty_schedule(ScheduleKind kind, int pp, int n_micro, int v) {
  T3D_USER_CHECK(pp >= 1, "parallel.pp = ", pp, " must be >= 1");
  T3D_USER_CHECK(n_micro >= 1, "train.micro_batches = ", n_micro, " must be >= 1");
  T3D_USER_CHECK(v >= 1, "parallel.virtual_stages = ", v, " must be >= 1");
  Schedule s;
  s.kind = kind;
  s.pp = pp;
  s.n_micro = n_micro;
  s.v = v;
  s.chunk_stage = placement(kind, pp, v);
  s.ranks.resize(static_cast<size_t>(pp));
  return s;
}

Action F(int mb, int k) { return {Op::kF, mb, k}; }
Action B(int mb, int k) { return {Op::kB, mb, k}; }
Action W(int mb, int k) { return {Op::kW, mb, k}; }
Action BW(int mb, int k) { return {Op::kBW, mb, k}; }

}  // namespace

Schedule make_gpipe(int pp, int n_micro) {
  Schedule s = empty_schedule(ScheduleKind::kGPipe, pp, n_micro, 1);
  for (int st = 0; st < pp; ++st) {
    auto& r = s.ranks[st];
    for (int mb = 0; mb < n_micro; ++mb) r.push_back(F(mb, st));
    for (int mb = 0; mb < n_micro; ++mb) r.push_back(BW(mb, st));
  }
  return s;
}

// Megatron's non-interleaved schedule: warm-up, steady one-forward-one-backward, cool-down.
Schedule make_1f1b(int pp, int n_micro) {
  Schedule s = empty_schedule(ScheduleKind::k1F1B, pp, n_micro, 1);
  for (int st = 0; st < pp; ++st) {
    auto& r = s.ranks[st];
    // Enough forwards in flight that the first backward arrives just as the last one ends.
    const int warmup = std::min(pp - st - 1, n_micro);
    for (int mb = 0; mb < warmup; ++mb) r.push_back(F(mb, st));
    for (int i = 0; i < n_micro - warmup; ++i) {
      r.push_back(F(warmup + i, st));
      r.push_back(BW(i, st));
    }
    for (int mb = n_micro - warmup; mb < n_micro; ++mb) r.push_back(BW(mb, st));
  }
  return s;
}

// Megatron's interleaved schedule. Forward "virtual micro-steps" walk groups of pp micro-batches
// through the local chunks in order (chunk 0 for mb 0..pp-1, then chunk 1 for the same mbs, ...);
// backward steps walk them in reverse chunk order. Warm-up is longer than 1F1B's so that the
// first backward of the last chunk finds its input ready.
Schedule make_interleaved_1f1b(int pp, int n_micro, int v) {
  Schedule s = empty_schedule(ScheduleKind::kInterleaved1F1B, pp, n_micro, v);
  T3D_USER_CHECK(n_micro % pp == 0, "interleaved 1F1B needs train.micro_batches (", n_micro,
                 ") to be a multiple of parallel.pp (", pp, "), as in Megatron; use ",
                 (n_micro / pp + 1) * pp, " micro-batches or the 1f1b schedule");
  const int total = n_micro * v;  // (mb, local chunk) steps per rank
  const int group = pp * v;
  for (int st = 0; st < pp; ++st) {
    auto& r = s.ranks[st];
    // Micro-step i -> (micro-batch, local chunk); local chunk j on this stage is global j*pp+st.
    auto mb_of = [&](int i) { return (i / group) * pp + i % pp; };
    auto fwd = [&](int i) { return F(mb_of(i), ((i % group) / pp) * pp + st); };
    auto bwd = [&](int i) { return BW(mb_of(i), (v - 1 - (i % group) / pp) * pp + st); };
    const int warmup = std::min(total, 2 * (pp - st - 1) + (v - 1) * pp);
    for (int i = 0; i < warmup; ++i) r.push_back(fwd(i));
    for (int i = 0; i < total - warmup; ++i) {
      r.push_back(fwd(warmup + i));
      r.push_back(bwd(i));
    }
    for (int i = total - warmup; i < total; ++i) r.push_back(bwd(i));
  }
  return s;
}

// ZB-H1 (Qi et al. 2023, "Zero Bubble Pipeline Parallelism", handcrafted schedule 1).
// 1F1B's order with the backward split: B (input gradient) stays where 1F1B has its backward,
// so gradients travel upstream as early as possible, and W (weight gradient) is deferred while
// memory allows. Memory: under 1F1B stage s holds at most pp - s micro-batches, so the pipeline
// already pays for pp on stage 0; ZB-H1 lets every stage hold up to pp (a micro-batch is held
// from F until its W), which lets stage s defer s W's. The deferred W's run in the cool-down,
// filling the bubbles there, one after each B and the rest at the end.
Schedule make_zb_h1(int pp, int n_micro) {
  Schedule s = empty_schedule(ScheduleKind::kZBH1, pp, n_micro, 1);
  const int limit = std::min(pp, n_micro);
  for (int st = 0; st < pp; ++st) {
    auto& r = s.ranks[st];
    int next_f = 0, next_b = 0, next_w = 0;
    auto held = [&] { return next_f - next_w; };
    auto forward = [&] {
      if (held() == limit) r.push_back(W(next_w++, st));  // make room first
      r.push_back(F(next_f++, st));
    };
    const int warmup = std::min(pp - st - 1, n_micro);
    for (int i = 0; i < warmup; ++i) forward();
    while (next_f < n_micro) {
      forward();
      r.push_back(B(next_b++, st));
    }
    while (next_b < n_micro) {
      // Cool-down: each B waits for the gradient from downstream; one W fills that wait.
      if (next_w < next_b) r.push_back(W(next_w++, st));
      r.push_back(B(next_b++, st));
    }
    while (next_w < n_micro) r.push_back(W(next_w++, st));
  }
  return s;
}

// ZB-V (Qi et al. 2024, the V-shape schedule of "Pipeline Parallelism with Controllable Memory";
// torchtitan's ScheduleZBVZeroBubble). Two chunks per stage in a V, backward split into B and W.
//
// Choice: generated by a greedy list-scheduling simulation, not the paper's hand-built pattern.
// The pattern's warm-up runs 2pp - 1 forwards of stage 0's first chunk, so it needs
// n_micro >= 2pp - 1 and has to be patched below that; the generator gives a valid table within
// the memory promise for every (pp, n_micro), and the same code decides warm-up, steady state and
// cool-down. Whenever a rank is free it runs, among the actions whose inputs are in:
//   1. an F, the later chunk first (it leads to the loss), if that chunk has room;
//   2. a B, oldest micro-batch first;
//   3. a W, oldest first: deferred weight gradients fill what would otherwise be idle time;
// (or B before F, in one candidate). The simulation uses uniform chunk costs and an assumed
// transfer time on cross-rank edges. A table generated for free transfers runs its steady
// state with no margin, so every real transfer and every W cheaper than F lands on the critical
// path; assuming a transfer, and F first, buys slack but costs a little under uniform costs. So
// make_zb_v generates four candidates (transfer 0.25, 0.1 or 0 of a chunk action with F first;
// 0 with B first) and keeps the one with the smallest total simulated makespan over four cost
// scenarios (uniform; W = 0.7; B = 1.25, W = 0.85; transfers 0.05 .. 0.2 of a stage's F).
//
// Memory: a chunk's activations are held from F until W. The executor gives each chunk its own
// slots, so each chunk gets its own cap and the two caps sum to 1F1B's peak, 2 min(pp, n_micro)
// chunks = min(pp, n_micro) micro-batches of a whole stage. Stage r's second chunk gets r + 1
// places (its micro-batches come back late on stage 0, early on stage pp-1), the first chunk the
// rest. No stall: each chunk runs F and B in micro-batch order, so the oldest unfinished
// micro-batch always finds room (whatever else a full chunk holds is older and needs only its W,
// which is always runnable), and every cap is at least 1.
namespace {

Schedule zb_v_greedy(int pp, int n_micro, double comm, bool forward_first) {
  Schedule s = empty_schedule(ScheduleKind::kZBV, pp, n_micro, 2);
  const int K = 2 * pp, m = n_micro;
  const int cap = 2 * std::min(pp, m);
  constexpr double kNone = -1;  // chunk actions cost 1
  std::vector<double> f_end(static_cast<size_t>(m * K), kNone), b_end(f_end.size(), kNone);
  auto at = [&](std::vector<double>& v, int mb, int k) -> double& { return v[mb * K + k]; };
  struct Rank {
    int chunk[2];  // global chunks: on the way down, on the way back
    int next_f[2] = {0, 0}, next_b[2] = {0, 0};
    int held[2] = {0, 0};  // activations alive per chunk (F done, W not yet)
    int cap[2] = {0, 0};
    std::vector<Action> pending_w;  // B done, W not yet: oldest first
    double free_at = 0;
    double idle_since = -1;  // >= 0 while waiting for an input
  };
  std::vector<Rank> ranks(static_cast<size_t>(pp));
  for (int r = 0; r < pp; ++r) {
    ranks[r].chunk[0] = r, ranks[r].chunk[1] = K - 1 - r;
    // A chunk never holds more than m micro-batches: room it cannot use goes to the other.
    ranks[r].cap[0] = std::min(m, cap - std::min(r + 1, m));
    ranks[r].cap[1] = std::min(m, cap - ranks[r].cap[0]);
  }
  const size_t per_rank = static_cast<size_t>(6 * m);
  // End times so far. Ranks act in order of their free time, so these only grow: an idle
  // rank finds the next arrival (end, or end + comm on a neighbour) by binary search.
  std::vector<double> ends;
  auto next_after = [&](double t, double delay) {  // the first end + delay later than t
    // Compared as end + delay, exactly as `in` does: t - delay could round the other way.
    const auto it = std::upper_bound(ends.begin(), ends.end(), t,
                                     [&](double x, double e) { return x < e + delay; });
    return it == ends.end() ? std::numeric_limits<double>::infinity() : *it + delay;
  };
  for (;;) {
    int r = -1;
    for (int q = 0; q < pp; ++q)
      if (s.ranks[q].size() < per_rank && (r < 0 || ranks[q].free_at < ranks[r].free_at)) r = q;
    if (r < 0) break;
    T3D_ASSERT(std::isfinite(ranks[r].free_at), "zb_v generator stalled at pp=", pp, " m=", m);
    Rank& R = ranks[r];
    const double t = R.free_at;
    // Is chunk k's output (or input gradient), finished at `end`, usable on this rank at t?
    auto in = [&](double end, int k) {
      return end != kNone && end + (s.chunk_stage[k] == r ? 0 : comm) <= t;
    };
    std::optional<Action> pick;
    auto forward = [&] {  // an F: the previous chunk's output, and room in this chunk
      for (int c : {1, 0}) {
        const int mb = R.next_f[c], k = R.chunk[c];
        if (mb >= m || R.held[c] == R.cap[c] || (k > 0 && !in(at(f_end, mb, k - 1), k - 1)))
          continue;
        pick = F(mb, k);
        return;
      }
    };
    auto backward = [&] {  // a B: its F, and the input gradient from the next chunk
      for (int c : {1, 0}) {
        const int mb = R.next_b[c], k = R.chunk[c];
        if (mb >= R.next_f[c] || (k + 1 < K && !in(at(b_end, mb, k + 1), k + 1))) continue;
        if (!pick || mb < pick->mb) pick = B(mb, k);
      }
    };
    if (forward_first) {
      forward();
      if (!pick) backward();
    } else {
      backward();
      if (!pick) forward();
    }
    if (!pick && !R.pending_w.empty()) {  // 3. W: always runnable once its B has run
      pick = R.pending_w.front();
      R.pending_w.erase(R.pending_w.begin());
    }
    if (!pick) {  // idle until the next input could arrive (one produced later included)
      R.idle_since = t;
      R.free_at = std::min(next_after(t, 0), next_after(t, comm));
      continue;
    }
    R.idle_since = -1;
    const Action a = *pick;
    const double end = t + 1.0;
    const int c = a.chunk == R.chunk[0] ? 0 : 1;
    if (a.op == Op::kF) ++R.next_f[c], ++R.held[c], at(f_end, a.mb, a.chunk) = end;
    if (a.op == Op::kB) {
      ++R.next_b[c];
      R.pending_w.push_back(W(a.mb, a.chunk));
      at(b_end, a.mb, a.chunk) = end;
    }
    if (a.op == Op::kW) --R.held[c];
    s.ranks[r].push_back(a);
    R.free_at = end;
    T3D_ASSERT(ends.empty() || end >= ends.back(), "zb_v generator: time went backwards");
    ends.push_back(end);
    for (double arrival : {end, end + comm}) {
      for (Rank& q : ranks)
        if (q.idle_since >= 0 && arrival > q.idle_since) q.free_at = std::min(q.free_at, arrival);
    }
  }
  return s;
}

}  // namespace

Schedule make_zb_v(int pp, int n_micro) {
  T3D_USER_CHECK(pp >= 2, "parallel.schedule = zb_v needs parallel.pp >= 2 (got ", pp,
                 "): with one stage there is no pipeline bubble to fill and no V to fold the "
                 "chunks into; use 1f1b");
  T3D_USER_CHECK(n_micro >= 1, "train.micro_batches = ", n_micro, " must be >= 1");
  const Costs scenarios[] = {{1, 1, 1, 0}, {1, 1, 0.7, 0.05}, {1, 1.25, 0.85, 0.1}, {1, 1, 1, 0.2}};
  const std::pair<double, bool> candidates[] = {{0.25, true}, {0.1, true}, {0, true}, {0, false}};
  Schedule best;
  double best_score = std::numeric_limits<double>::infinity();
  for (const auto& [comm, forward_first] : candidates) {
    Schedule s = zb_v_greedy(pp, n_micro, comm, forward_first);
    double score = 0;
    for (const Costs& c : scenarios) score += simulate(s, c).makespan;
    if (score < best_score) best_score = score, best = std::move(s);
  }
  return best;
}

Schedule make_schedule(ScheduleKind kind, int pp, int n_micro, int v) {
  if (kind == ScheduleKind::kZBV)
    T3D_USER_CHECK(v == 2, "parallel.virtual_stages = ", v,
                   " contradicts parallel.schedule = zb_v, which always places 2 chunks per stage "
                   "(leave virtual_stages out or set it to 2)");
  else
    T3D_USER_CHECK(v == 1 || kind == ScheduleKind::kInterleaved1F1B,
                   "parallel.virtual_stages = ", v, " needs the interleaved schedule; the ",
                   to_string(kind), " schedule has one chunk per stage (set it to 1)");
  switch (kind) {
    case ScheduleKind::kGPipe:
      return make_gpipe(pp, n_micro);
    case ScheduleKind::k1F1B:
      return make_1f1b(pp, n_micro);
    case ScheduleKind::kInterleaved1F1B:
      return make_interleaved_1f1b(pp, n_micro, v);
    case ScheduleKind::kZBH1:
      return make_zb_h1(pp, n_micro);
    case ScheduleKind::kZBV:
      return make_zb_v(pp, n_micro);
  }
  T3D_ASSERT(false, "unknown schedule kind");
}

std::vector<int> peak_in_flight(const Schedule& s) {
  std::vector<int> peak(s.ranks.size(), 0);
  for (size_t st = 0; st < s.ranks.size(); ++st) {
    int held = 0;
    for (const Action& a : s.ranks[st]) {
      if (a.op == Op::kF) peak[st] = std::max(peak[st], ++held);
      if (a.op == Op::kBW || a.op == Op::kW) --held;
    }
  }
  return peak;
}

int promised_in_flight(const Schedule& s, int stage) {
  switch (s.kind) {
    case ScheduleKind::kGPipe:
      return s.n_micro;
    case ScheduleKind::k1F1B:
      return std::min(s.pp - stage, s.n_micro);
    case ScheduleKind::kInterleaved1F1B:
      return std::min(s.v * s.n_micro, 2 * (s.pp - stage - 1) + (s.v - 1) * s.pp + 1);
    case ScheduleKind::kZBH1:
      return std::min(s.pp, s.n_micro);
    case ScheduleKind::kZBV:
      return 2 * std::min(s.pp, s.n_micro);
  }
  T3D_ASSERT(false, "unknown schedule kind");
}

std::vector<std::string> validate(const Schedule& s) {
  std::vector<std::string> problems;
  const int K = s.num_chunks();
  if (static_cast<int>(s.chunk_stage.size()) != K || static_cast<int>(s.ranks.size()) != s.pp) {
    problems.push_back(detail::concat("shape: ", s.chunk_stage.size(), " chunk placements and ",
                                      s.ranks.size(), " rank lists for pp=", s.pp, " v=", s.v));
    return problems;
  }
  // Count each (op, mb, chunk) and check it sits on the rank holding its chunk.
  std::map<std::tuple<Op, int, int>, int> seen;
  for (int st = 0; st < s.pp; ++st) {
    for (const Action& a : s.ranks[st]) {
      if (a.mb < 0 || a.mb >= s.n_micro || a.chunk < 0 || a.chunk >= K) {
        problems.push_back(detail::concat("rank ", st, ": ", to_string(a), " is out of range"));
        continue;
      }
      if (s.chunk_stage[a.chunk] != st)
        problems.push_back(detail::concat("rank ", st, ": ", to_string(a), " belongs on rank ",
                                          s.chunk_stage[a.chunk]));
      ++seen[{a.op, a.mb, a.chunk}];
    }
  }
  for (int mb = 0; mb < s.n_micro; ++mb) {
    for (int k = 0; k < K; ++k) {
      auto count = [&](Op op) {
        auto it = seen.find({op, mb, k});
        return it == seen.end() ? 0 : it->second;
      };
      const int f = count(Op::kF), b = count(Op::kB), w = count(Op::kW), bw = count(Op::kBW);
      const bool ok = f == 1 && ((bw == 1 && b == 0 && w == 0) || (bw == 0 && b == 1 && w == 1));
      if (!ok)
        problems.push_back(detail::concat("micro-batch ", mb, " chunk ", k, ": ", f, " F, ", b,
                                          " B, ", w, " W, ", bw,
                                          " BW; want 1 F and either 1 BW or 1 B + 1 W"));
    }
  }
  if (!problems.empty()) return problems;  // the simulation assumes a well-formed table
  Timeline timeline;
  std::string stall = simulate_or_stall(s, Costs{}, &timeline);
  if (!stall.empty()) problems.push_back(std::move(stall));
  return problems;
}

PipelineMessages pipeline_messages(const Schedule& s) {
  PipelineMessages m;
  const int K = s.num_chunks();
  const auto stage = [&](int k) { return s.chunk_stage[static_cast<size_t>(k)]; };
  for (int r = 0; r < s.pp; ++r) {
    for (const Action& a : s.ranks[static_cast<size_t>(r)]) {
      if (a.op == Op::kW) continue;
      const bool forward = a.op == Op::kF;
      const int from = forward ? a.chunk - 1 : a.chunk + 1;  // the chunk it receives from
      const int to = forward ? a.chunk + 1 : a.chunk - 1;    // the chunk it sends to
      if (from >= 0 && from < K && stage(from) != r)
        m.taken[{stage(from), r}].emplace_back(a.mb, a.chunk, !forward);
      if (to >= 0 && to < K && stage(to) != r)
        m.sent[{r, stage(to)}].emplace_back(a.mb, to, !forward);
    }
  }
  return m;
}

bool receives_in_send_order(const Schedule& s) {
  const PipelineMessages m = pipeline_messages(s);
  return m.sent == m.taken;
}

}  // namespace t3d::parallel
