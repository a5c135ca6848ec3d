// How titan3d finds its world: joined (mpirun, srun) or self-launched (re-executes itself under
// mpirun with the environment its ranks need, e.g. OPENBLAS_CORETYPE, which OpenBLAS reads only
// when it loads and so must be set before a rank starts).
#pragma once

#include <string>
#include <vector>

namespace t3d::runtime {

enum class Launcher { none, openmpi, pmix, slurm };
const char* launcher_name(Launcher l);

// What the environment says about this process's place in a job, before MPI_Init.
struct LaunchEnv {
  Launcher launcher = Launcher::none;
  int rank = 0;        // world rank, -1 if the launcher does not say
  int size = 1;        // world size, -1 if the launcher does not say
  int local_rank = 0;  // rank on this host
  int local_size = 1;  // ranks on this host
  std::string job_id;  // SLURM job id, if any
};
LaunchEnv detect_launch_env();
LaunchEnv detect_launch_env(const std::vector<std::pair<std::string, std::string>>& env);

struct SpawnPlan {
  int ranks = 1;
  int cores = 1;  // on this host
  bool as_root = false;
  std::vector<std::pair<std::string, std::string>> env;  // exported to every rank
  std::vector<std::string> argv;                         // titan3d's own argv, argv[0] first
  std::string log_dir;  // where the ranks' logs go, for the message naming a dead rank
};
// The mpirun command line that re-executes titan3d as `ranks` ranks.
std::vector<std::string> mpirun_command(const SpawnPlan& plan, const std::string& self_exe);
// Runs mpirun as a child (the ranks' output streams through; Open MPI's banners are filtered and a
// dead rank named, see mpirun_watch.h), then exits with its exit code.
[[noreturn]] void exec_mpirun(const SpawnPlan& plan);

// BLAS threads for each rank: the recipe's choice, or this host's cores shared among its ranks.
int threads_per_rank(int configured, int cores, int local_ranks);

}  // namespace t3d::runtime
