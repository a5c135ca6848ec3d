#include "runtime/supervise/supervisor.h"

#include <fmt/format.h>

#include <algorithm>
#include <chrono>
#include <csignal>
#include <cstdio>
#include <ctime>
#include <deque>
#include <filesystem>
#include <fstream>
#include <future>
#include <optional>
#include <thread>

#include "checkpoint/memory_tier_files.h"
#include "checkpoint/snapshot.h"
#include "parallel/trace.h"
#include "runtime/launch/job.h"
#include "runtime/launch/logging.h"
#include "runtime/launch/stop_signal.h"
#include "runtime/supervise/elastic.h"
#include "runtime/supervise/exclude.h"
#include "runtime/supervise/incident.h"

namespace t3d::runtime {

namespace fs = std::filesystem;
using Clock = std::chrono::steady_clock;

namespace {

// The newest memory-tier snapshot of job `job_id` committed in this host's /dev/shm (0: none):
// what a restart is expected to resume when it is newer than the disk's (the ranks decide, over
// every host's, and say so in the restore line of incidents.jsonl).
long newest_memory_snapshot(const std::string& job_id) {
  long newest = 0;
  std::error_code ec;
  const std::string prefix = "titan3d-" + job_id + "-";
  for (const auto& e : fs::directory_iterator(checkpoint::memory_tier_root(), ec)) {
    if (e.path().filename().string().compare(0, prefix.size(), prefix) != 0) continue;
    const auto steps = checkpoint::manifest_steps(e.path().string());
    if (!steps.empty()) newest = std::max(newest, static_cast<long>(steps.back()));
  }
  return newest;
}

// Sets `key` in the ranks' environment.
void set_env(SpawnPlan& plan, const std::string& key, const std::string& value) {
  for (auto& [k, v] : plan.env)
    if (k == key) {
      v = value;
      return;
    }
  plan.env.emplace_back(key, value);
}

long newest_snapshot(const std::string& dir) {
  std::error_code ec;
  if (!fs::is_directory(dir, ec)) return 0;
  const auto steps = checkpoint::committed_steps(dir);
  return steps.empty() ? 0 : static_cast<long>(steps.back());
}

// Where a relaunch of the job continues: the newest snapshot of its snapshot.dir that verifies
// (what `snapshot.resume = latest` restores), else the snapshot the job was started from (a
// `resume` of another run's or an import's snapshot: never a fresh start over it), else the
// beginning (resume "", step 0).
struct ResumePoint {
  std::string resume;  // snapshot.resume of the relaunch
  long step = 0;
};
ResumePoint resume_point(const Recipe& recipe) {
  const auto step_of = [](const std::string& path) -> long {
    try {
      return static_cast<long>(checkpoint::SnapshotReader(path).info().step);
    } catch (const std::exception&) {
      return 0;  // the relaunch itself says what is wrong with it
    }
  };
  std::error_code ec;
  if (fs::is_directory(recipe.snapshot.dir, ec)) {
    std::vector<std::string> skipped;
    std::string newest;
    try {
      newest = checkpoint::find_latest(recipe.snapshot.dir, &skipped);
    } catch (const std::exception&) {
    }
    if (!newest.empty()) return {"latest", step_of(newest)};
  }
  const std::string& started = recipe.snapshot.resume;
  if (!started.empty() && started != "latest") return {started, step_of(started)};
  return {"latest", 0};
}

long file_size(const std::string& path) {
  std::error_code ec;
  const auto n = fs::file_size(path, ec);
  return ec ? 0 : static_cast<long>(n);
}

// The command line of a restart: this binary's `train` on the job's recipe (its overrides
// included) resumed from resume_point: its newest snapshot, else the one it started from.
std::vector<std::string> restart_argv(const Recipe& recipe, const std::string& self,
                                      const std::string& run_dir, const std::string& log_level) {
  Recipe again = recipe;
  again.snapshot.resume = resume_point(recipe).resume;
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
  const std::string stop = "stop: ";
  // An unreachable host's stop, or run.on_corruption = exclude's: it names the hosts and why.
  if (i.action.rfind(stop + "unreachable", 0) == 0 || i.exit_code == kExitCorruption)
    std::fprintf(stderr, "titan3d: %s%s; %s\n", i.cause.c_str(), where_of(i).c_str(),
                 i.action.substr(stop.size()).c_str());
  else if (i.action == "stop: the same failure again")
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

// The job as it was launched on a set of hosts: what an elastic shrink changes.
struct Placement {
  Recipe recipe;                 // with dp resolved and any shrink applied
  std::vector<HostEntry> hosts;  // run.hostfile's, less those dropped (empty: this host only)
  int ranks = 0, slots = 0;
  std::string hostfile;
};

// The restart loop's state across attempts.
struct Loop {
  Recipe recipe;  // the job's recipe, with dp resolved and any shrink applied
  SpawnPlan plan;
  std::string run_dir, metrics, log_level;
  std::vector<HostEntry> hosts;  // run.hostfile's, less those dropped (empty: this host only)
  std::optional<Placement> before_shrink;  // the placement the first shrink left, to regrow to
  std::deque<Clock::time_point> restarts;  // within the window
  std::optional<Incident> previous;
  long started_at = 0;     // the step the current attempt resumed from (0: the beginning)
  std::string memory_job;  // the memory tier's job id (snapshot.memory_every > 0), else empty
  RankBytes rank_bytes;    // prices a shrink (elastic.h)
  SupervisedRun result;

  Placement placement() const { return {recipe, hosts, plan.ranks, plan.slots, plan.hostfile}; }
  void place(const Placement& p) {
    recipe = p.recipe;
    hosts = p.hosts;
    plan.ranks = p.ranks, plan.slots = p.slots, plan.hostfile = p.hostfile;
  }
};

// The hosts of `all` that `now` lacks.
std::vector<HostEntry> dropped_hosts(const std::vector<HostEntry>& all,
                                     const std::vector<HostEntry>& now) {
  std::vector<HostEntry> out;
  for (const auto& h : all)
    if (std::none_of(now.begin(), now.end(), [&](const HostEntry& n) { return n.host == h.host; }))
      out.push_back(h);
  return out;
}

// The StopRequest of a shrunk job's attempt (run.elastic_regrow_s): every `every_s` it probes the
// dropped hosts on a thread of its own (the watch it is polled from must not block), and answers
// true once all of them answer. Only after the attempt logged a step, so that the ranks' stop
// handler (the preemption path) is in place.
class RegrowWatch {
 public:
  RegrowWatch(std::vector<HostEntry> dropped, bool as_root, double every_s, std::string metrics,
              long metrics_offset)
      : dropped_(std::move(dropped)),
        as_root_(as_root),
        every_s_(every_s),
        metrics_(std::move(metrics)),
        offset_(metrics_offset),
        last_(Clock::now()) {}
  ~RegrowWatch() {
    if (probe_.valid()) probe_.wait();  // each probe has its own deadline
  }
  RegrowWatch(const RegrowWatch&) = delete;
  RegrowWatch& operator=(const RegrowWatch&) = delete;

  bool operator()() {
    if (probe_.valid()) {
      if (probe_.wait_for(std::chrono::seconds(0)) != std::future_status::ready) return false;
      last_ = Clock::now();
      return probe_.get();
    }
    if (std::chrono::duration<double>(Clock::now() - last_).count() < every_s_) return false;
    if (!stepped_ && read_logged_steps(metrics_, offset_, 0).last_step == 0) return false;
    stepped_ = true;
    probe_ = std::async(std::launch::async, [hosts = dropped_, as_root = as_root_] {
      return unreachable_hosts(hosts, as_root, 10.0).empty();
    });
    return false;
  }

 private:
  std::vector<HostEntry> dropped_;
  bool as_root_;
  double every_s_;
  std::string metrics_;
  long offset_;
  bool stepped_ = false;
  Clock::time_point last_;
  std::future<bool> probe_;
};

// A shrunk job whose dropped hosts all answer again (RegrowWatch) stopped at a snapshot of its
// step: back to the placement before the shrink, relaunched from that snapshot.
void regrow(Loop& loop, long offset) {
  const Placement& before = *loop.before_shrink;
  std::string names;
  for (const auto& h : dropped_hosts(before.hosts, loop.hosts))
    names += (names.empty() ? "host " : ", host ") + h.host;
  const std::string change = describe_layout(loop.recipe) + " -> " + describe_layout(before.recipe);
  const LoggedSteps logged = read_logged_steps(loop.metrics, offset, 0);
  loop.result.useful_s += logged.seconds_total;
  loop.place(before);
  loop.before_shrink.reset();
  loop.result.layout_changes.push_back({true, change + " with " + names + " back"});
  std::fprintf(stderr,
               "titan3d: elastic: %s reachable again; stopped at the snapshot of step %ld and "
               "continuing on all %zu hosts: %s\n",
               names.c_str(), newest_snapshot(loop.recipe.snapshot.dir), loop.hosts.size(),
               change.c_str());
  std::fflush(stderr);
  loop.plan.argv = restart_argv(loop.recipe, loop.plan.argv.at(0), loop.run_dir, loop.log_level);
  // Stopped gracefully, the ranks removed the memory tier: the relaunch starts a fresh one.
  if (!loop.memory_job.empty()) set_env(loop.plan, "T3D_MEMORY_TIER_RESTORE", "0");
}

// The elastic shrink onto `remaining` (loop.hosts less those `lost` names, "unreachable host X
// (why)" or "host X (silent data corruption ...)"): rewrites the plan and the recipe the
// relaunch runs and returns "", the incident's action saying what changed; or the stop reason
// when it cannot (`by`: the key that asked for it).
std::string shrink_onto(Loop& loop, Incident& incident, const std::vector<HostEntry>& remaining,
                        const std::string& lost, const std::string& by) {
  const std::string names = lost.substr(lost.find("host"));
  if (static_cast<int64_t>(loop.restarts.size()) >= loop.recipe.run.max_restarts)
    return "stop: " + lost + "; " + by + " would shrink, but run.max_restarts (" +
           std::to_string(loop.recipe.run.max_restarts) + ") is reached";
  const int capacity = remaining_capacity(loop.hosts, remaining, loop.plan.ranks);
  const Shrink shrink = plan_shrink(loop.recipe, capacity, loop.rank_bytes);
  if (!shrink.why_not.empty()) {
    restart_argv(loop.recipe, loop.plan.argv.at(0), loop.run_dir, loop.log_level);
    return "stop: " + lost + "; " + by + " cannot shrink: " + shrink.why_not +
           "; then continue with `titan3d train " + loop.run_dir + "/restart.toml`";
  }
  if (!loop.before_shrink) loop.before_shrink = loop.placement();
  Recipe smaller = shrunk_recipe(loop.recipe, shrink);
  const std::string change = describe_layout(loop.recipe) + " -> " + describe_layout(smaller);
  // restart.toml names the hostfile it runs on, so that continuing it by hand starts the same.
  smaller.run.hostfile = loop.run_dir + "/hostfile.elastic";
  loop.place({smaller, remaining, shrink.ranks, total_slots(remaining), smaller.run.hostfile});
  write_hostfile(loop.plan.hostfile, remaining);
  loop.result.layout_changes.push_back({false, change + " without " + names});
  std::fprintf(stderr,
               "titan3d: elastic: %s; continuing on the %zu remaining host(s) (%s): "
               "%s, train.global_batch = %lld kept%s\n",
               lost.c_str(), remaining.size(), loop.plan.hostfile.c_str(), change.c_str(),
               static_cast<long long>(smaller.train.global_batch),
               shrink.note.empty() ? "" : ("; " + shrink.note).c_str());
  incident.action = "shrink to " + describe_layout(smaller) + " without " + names + "; ";
  return "";
}

// With several hosts: the hosts mpirun cannot reach now. Without run.elastic that ends the job
// (a relaunch on the same hosts cannot start): returns the stop reason. With it, drops them,
// shrinks dp to what the others can take and rewrites the plan and the recipe the relaunch runs:
// returns "", and the incident's action says what changed.
std::string handle_lost_hosts(Loop& loop, Incident& incident) {
  if (loop.hosts.size() < 2) return "";
  const double timeout = std::clamp(loop.recipe.parallel.timeout_s, 10.0, 60.0);
  const auto lost = unreachable_hosts(loop.hosts, loop.plan.as_root, timeout);
  if (lost.empty()) return "";
  std::string names;
  std::vector<HostEntry> remaining;
  for (const auto& h : loop.hosts) {
    const auto it = std::find_if(lost.begin(), lost.end(),
                                 [&](const LostHost& l) { return l.host.host == h.host; });
    if (it == lost.end())
      remaining.push_back(h);
    else
      names += (names.empty() ? "" : ", ") + ("host " + h.host + " (" + it->why + ")");
  }
  incident.host = lost.front().host.host;
  if (!loop.recipe.run.elastic || remaining.empty()) {
    // The recipe the message tells the user to continue with, once the host is mended.
    restart_argv(loop.recipe, loop.plan.argv.at(0), loop.run_dir, loop.log_level);
    return "stop: unreachable " + names +
           (remaining.empty() ? "; no host is left"
                              : "; a restart on the same hosts cannot start. Set run.elastic = "
                                "true to continue on the remaining hosts with a smaller dp, or "
                                "mend the host or remove it from run.hostfile, then continue with "
                                "`titan3d train " +
                                    loop.run_dir + "/restart.toml`");
  }
  return shrink_onto(loop, incident, remaining, "unreachable " + names, "run.elastic");
}

// run.on_corruption = exclude after an exit 6: the host rank 0's account names (exclude.h) is left
// out through the elastic shrink, and not taken back by a regrow. Returns the stop reason when it
// cannot be (no single host named, one host only, not in the hostfile, no smaller layout).
std::string exclude_corrupting_host(Loop& loop, Incident& incident) {
  const auto account = last_corruption(loop.run_dir + "/incidents.jsonl");
  if (!account) return "stop: exit 6 without a corruption account in incidents.jsonl";
  incident.cause = "corruption found by replay at step " + std::to_string(account->step) + " (" +
                   account->what + ")";
  incident.rank = account->rank;
  incident.host = account->host;
  const std::string exclude = "run.on_corruption = exclude";
  if (account->host.empty())
    return "stop: " + exclude + ": the candidates are on different hosts, so none is left out";
  const int at = host_index(loop.hosts, account->host, account->rank);
  if (loop.hosts.size() < 2 || at < 0)
    return "stop: " + exclude + " needs the job on several hosts (run.hostfile)" +
           (loop.hosts.size() < 2 ? "" : ", and host " + account->host + " is not found in it");
  std::vector<HostEntry> remaining = loop.hosts;
  remaining.erase(remaining.begin() + at);
  const std::string why = shrink_onto(loop, incident, remaining,
                                      "host " + loop.hosts[static_cast<size_t>(at)].host +
                                          " (silent data corruption at step " +
                                          std::to_string(account->step) + ", excluded)",
                                      exclude);
  if (why.empty()) loop.before_shrink.reset();
  return why;
}

// One failed attempt: the incident, and whether (and how) the job goes on. Returns false when
// the loop must stop (the incident is recorded and explained).
bool after_failure(Loop& loop, const MpirunOutcome& out, int attempt, long offset) {
  // A launch that failed before any rank started (a host already lost) made no run directory:
  // the incident, restart.toml and an elastic shrink's hostfile go there.
  std::error_code ec;
  fs::create_directories(loop.run_dir, ec);
  Incident incident;
  incident.attempt = attempt;
  std::tie(incident.cause, incident.rank) = cause_of(out);
  incident.host =
      !out.dead_host.empty() || out.waited_hosts.empty() ? out.dead_host : out.waited_hosts.front();
  incident.exit_code = out.code;
  const ResumePoint resume = resume_point(loop.recipe);
  incident.snapshot_step = resume.step;  // where the relaunch continues, damaged ones skipped
  // After a replay's mismatch the memory tier's newer snapshots are not verified: the disk's.
  const bool corrupted = out.code == kExitCorruption;
  const long memory_step =
      loop.memory_job.empty() || corrupted ? 0 : newest_memory_snapshot(loop.memory_job);
  if (!loop.memory_job.empty()) incident.tier = memory_step > resume.step ? "memory" : "disk";
  if (memory_step > resume.step) incident.snapshot_step = memory_step;
  const LoggedSteps logged = read_logged_steps(loop.metrics, offset, incident.snapshot_step);
  // An attempt that died before logging a step got as far as the snapshot it started from.
  incident.last_step = std::max(logged.last_step, loop.started_at);
  incident.lost_s = logged.seconds_after;
  loop.result.lost_s += logged.seconds_after;
  loop.result.useful_s += logged.seconds_total - logged.seconds_after;
  auto& restarts = loop.restarts;
  while (!restarts.empty() && seconds_since(restarts.front()) > loop.recipe.run.restart_window_s)
    restarts.pop_front();
  std::string why =
      corrupted ? exclude_corrupting_host(loop, incident) : handle_lost_hosts(loop, incident);
  const bool shrunk = !incident.action.empty();
  if (why.empty() && !shrunk)
    if (const char* repeat = stop_reason(incident, loop.previous, restarts.size(), loop.recipe.run))
      why = repeat;
  if (!why.empty()) {
    incident.action = why;
    record_incident(loop.run_dir, incident);
    explain_stop(incident, restarts.size(), loop.recipe.run, loop.run_dir);
    return false;
  }
  const int backoff = std::min(30, 1 << std::min<int>(restarts.size(), 5));
  incident.action +=
      incident.tier == "memory"
          ? "restart from memory snapshot step " + std::to_string(incident.snapshot_step)
      : resume.resume == "latest"
          ? (incident.snapshot_step > 0
                 ? "restart from snapshot step " + std::to_string(incident.snapshot_step)
                 : "restart from the beginning (no snapshot yet)")
          : "restart from " + resume.resume + " (step " + std::to_string(incident.snapshot_step) +
                ", the snapshot the job started from; none of its own yet)";
  record_incident(loop.run_dir, incident);
  std::fprintf(stderr,
               "titan3d: incident %d: %s%s; %s in %d s (restart %zu of at most %lld; %ld "
               "step(s), %.1f s of work lost)\n",
               attempt, incident.cause.c_str(), where_of(incident).c_str(), incident.action.c_str(),
               backoff, restarts.size() + 1, static_cast<long long>(loop.recipe.run.max_restarts),
               std::max(0L, incident.last_step - incident.snapshot_step), incident.lost_s);
  std::fflush(stderr);
  const auto down = Clock::now();
  if (const int sig = sleep_unless_signalled(backoff); sig != 0) {
    // No rank is running: the newest snapshot is what the job has, as after a preemption.
    loop.result.code = sig == SIGINT ? 130 : kExitPreempted;
    std::fprintf(stderr,
                 "titan3d: signal %d while waiting to restart: not restarting (exit %d); continue "
                 "with `titan3d train %s/restart.toml`\n",
                 sig, loop.result.code, loop.run_dir.c_str());
    record_stop_incident(loop.run_dir, incident, sig, loop.result.code);
    restart_argv(loop.recipe, loop.plan.argv.at(0), loop.run_dir, loop.log_level);
    return false;
  }
  restarts.push_back(Clock::now());
  loop.previous = incident;
  loop.started_at = incident.snapshot_step;
  loop.plan.argv = restart_argv(loop.recipe, loop.plan.argv.at(0), loop.run_dir, loop.log_level);
  // The relaunch takes the memory tier's inventory (runtime/train/memory_tier_copies.h).
  if (!loop.memory_job.empty())
    set_env(loop.plan, "T3D_MEMORY_TIER_RESTORE", corrupted ? "0" : "1");
  loop.result.lost_s += seconds_since(down);
  return true;
}

// The memory tier never outlives its job: the ranks removed their hosts' directories on a
// graceful end; this host's go here whatever the end. After any other end of a job on several
// hosts, every host of the job is asked too (`mpirun --host H sh -c 'rm -rf ...'`, all at once,
// 10 s at most); what an unreachable host keeps is removed at the next start of a job in this
// run directory there.
void remove_memory_tier(const Loop& loop, const MpirunOutcome& out) {
  checkpoint::remove_memory_tiers(loop.memory_job + "-");
  const bool graceful = out.code == 0 || out.code == kExitPreempted || out.code == 130;
  if (graceful || loop.hosts.size() < 2) return;
  const std::string rm = "rm -rf " + checkpoint::memory_tier_dir(loop.memory_job, "*");
  std::vector<std::future<bool>> done;
  for (const auto& h : loop.hosts)
    done.push_back(std::async(std::launch::async, [&, host = h.host] {
      std::string why;
      return run_on_host(host, loop.plan.as_root, 10.0, {"sh", "-c", rm}, &why);
    }));
  for (auto& d : done) d.wait();
}

}  // namespace

SupervisedRun supervise_training(const Recipe& recipe, SpawnPlan plan, const std::string& log_level,
                                 const RankBytes& rank_bytes) {
  Loop loop;
  loop.recipe = recipe;
  loop.rank_bytes = rank_bytes;
  if (!recipe.snapshot.resume.empty()) loop.started_at = resume_point(recipe).step;
  loop.plan = std::move(plan);
  loop.run_dir = fs::path(loop.plan.log_dir).parent_path().string();
  loop.metrics = loop.run_dir + "/metrics.jsonl";
  loop.log_level = log_level;
  if (loop.recipe.parallel.dp == -1) loop.recipe.resolve_world(loop.plan.ranks);
  if (!loop.recipe.run.hostfile.empty())
    loop.hosts = read_hostfile(loop.recipe.run.hostfile, "run.hostfile");
  if (recipe.snapshot.memory_every > 0) {
    // One id for the job across its restarts; the ranks' tier directories carry it.
    loop.memory_job = checkpoint::new_memory_tier_job_id(loop.run_dir);
    set_env(loop.plan, "T3D_MEMORY_TIER_JOB", loop.memory_job);
    set_env(loop.plan, "T3D_MEMORY_TIER_RESTORE", "0");
  }
  const auto start = Clock::now();
  int regrows = 0;  // relaunches after a regrow: not restarts after failures
  for (int attempt = 1;; ++attempt) {
    const long offset = file_size(loop.metrics);
    std::optional<RegrowWatch> watch;
    if (loop.before_shrink && loop.recipe.run.elastic_regrow_s > 0 &&
        loop.recipe.snapshot.every > 0)
      watch.emplace(dropped_hosts(loop.before_shrink->hosts, loop.hosts), loop.plan.as_root,
                    loop.recipe.run.elastic_regrow_s, loop.metrics, offset);
    const MpirunOutcome out =
        run_spawned(loop.plan, watch ? StopRequest(std::ref(*watch)) : StopRequest());
    watch.reset();
    // Stopped for the regrow alone: a signal to this launcher meanwhile means stop (preemption).
    if (out.stop_asked && out.signal == 0 && out.code == kExitPreempted) {
      regrow(loop, offset);
      ++regrows;
      continue;
    }
    loop.result.code = out.code;
    loop.result.restarts = attempt - 1 - regrows;
    const bool exclude = out.code == kExitCorruption && out.signal == 0 &&
                         loop.recipe.run.on_corruption == OnCorruption::kExclude;
    if (out.code == 0 || !(restartable(out) || exclude) ||
        !after_failure(loop, out, attempt, offset)) {
      // after_failure may have set the code of a stop during its backoff.
      if (out.code == 0)
        loop.result.useful_s += read_logged_steps(loop.metrics, offset, 0).seconds_total;
      release_lock_of_ended_job(loop.run_dir);
      if (!loop.memory_job.empty()) remove_memory_tier(loop, out);
      loop.result.wall_s = seconds_since(start);
      return loop.result;
    }
  }
}

}  // namespace t3d::runtime
