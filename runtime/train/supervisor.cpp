#include "runtime/train/supervisor.h"

#include <fmt/format.h>

#include <algorithm>
#include <chrono>
#include <cstdio>
#include <ctime>
#include <deque>
#include <filesystem>
#include <fstream>
#include <optional>
#include <thread>

#include "checkpoint/snapshot.h"
#include "parallel/trace.h"
#include "runtime/train/metrics.h"
#include "runtime/train/stop_signal.h"

namespace t3d::runtime {

namespace fs = std::filesystem;
using Clock = std::chrono::steady_clock;

namespace {

// One failed attempt, as incidents.jsonl records it.
struct Incident {
  int attempt = 0;
  std::string cause;
  int rank = -1;
  std::string host;
  int exit_code = 0;
  long last_step = 0, snapshot_step = 0;
  double lost_s = 0;
  std::string action;

  bool same_failure(const Incident& o) const {
    return o.cause == cause && o.rank == rank && last_step <= o.last_step;
  }
};

// What ended the attempt, in words, and the rank it names (-1: none).
std::pair<std::string, int> cause_of(const MpirunOutcome& out) {
  if (out.stalled_rank >= 0)
    return {"rank " + std::to_string(out.stalled_rank) + " hung (stopped; the stall watch killed it)",
            out.stalled_rank};
  if (out.dead_rank >= 0)
    return {out.dead_signal ? "rank " + std::to_string(out.dead_rank) + " died: signal " +
                                  std::to_string(out.dead_signal)
                            : "rank " + std::to_string(out.dead_rank) +
                                  " exited without finishing MPI",
            out.dead_rank};
  if (out.code == 3)
    return {"a collective waited past parallel.timeout_s (a hung rank or an unreachable host)", -1};
  return {"the job exited with code " + std::to_string(out.code), -1};
}

// Whether the job's end is a fault a relaunch may get past.
bool restartable(const MpirunOutcome& out) {
  if (out.signal != 0) return false;  // the launcher was told to stop
  switch (out.code) {
    case 0:               // done
    case 2:               // user error: the same input fails the same way
    case kExitPreempted:  // snapshot taken; the scheduler requeues
    case 5:               // selfcheck verdict
    case 130:
      return false;
    default:
      return true;
  }
}

std::string now_iso() {
  const std::time_t t = std::time(nullptr);
  char buf[32];
  std::strftime(buf, sizeof(buf), "%Y-%m-%dT%H:%M:%SZ", std::gmtime(&t));
  return buf;
}

void record(const std::string& run_dir, const Incident& i) {
  std::ofstream f(run_dir + "/incidents.jsonl", std::ios::app);
  f << fmt::format(
      "{{\"time\": {}, \"attempt\": {}, \"cause\": {}, \"rank\": {}, \"host\": {}, "
      "\"exit_code\": {}, \"last_step\": {}, \"snapshot_step\": {}, \"lost_steps\": {}, "
      "\"lost_s\": {:.3f}, \"action\": {}}}\n",
      parallel::trace::json_string(now_iso()), i.attempt, parallel::trace::json_string(i.cause), i.rank, parallel::trace::json_string(i.host),
      i.exit_code, i.last_step, i.snapshot_step, std::max(0L, i.last_step - i.snapshot_step),
      i.lost_s, parallel::trace::json_string(i.action));
}

long newest_snapshot(const std::string& dir) {
  std::error_code ec;
  if (!fs::is_directory(dir, ec)) return 0;
  const auto steps = checkpoint::committed_steps(dir);
  return steps.empty() ? 0 : static_cast<long>(steps.back());
}

long file_size(const std::string& path) {
  std::error_code ec;
  const auto n = fs::file_size(path, ec);
  return ec ? 0 : static_cast<long>(n);
}

// The command line of a restart: this binary's `train` on the job's recipe with
// snapshot.resume = latest (a `resume` of one snapshot would go back to it every time).
std::vector<std::string> restart_argv(const Recipe& recipe, const std::string& self,
                                      const std::string& run_dir, const std::string& log_level) {
  Recipe again = recipe;
  again.snapshot.resume = "latest";
  const std::string path = run_dir + "/restart.toml";
  std::ofstream(path) << "# Written by titan3d's restart loop: the recipe of this run, resumed "
                         "from its newest snapshot.\n"
                      << again.to_toml();
  std::vector<std::string> argv = {self, "train", path};
  if (!log_level.empty()) argv.insert(argv.end(), {"--log-level", log_level});
  return argv;
}

// The last optimizer step metrics.jsonl records from byte `from` on (0 if none), and the step
// times of the lines read: all of them, and those of steps above `after` (work a restart redoes).
struct LoggedSteps {
  long last_step = 0;
  double seconds_after = 0, seconds_total = 0;
};
LoggedSteps read_logged_steps(const std::string& metrics_path, long from, long after) {
  LoggedSteps out;
  std::ifstream f(metrics_path);
  if (!f) return out;
  // A fresh start rewrites the file: then everything in it is this attempt's.
  if (file_size(metrics_path) >= from) f.seekg(from);
  long step = 0;
  double seconds = 0;
  for (std::string line; std::getline(f, line);) {
    if (std::sscanf(line.c_str(), "{\"step\": %ld", &step) != 1) continue;  // snapshot lines
    const auto at = line.find("\"step_time_s\": ");
    seconds = at == std::string::npos ? 0 : std::atof(line.c_str() + at + 15);
    out.last_step = step;
    out.seconds_total += seconds;
    if (step > after) out.seconds_after += seconds;
  }
  return out;
}

// Why the loop stops after `incident` instead of restarting, or null: the same failure as the
// previous attempt's (deterministic), or run.max_restarts used up within the window.
const char* stop_reason(const Incident& incident, const std::optional<Incident>& previous,
                        size_t restarts_in_window, const RunConfig& run) {
  if (previous && incident.same_failure(*previous)) return "stop: the same failure again";
  if (static_cast<int64_t>(restarts_in_window) >= run.max_restarts)
    return "stop: run.max_restarts reached";
  return nullptr;
}

std::string where_of(const Incident& i) {
  return i.last_step > 0 ? " after step " + std::to_string(i.last_step) : " before any step";
}

void explain_stop(const Incident& i, size_t restarts, const RunConfig& run,
                  const std::string& run_dir) {
  if (i.action == "stop: the same failure again")
    std::fprintf(stderr,
                 "titan3d: %s%s, as in the previous attempt, before getting any further: a "
                 "deterministic failure, not a transient fault; not restarting. See the rank logs "
                 "in %s/logs and incidents.jsonl\n",
                 i.cause.c_str(), where_of(i).c_str(), run_dir.c_str());
  else if (run.max_restarts > 0)
    std::fprintf(stderr,
                 "titan3d: %s%s; giving up after %zu restart(s) within %.0f s (run.max_restarts, "
                 "run.restart_window_s). Continue with `titan3d train %s/restart.toml`\n",
                 i.cause.c_str(), where_of(i).c_str(), restarts, run.restart_window_s,
                 run_dir.c_str());
}

}  // namespace

int supervise_training(const Recipe& recipe, SpawnPlan plan, const std::string& log_level) {
  const std::string run_dir = fs::path(plan.log_dir).parent_path().string();
  const std::string metrics = run_dir + "/metrics.jsonl";
  const auto start = Clock::now();
  std::deque<Clock::time_point> restarts;  // within the window
  std::optional<Incident> previous;
  double lost_s = 0, useful_s = 0;  // step time repeated or waited; step time that counts
  for (int attempt = 1;; ++attempt) {
    const long offset = file_size(metrics);
    const MpirunOutcome out = run_spawned(plan);
    if (out.code == 0 || !restartable(out)) {
      if (attempt > 1 && out.code == 0) {
        useful_s += read_logged_steps(metrics, offset, 0).seconds_total;
        const double wall = seconds_since(start);
        std::fprintf(stderr,
                     "titan3d: finished after %d restart(s): %.1f s of steps repeated or waiting "
                     "to restart; goodput %.1f%% (step time that counts over wall time; "
                     "incidents.jsonl)\n",
                     attempt - 1, lost_s, 100.0 * useful_s / std::max(wall, 1e-9));
      }
      return out.code;
    }
    Incident incident;
    incident.attempt = attempt;
    std::tie(incident.cause, incident.rank) = cause_of(out);
    incident.host = out.dead_host;
    incident.exit_code = out.code;
    incident.snapshot_step = newest_snapshot(recipe.snapshot.dir);
    const LoggedSteps logged = read_logged_steps(metrics, offset, incident.snapshot_step);
    incident.last_step = logged.last_step;
    incident.lost_s = logged.seconds_after;
    lost_s += logged.seconds_after;
    useful_s += logged.seconds_total - logged.seconds_after;
    while (!restarts.empty() && seconds_since(restarts.front()) > recipe.run.restart_window_s)
      restarts.pop_front();
    if (const char* why = stop_reason(incident, previous, restarts.size(), recipe.run)) {
      incident.action = why;
      record(run_dir, incident);
      explain_stop(incident, restarts.size(), recipe.run, run_dir);
      return out.code;
    }
    const int backoff = std::min(30, 1 << std::min<int>(restarts.size(), 5));
    incident.action = incident.snapshot_step > 0
                          ? "restart from snapshot step " + std::to_string(incident.snapshot_step)
                          : "restart from the beginning (no snapshot yet)";
    record(run_dir, incident);
    std::fprintf(stderr,
                 "titan3d: incident %d: %s%s; %s in %d s (restart %zu of at most %lld; %ld "
                 "step(s), %.1f s of work lost)\n",
                 attempt, incident.cause.c_str(), where_of(incident).c_str(),
                 incident.action.c_str(), backoff,
                 restarts.size() + 1, static_cast<long long>(recipe.run.max_restarts),
                 std::max(0L, incident.last_step - incident.snapshot_step), incident.lost_s);
    std::fflush(stderr);
    const auto down = Clock::now();
    std::this_thread::sleep_for(std::chrono::seconds(backoff));
    restarts.push_back(Clock::now());
    previous = incident;
    plan.argv = restart_argv(recipe, plan.argv.at(0), run_dir, log_level);
    lost_s += seconds_since(down);
  }
}

}  // namespace t3d::runtime
