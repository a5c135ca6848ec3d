#include "runtime/launch/launch.h"

#include <sched.h>
#include <spdlog/spdlog.h>
#include <unistd.h>

#include <algorithm>
#include <cerrno>
#include <cmath>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <map>
#include <sstream>

#include "kernels/check.h"
#include "runtime/launch/mpirun_watch.h"

extern char** environ;

namespace t3d::runtime {

const char* launcher_name(Launcher l) {
  switch (l) {
    case Launcher::none:
      return "none";
    case Launcher::openmpi:
      return "Open MPI (mpirun)";
    case Launcher::pmix:
      return "PMIx";
    case Launcher::slurm:
      return "SLURM (srun)";
  }
  return "?";
}

LaunchEnv detect_launch_env(const std::vector<std::pair<std::string, std::string>>& env) {
  const auto get = [&](const char* name) -> const std::string* {
    for (const auto& [k, v] : env)
      if (k == name) return &v;
    return nullptr;
  };
  const auto num = [&](const char* name, int fallback) {
    const std::string* v = get(name);
    return v ? std::atoi(v->c_str()) : fallback;
  };
  LaunchEnv e;
  if (const auto* job = get("SLURM_JOB_ID")) e.job_id = *job;
  if (get("OMPI_COMM_WORLD_SIZE")) {
    e.launcher = Launcher::openmpi;
    e.rank = num("OMPI_COMM_WORLD_RANK", 0);
    e.size = num("OMPI_COMM_WORLD_SIZE", 1);
    e.local_rank = num("OMPI_COMM_WORLD_LOCAL_RANK", 0);
    e.local_size = num("OMPI_COMM_WORLD_LOCAL_SIZE", 1);
  } else if (get("SLURM_STEP_ID") && get("SLURM_PROCID")) {
    // A task of an srun step (the sbatch script itself has no step id and is not a rank).
    e.launcher = Launcher::slurm;
    e.rank = num("SLURM_PROCID", 0);
    e.size = num("SLURM_NTASKS", 1);
    e.local_rank = num("SLURM_LOCALID", 0);
    e.node_id = num("SLURM_NODEID", 0);
    // The step's layout first (an srun may use fewer tasks than the allocation), then the
    // job's. SLURM_NTASKS_PER_NODE is set only when the user asked for it, and is the same
    // number on every node, whereas the layout may be uneven ("3,2").
    for (const char* key : {"SLURM_STEP_TASKS_PER_NODE", "SLURM_TASKS_PER_NODE"})
      if (const auto* v = get(key); v && e.tasks_per_node.empty())
        e.tasks_per_node = parse_slurm_tasks_per_node(*v);
    if (e.node_id >= 0 && e.node_id < static_cast<int>(e.tasks_per_node.size()))
      e.local_size = e.tasks_per_node[e.node_id];
    else
      e.local_size = num("SLURM_NTASKS_PER_NODE", 1);
  } else if (get("PMIX_RANK")) {
    e.launcher = Launcher::pmix;
    e.rank = num("PMIX_RANK", 0);
    e.size = -1;  // PMIx publishes the size through its API, MPI_Init will tell
    e.local_rank = num("PMIX_LOCAL_RANK", 0);
    e.local_size = num("PMIX_LOCAL_SIZE", 1);
  }
  return e;
}

LaunchEnv detect_launch_env() {
  std::vector<std::pair<std::string, std::string>> env;
  for (char** p = environ; *p; ++p) {
    const char* eq = std::strchr(*p, '=');
    if (eq) env.emplace_back(std::string(*p, static_cast<size_t>(eq - *p)), std::string(eq + 1));
  }
  return detect_launch_env(env);
}

namespace {
std::string join(const std::vector<int>& values) {  // {2, 3} -> "2,3"
  std::string out;
  for (int v : values) {
    if (!out.empty()) out += ',';
    out += std::to_string(v);
  }
  return out;
}
}  // namespace

std::vector<int> parse_slurm_tasks_per_node(const std::string& text) {
  std::vector<int> out;
  std::stringstream items(text);
  for (std::string item; std::getline(items, item, ',');) {
    int count = 0, repeat = 1;
    char close = 0;
    // "4" or "4(x2)"; anything else means we misread the variable: report nothing.
    const int got = std::sscanf(item.c_str(), "%d(x%d%c", &count, &repeat, &close);
    const bool plain = got == 1 && item.find_first_not_of("0123456789") == std::string::npos;
    if (!plain && !(got == 3 && close == ')')) return {};
    if (count < 0 || repeat < 1 || repeat > 1 << 20) return {};
    out.insert(out.end(), static_cast<size_t>(repeat), count);
  }
  return out;
}

std::string job_run_dir(const std::string& run_dir, const LaunchEnv& env) {
  if (env.job_id.empty()) return run_dir;
  return run_dir + "/slurm-" + env.job_id;
}

std::string job_pid_dir(const std::string& job_run_dir) { return job_run_dir + "/pids"; }

std::vector<std::string> tp_groups_straddling_hosts(const parallel::MeshShape& shape,
                                                    const std::vector<std::string>& host_of_rank) {
  using parallel::Dim;
  std::vector<std::string> out;
  for (int r = 0; r < shape.world(); ++r) {
    const std::vector<int> group = shape.group(Dim::tp, r);
    if (group.front() != r) continue;  // each group once, from its first member
    std::map<std::string, std::vector<int>> by_host;
    for (int m : group) by_host[host_of_rank.at(m)].push_back(m);
    if (by_host.size() < 2) continue;
    std::string line = "tp group of world ranks " + join(group) + " spans hosts";
    const char* sep = " ";
    for (const auto& [host, ranks] : by_host) {
      line += sep + host + " (" + join(ranks) + ")";
      sep = ", ";
    }
    out.push_back(line);
  }
  return out;
}

std::string tp_placement_warning(const parallel::MeshShape& shape,
                                 const std::vector<std::string>& host_of_rank,
                                 const LaunchEnv& env) {
  const auto groups = tp_groups_straddling_hosts(shape, host_of_rank);
  if (groups.empty()) return "";
  const int tp = shape.size(parallel::Dim::tp);
  std::string msg = std::to_string(groups.size()) + " of " + std::to_string(shape.world() / tp) +
                    " tensor-parallel groups straddle hosts: their all-reduces (every layer, "
                    "forward and backward) cross the network. ";
  msg += groups.front();
  if (groups.size() > 1) msg += "; ...";
  msg +=
      ". TP groups are consecutive world ranks, so every host needs a multiple of "
      "parallel.tp = " +
      std::to_string(tp) + " ranks, placed in blocks (";
  if (env.launcher == Launcher::slurm) {
    const std::string layout = join(env.tasks_per_node);
    msg += "SLURM placed " + (layout.empty() ? std::string("?") : layout) +
           " tasks per node: use --ntasks-per-node=<multiple of " + std::to_string(tp) +
           "> and the default block distribution";
  } else {
    msg +=
        "mpirun: --map-by slot, or a hostfile with slots=<multiple of " + std::to_string(tp) + ">";
  }
  return msg + "), or lower parallel.tp.";
}

std::vector<int> cpu_set() {
  cpu_set_t set;
  CPU_ZERO(&set);
  std::vector<int> out;
  if (sched_getaffinity(0, sizeof(set), &set) != 0) return out;
  for (int c = 0; c < CPU_SETSIZE; ++c)
    if (CPU_ISSET(c, &set)) out.push_back(c);
  return out;
}

std::string format_cpu_set(const std::vector<int>& cpus) {
  std::string out;
  for (size_t i = 0; i < cpus.size();) {
    size_t j = i;
    while (j + 1 < cpus.size() && cpus[j + 1] == cpus[j] + 1) ++j;
    if (!out.empty()) out += ',';
    out += std::to_string(cpus[i]);
    if (j > i) out += '-' + std::to_string(cpus[j]);
    i = j + 1;
  }
  return out.empty() ? "?" : out;
}

void report_cpu_binding(int threads, const LaunchEnv& env) {
  const std::vector<int> cpus = cpu_set();
  spdlog::info("CPU set {} ({} CPU{}) for {} thread{}", format_cpu_set(cpus), cpus.size(),
               cpus.size() == 1 ? "" : "s", threads, threads == 1 ? "" : "s");
  if (cpus.empty() || static_cast<int>(cpus.size()) >= threads) return;
  spdlog::warn(
      "this rank has {} thread(s) (hardware.threads_per_rank) but may run on {} CPU(s): "
      "its threads share them and the rank runs at a fraction of its speed. {}",
      threads, cpus.size(),
      env.launcher == Launcher::slurm
          ? "Give each task its cores: srun --cpus-per-task=" + std::to_string(threads) +
                " (or #SBATCH --cpus-per-task), or lower hardware.threads_per_rank."
          : "Bind each rank to its cores: mpirun --map-by slot:PE=" + std::to_string(threads) +
                " (or --bind-to none), or lower hardware.threads_per_rank.");
}

int threads_per_rank(int configured, int cores, int local_ranks) {
  if (configured > 0) return configured;
  return std::max(1, cores / std::max(1, local_ranks));
}

std::pair<std::string, std::string> openmp_wait_env(int ranks, int threads, int cores,
                                                    bool hostfile) {
  if (!hostfile && static_cast<int64_t>(ranks) * threads <= cores)
    return {"GOMP_SPINCOUNT", "300000"};
  return {"OMP_WAIT_POLICY", "PASSIVE"};
}

std::vector<std::string> mpirun_command(const SpawnPlan& plan, const std::string& self_exe) {
  std::vector<std::string> cmd = {"mpirun", "-np", std::to_string(plan.ranks)};
  if (!plan.hostfile.empty()) {
    cmd.insert(cmd.end(), {"--hostfile", plan.hostfile, "--map-by", "slot", "--bind-to", "none"});
    if (plan.slots > 0 && plan.ranks > plan.slots) cmd.push_back("--oversubscribe");
  } else {
    // Without this Open MPI refuses more ranks than cores ("not enough slots").
    if (plan.ranks > plan.cores) cmd.push_back("--oversubscribe");
    if (static_cast<int64_t>(plan.ranks) * plan.threads <= plan.cores) {
      cmd.insert(cmd.end(),
                 {"--map-by", "slot:PE=" + std::to_string(plan.threads), "--bind-to", "core"});
    } else {
      cmd.insert(cmd.end(), {"--bind-to", "none"});
    }
  }
  if (plan.as_root) cmd.push_back("--allow-run-as-root");
  // A SIGTERM to mpirun itself (systemd, a scheduler signalling every process) reaches the ranks
  // as a stop; this is how long they get to finish the step and its snapshot.
  cmd.insert(cmd.end(), {"--mca", "odls_base_sigkill_timeout",
                         std::to_string(static_cast<int>(std::ceil(plan.stop_grace_s)))});
  // Not --quiet: it also hides which rank died. The parent filters mpirun's banners instead
  // (mpirun_watch.h): a dead rank is named, banners that repeat the ranks' own errors dropped.
  for (const auto& [k, v] : plan.env) {
    cmd.push_back("-x");
    cmd.push_back(k + "=" + v);
  }
  cmd.push_back(self_exe);
  for (size_t i = 1; i < plan.argv.size(); ++i) cmd.push_back(plan.argv[i]);
  return cmd;
}

MpirunOutcome run_spawned(const SpawnPlan& plan, const StopRequest& stop) {
  char self[4096];
  const ssize_t n = readlink("/proc/self/exe", self, sizeof(self) - 1);
  T3D_ASSERT(n > 0, "cannot resolve /proc/self/exe");
  self[n] = '\0';
  std::fflush(nullptr);
  return run_mpirun_watched(mpirun_command(plan, self), plan.log_dir, plan.stall_s, plan.pid_dir,
                            stop);
}

void exec_mpirun(const SpawnPlan& plan) { std::_Exit(run_spawned(plan).code); }

}  // namespace t3d::runtime
