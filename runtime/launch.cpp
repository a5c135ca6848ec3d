#include "runtime/launch.h"

#include <unistd.h>

#include <algorithm>
#include <cerrno>
#include <cstdlib>
#include <cstring>

#include "kernels/check.h"
#include "runtime/mpirun_watch.h"

extern char** environ;

namespace t3d::runtime {

const char* launcher_name(Launcher l) {
  switch (l) {
    case Launcher::none: return "none";
    case Launcher::openmpi: return "Open MPI (mpirun)";
    case Launcher::pmix: return "PMIx";
    case Launcher::slurm: return "SLURM (srun)";
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
    e.local_size = num("SLURM_NTASKS_PER_NODE", num("SLURM_TASKS_PER_NODE", 1));
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

int threads_per_rank(int configured, int cores, int local_ranks) {
  if (configured > 0) return configured;
  return std::max(1, cores / std::max(1, local_ranks));
}

std::vector<std::string> mpirun_command(const SpawnPlan& plan, const std::string& self_exe) {
  std::vector<std::string> cmd = {"mpirun", "-np", std::to_string(plan.ranks)};
  // Without this Open MPI refuses more ranks than cores ("not enough slots").
  if (plan.ranks > plan.cores) cmd.push_back("--oversubscribe");
  if (plan.as_root) cmd.push_back("--allow-run-as-root");
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

void exec_mpirun(const SpawnPlan& plan) {
  char self[4096];
  const ssize_t n = readlink("/proc/self/exe", self, sizeof(self) - 1);
  T3D_ASSERT(n > 0, "cannot resolve /proc/self/exe");
  self[n] = '\0';
  std::fflush(nullptr);
  std::_Exit(run_mpirun_watched(mpirun_command(plan, self), plan.log_dir));
}

}  // namespace t3d::runtime
