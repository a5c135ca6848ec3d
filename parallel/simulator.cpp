#include "parallel/simulator.h"

#include <algorithm>
#include <cmath>
#include <cstdio>
#include <fstream>
#include <limits>
#include <numeric>

#include "kernels/check.h"

namespace t3d::parallel {

namespace {

double duration(const Action& a, const Costs& c, int v) {
  switch (a.op) {
    case Op::kF:
      return c.f / v;
    case Op::kB:
      return c.b / v;
    case Op::kW:
      return c.w / v;
    case Op::kBW:
      return (c.b + c.w) / v;
  }
  return 0.0;
}

constexpr double kNotDone = -1.0;

// End times of finished work, indexed [mb * K + chunk]; "B" is set by B or BW, "W" by W or BW.
struct Progress {
  int K;
  std::vector<double> f, b, w;
  explicit Progress(int n_micro, int chunks)
      : K(chunks),
        f(static_cast<size_t>(n_micro * chunks), kNotDone),
        b(f.size(), kNotDone),
        w(f.size(), kNotDone) {}
  double& at(std::vector<double>& v, int mb, int k) { return v[static_cast<size_t>(mb * K + k)]; }
};

struct Dep {
  const char* what;  // for stall reports
  int mb, chunk;
  double end;  // kNotDone while missing
};

// The (at most two) inputs of an action.
int dependencies(const Schedule& s, Progress& p, const Action& a, Dep out[2]) {
  const int K = s.num_chunks();
  int n = 0;
  switch (a.op) {
    case Op::kF:
      if (a.chunk > 0) out[n++] = {"F", a.mb, a.chunk - 1, p.at(p.f, a.mb, a.chunk - 1)};
      break;
    case Op::kB:
    case Op::kBW:
      out[n++] = {"F", a.mb, a.chunk, p.at(p.f, a.mb, a.chunk)};
      if (a.chunk + 1 < K) out[n++] = {"B", a.mb, a.chunk + 1, p.at(p.b, a.mb, a.chunk + 1)};
      break;
    case Op::kW:
      out[n++] = {"B", a.mb, a.chunk, p.at(p.b, a.mb, a.chunk)};
      break;
  }
  return n;
}

}  // namespace

std::string simulate_or_stall(const Schedule& s, const Costs& costs, Timeline* out) {
  T3D_ASSERT(out != nullptr);
  Timeline& t = *out;
  t = Timeline{};
  t.kind = s.kind;
  t.pp = s.pp;
  t.n_micro = s.n_micro;
  t.v = s.v;
  t.ranks.assign(static_cast<size_t>(s.pp), {});
  t.busy.assign(static_cast<size_t>(s.pp), 0.0);

  Progress p(s.n_micro, s.num_chunks());
  std::vector<size_t> next(static_cast<size_t>(s.pp), 0);
  std::vector<double> free_at(static_cast<size_t>(s.pp), 0.0);
  // Start times depend only on finished inputs and the rank's previous action, so sweeping the
  // ranks in any order until nothing moves gives the one schedule-defined execution.
  for (bool moved = true; moved;) {
    moved = false;
    for (int r = 0; r < s.pp; ++r) {
      while (next[r] < s.ranks[r].size()) {
        const Action& a = s.ranks[r][next[r]];
        Dep deps[2];
        const int n = dependencies(s, p, a, deps);
        double start = free_at[r];
        bool ready = true;
        for (int i = 0; i < n && ready; ++i) {
          ready = deps[i].end != kNotDone;
          const bool remote = s.chunk_stage[deps[i].chunk] != r;
          start = std::max(start, deps[i].end + (remote ? costs.comm : 0.0));
        }
        if (!ready) break;
        const double end = start + duration(a, costs, s.v);
        t.ranks[r].push_back({a, start, end});
        t.busy[r] += end - start;
        free_at[r] = end;
        if (a.op == Op::kF) p.at(p.f, a.mb, a.chunk) = end;
        if (a.op == Op::kB || a.op == Op::kBW) p.at(p.b, a.mb, a.chunk) = end;
        if (a.op == Op::kW || a.op == Op::kBW) p.at(p.w, a.mb, a.chunk) = end;
        ++next[r];
        moved = true;
      }
    }
  }

  std::string stall;
  for (int r = 0; r < s.pp; ++r) {
    if (next[r] == s.ranks[r].size()) continue;
    const Action& a = s.ranks[r][next[r]];
    Dep deps[2];
    const int n = dependencies(s, p, a, deps);
    stall += detail::concat(stall.empty() ? "deadlock: " : "; ", "rank ", r, " blocked at ",
                            to_string(a), " (action ", next[r], ")");
    for (int i = 0; i < n; ++i) {
      if (deps[i].end == kNotDone)
        stall += detail::concat(" waiting for ", deps[i].what, "(", deps[i].mb, ",", deps[i].chunk,
                                ") on rank ", s.chunk_stage[deps[i].chunk]);
    }
  }
  if (!stall.empty()) return stall;

  t.makespan = *std::max_element(free_at.begin(), free_at.end());
  const double busy = std::accumulate(t.busy.begin(), t.busy.end(), 0.0);
  t.bubble_fraction = t.makespan > 0 ? 1.0 - busy / (s.pp * t.makespan) : 0.0;
  return {};
}

Timeline simulate(const Schedule& s, const Costs& costs) {
  Timeline t;
  const std::string stall = simulate_or_stall(s, costs, &t);
  T3D_ASSERT(stall.empty(), to_string(s.kind), " schedule pp=", s.pp, " m=", s.n_micro, " v=", s.v,
             ": ", stall);
  return t;
}

std::optional<double> textbook_bubble_fraction(ScheduleKind kind, int pp, int n_micro, int v,
                                               const Costs& c) {
  if (c.comm != 0.0) return std::nullopt;
  const double p = pp, m = n_micro;
  switch (kind) {
    case ScheduleKind::kGPipe:
    case ScheduleKind::k1F1B:
      return (p - 1) / (m + p - 1);
    case ScheduleKind::kInterleaved1F1B:
      return (p - 1) / (v * m + p - 1);
    case ScheduleKind::kZBH1: {
      // Steady state needs as many micro-batches as stages.
      if (c.w > c.f + c.b || n_micro < pp) return std::nullopt;
      const double idle = (p - 1) * (c.f + c.b - c.w);
      return idle / (m * (c.f + c.b + c.w) + idle);
    }
    case ScheduleKind::kZBV:
      return std::nullopt;  // a generated table, no closed form: the tests bound it instead
  }
  return std::nullopt;
}

ScheduleSummary summarize(const Schedule& s, const Costs& costs) {
  const Timeline t = simulate(s, costs);
  ScheduleSummary out;
  out.kind = s.kind;
  out.pp = s.pp;
  out.n_micro = s.n_micro;
  out.v = s.v;
  out.costs = costs;
  out.makespan = t.makespan;
  out.bubble_fraction = t.bubble_fraction;
  out.textbook_bubble = textbook_bubble_fraction(s.kind, s.pp, s.n_micro, s.v, costs);
  out.peak_in_flight = peak_in_flight(s);
  for (const auto& r : s.ranks) out.actions += static_cast<int64_t>(r.size());
  return out;
}

std::string format_summary(const ScheduleSummary& s) {
  auto fmt = [](double x) {
    char buf[32];
    std::snprintf(buf, sizeof(buf), "%g", x);
    return std::string(buf);
  };
  auto pct = [](double x) {
    char buf[32];
    std::snprintf(buf, sizeof(buf), "%.1f%%", 100.0 * x);
    return std::string(buf);
  };
  std::string out = detail::concat(
      "schedule        ", to_string(s.kind), " (pp=", s.pp, ", micro-batches=", s.n_micro,
      ", chunks/stage=", s.v, ", ", s.actions, " actions)\n",
      "costs per stage t_F=", fmt(s.costs.f), " t_B=", fmt(s.costs.b), " t_W=", fmt(s.costs.w),
      " t_comm=", fmt(s.costs.comm), "\n", "makespan        ", fmt(s.makespan), "\n",
      "bubble          ", pct(s.bubble_fraction));
  if (s.textbook_bubble) out += detail::concat(" (formula ", pct(*s.textbook_bubble), ")");
  out += "\npeak in-flight  ";
  for (size_t r = 0; r < s.peak_in_flight.size(); ++r)
    out += detail::concat(r ? " " : "", s.peak_in_flight[r]);
  out += s.v > 1 ? " (chunks per rank, 1 chunk = 1/v stage)\n" : " (micro-batches per rank)\n";
  return out;
}

std::string render_text(const Timeline& t, double cell) {
  if (cell <= 0) {
    double shortest = std::numeric_limits<double>::infinity();
    for (const auto& r : t.ranks)
      for (const auto& a : r) shortest = std::min(shortest, a.end - a.start);
    cell = std::isfinite(shortest) && shortest > 0 ? shortest / 2 : 1.0;
  }
  const auto col = [&](double time) { return static_cast<size_t>(std::llround(time / cell)); };
  const size_t width = col(t.makespan);
  std::string out;
  for (size_t r = 0; r < t.ranks.size(); ++r) {
    std::string row(width, '.');
    for (const TimedAction& ta : t.ranks[r]) {
      const Action& a = ta.action;
      const bool odd_round = (a.chunk / t.pp) % 2 == 1;
      char letter = a.op == Op::kF ? 'F' : a.op == Op::kW ? 'W' : 'B';
      if (odd_round) letter = static_cast<char>(letter - 'A' + 'a');
      const char digit = static_cast<char>('0' + a.mb % 10);
      const size_t c0 = col(ta.start), c1 = std::min(col(ta.end), width);
      for (size_t c = c0; c < c1; ++c) row[c] = c == c0 ? letter : digit;
    }
    char label[32];
    std::snprintf(label, sizeof(label), "rank %2zu |", r);
    out += label + row + "|\n";
  }
  out += detail::concat("one column = ", cell,
                        " time units; F forward, B backward (BW = B+W "
                        "fused, twice as long), W weight-grad; digit = micro-batch mod 10; lower "
                        "case = odd chunk round; . idle\n");
  return out;
}

void write_svg(const Timeline& t, const std::filesystem::path& path) {
  constexpr double kScale = 40.0, kRow = 26.0, kLeft = 70.0, kTop = 34.0;
  const double width = kLeft + t.makespan * kScale + 10, height = kTop + t.pp * kRow + 10;
  std::ofstream out(path);
  T3D_USER_CHECK(out.good(), "cannot write the schedule picture '", path.string(),
                 "'; check that the directory exists and is writable");
  out << "<svg xmlns=\"http://www.w3.org/2000/svg\" width=\"" << width << "\" height=\"" << height
      << "\" font-family=\"monospace\" font-size=\"12\">\n";
  char title[160];
  std::snprintf(title, sizeof(title), "%s  pp=%d  m=%d  v=%d  makespan %g  bubble %.1f%%",
                std::string(to_string(t.kind)).c_str(), t.pp, t.n_micro, t.v, t.makespan,
                100.0 * t.bubble_fraction);
  out << "<text x=\"4\" y=\"18\">" << title << "</text>\n";
  for (int r = 0; r < t.pp; ++r) {
    const double y = kTop + r * kRow;
    out << "<text x=\"4\" y=\"" << y + 17 << "\">rank " << r << "</text>\n";
    out << "<rect x=\"" << kLeft << "\" y=\"" << y << "\" width=\"" << t.makespan * kScale
        << "\" height=\"" << kRow - 4 << "\" fill=\"#eeeeee\"/>\n";
    for (const TimedAction& ta : t.ranks[r]) {
      const Action& a = ta.action;
      // Colours by kind; odd chunk rounds drawn lighter.
      const char* fill = a.op == Op::kF   ? "#4e79a7"
                         : a.op == Op::kB ? "#59a14f"
                         : a.op == Op::kW ? "#edc948"
                                          : "#76b7b2";
      const double opacity = (a.chunk / t.pp) % 2 ? 0.6 : 1.0;
      const double x = kLeft + ta.start * kScale, w = (ta.end - ta.start) * kScale;
      out << "<rect x=\"" << x << "\" y=\"" << y << "\" width=\"" << w << "\" height=\"" << kRow - 4
          << "\" fill=\"" << fill << "\" fill-opacity=\"" << opacity
          << "\" stroke=\"white\"><title>" << to_string(a) << " [" << ta.start << ", " << ta.end
          << ")</title></rect>\n";
      out << "<text x=\"" << x + w / 2 << "\" y=\"" << y + 15
          << "\" text-anchor=\"middle\" fill=\"black\">" << to_string(a.op) << a.mb << "</text>\n";
    }
  }
  out << "</svg>\n";
  T3D_USER_CHECK(out.good(), "writing the schedule picture '", path.string(), "' failed");
}

}  // namespace t3d::parallel
