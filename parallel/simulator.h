// Predicting a schedule: per-action times under a simple cost model, the bubble fraction, a
// terminal timeline and an SVG picture, and the summary `titan3d plan --schedule` prints.
//
// Cost model: costs are per *stage* (all of a stage's layers); with v chunks per stage a chunk
// action costs 1/v of it, so interleaving does not change the total work. BW costs b + w.
// A dependency produced on another rank adds `comm` (the transfer); on the same rank, nothing.
// Every rank runs its list in order; an action starts when the rank is free and its inputs are
// in (blocking receive, non-blocking send: see parallel/schedule.h).
#pragma once

#include <filesystem>
#include <optional>
#include <string>
#include <vector>

#include "parallel/schedule.h"

namespace t3d::parallel {

struct Costs {
  double f = 1.0;     // forward of one stage
  double b = 1.0;     // input-gradient backward of one stage
  double w = 1.0;     // weight-gradient backward of one stage
  double comm = 0.0;  // one point-to-point transfer between neighbouring ranks
};

struct TimedAction {
  Action action;
  double start = 0.0;
  double end = 0.0;
};

struct Timeline {
  ScheduleKind kind = ScheduleKind::k1F1B;
  int pp = 1, n_micro = 1, v = 1;
  std::vector<std::vector<TimedAction>> ranks;  // in each rank's execution order
  std::vector<double> busy;                     // per rank: sum of its action durations
  double makespan = 0.0;
  double bubble_fraction = 0.0;  // 1 - sum(busy) / (pp * makespan)
};

// Simulates a valid schedule; InternalError if it stalls (run validate() for a readable report).
Timeline simulate(const Schedule& s, const Costs& costs);

// The engine behind both: fills *out and returns "" when every action ran, else a description
// of the stall (each unfinished rank's blocked action and the dependency it waits for).
// Assumes the table is well formed (each action exactly once, on its chunk's rank).
std::string simulate_or_stall(const Schedule& s, const Costs& costs, Timeline* out);

// Closed-form bubble fraction for uniform costs and comm = 0, where one is known:
//   GPipe, 1F1B:  (p - 1) / (m + p - 1)              (any f, b, w)
//   interleaved:  (p - 1) / (v m + p - 1)
//   ZB-H1:        (p - 1)(f + b - w) / (m (f + b + w) + (p - 1)(f + b - w))
//                 (Qi et al.'s idle time (p - 1)(f + b - w); needs w <= f + b and m >= p)
// nullopt otherwise (comm > 0, ZB-H1 outside its conditions, ZB-V: generated, no closed form).
std::optional<double> textbook_bubble_fraction(ScheduleKind kind, int pp, int n_micro, int v,
                                               const Costs& costs);

// What `titan3d plan --schedule` prints.
struct ScheduleSummary {
  ScheduleKind kind = ScheduleKind::k1F1B;
  int pp = 1, n_micro = 1, v = 1;
  Costs costs;
  double makespan = 0.0;
  double bubble_fraction = 0.0;
  std::optional<double> textbook_bubble;
  std::vector<int> peak_in_flight;  // per rank, in chunks (1/v of a stage's activations)
  int64_t actions = 0;
};

ScheduleSummary summarize(const Schedule& s, const Costs& costs);
std::string format_summary(const ScheduleSummary& summary);

// One row per rank, one character per `cell` time units (0: half the shortest action, so every
// action shows at least its letter and micro-batch digit). An action prints its letter then its
// micro-batch number mod 10: `F3`, `B3`, `W3`, fused BW as `B333` (twice as long); chunks of odd
// virtual rounds (chunk / pp odd) in lower case; `.` is idle.
std::string render_text(const Timeline& t, double cell = 0.0);

// The same picture as an SVG file; UserError when the file cannot be written.
void write_svg(const Timeline& t, const std::filesystem::path& path);

}  // namespace t3d::parallel
