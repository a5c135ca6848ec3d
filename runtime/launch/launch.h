// How titan3d finds its world: joined (mpirun, srun) or self-launched (re-executes itself under
// mpirun with the environment its ranks need, e.g. OPENBLAS_CORETYPE, which OpenBLAS reads only
// when it loads and so must be set before a rank starts).
#pragma once

#include <string>
#include <utility>
#include <vector>

#include "parallel/mesh.h"
#include "runtime/launch/mpirun_watch.h"

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
  std::string job_id;  // SLURM job id, if any (also in an sbatch script, which is no rank)
  // SLURM only: this task's node index and the step's tasks on each node, in node order.
  int node_id = 0;
  std::vector<int> tasks_per_node;
};
LaunchEnv detect_launch_env();
LaunchEnv detect_launch_env(const std::vector<std::pair<std::string, std::string>>& env);

struct SpawnPlan {
  int ranks = 1;
  int cores = 1;    // on this host
  int threads = 1;  // per rank: each rank is bound to this many cores when they all fit
  bool as_root = false;
  std::vector<std::pair<std::string, std::string>> env;  // exported to every rank
  std::vector<std::string> argv;                         // titan3d's own argv, argv[0] first
  std::string log_dir;      // where the ranks' logs go, for the message naming a dead rank
  double stall_s = 0;       // a rank stopped this long ends the job (mpirun_watch.h); 0: never
  std::string pid_dir;      // where the ranks publish their pids, for that stall watch
  std::string hostfile;     // run.hostfile (or what the restart loop kept of it); empty: this host
  int slots = 0;            // the hostfile's slots together (0: not all given)
  double stop_grace_s = 1;  // run.stop_grace_s: Open MPI's SIGTERM-to-SIGKILL wait
};
// The mpirun command line that re-executes titan3d as `ranks` ranks. Placement: when ranks ×
// threads fit the cores, each rank is bound to its own `threads` cores (--map-by slot:PE=n);
// otherwise no binding (--bind-to none), so the OS spreads the threads over every core rather
// than Open MPI's default of one core per rank, which would leave a rank's other threads idle.
// With a hostfile: ranks fill each host's slots in order (--map-by slot) unbound, since this
// host's cores say nothing of the others'; oversubscribed only past the hostfile's slots.
std::vector<std::string> mpirun_command(const SpawnPlan& plan, const std::string& self_exe);
// Runs mpirun as a child (the ranks' output streams through; Open MPI's banners are filtered and a
// dead rank named, see mpirun_watch.h), then exits with its exit code.
[[noreturn]] void exec_mpirun(const SpawnPlan& plan);
// The same, returning how mpirun ended to the caller (which goes on: `plan --calibrate`, the
// restart loop of runtime/supervise/supervisor.h).
MpirunOutcome run_spawned(const SpawnPlan& plan, const StopRequest& stop = {});

// SLURM's compressed task counts ("2(x3),1" -> {2, 2, 2, 1}); empty if malformed.
std::vector<int> parse_slurm_tasks_per_node(const std::string& text);

// Where this job's logs and metrics go: run.dir itself, or under SLURM run.dir/slurm-<job id>, so
// that jobs resubmitted with one recipe keep their logs apart (snapshots stay in run.dir's
// snapshot.dir, shared by the jobs: a resubmission resumes from them).
std::string job_run_dir(const std::string& run_dir, const LaunchEnv& env);
// Where a job's ranks publish their pids (and how they stopped, stop_signal.h) for the
// self-launched launcher: `<job_run_dir>/pids`.
std::string job_pid_dir(const std::string& job_run_dir);

// Tensor-parallel groups whose ranks run on more than one host, given each world rank's host
// name: one line per such group ("tp group of world ranks 2,3 spans hosts a (2), b (3)"), empty
// when every group is inside a host. TP all-reduces run in every layer, twice per direction:
// across a network link instead of shared memory they dominate the step.
std::vector<std::string> tp_groups_straddling_hosts(const parallel::MeshShape& shape,
                                                    const std::vector<std::string>& host_of_rank);
// The warning a user reads for those groups: what was found and how to lay the ranks out instead
// (under SLURM: tasks per node a multiple of parallel.tp). Empty when there is nothing to say.
std::string tp_placement_warning(const parallel::MeshShape& shape,
                                 const std::vector<std::string>& host_of_rank,
                                 const LaunchEnv& env);

// BLAS threads for each rank: the recipe's choice, or this host's cores shared among its ranks.
int threads_per_rank(int configured, int cores, int local_ranks);

// How the ranks' OpenMP threads wait between parallel regions, as the environment variable that
// says it: each rank owning its cores (mpirun binds them) spins a while first (GOMP_SPINCOUNT,
// libgomp's own default count), since a step runs thousands of short regions and waking a
// sleeping thread for each costs time; ranks sharing cores (or spread by a hostfile, whose hosts'
// cores this host does not know) sleep at once (OMP_WAIT_POLICY=PASSIVE), so that no spinning
// thread takes a core another rank needs.
std::pair<std::string, std::string> openmp_wait_env(int ranks, int threads, int cores,
                                                    bool hostfile);

// The CPUs this process may run on (sched_getaffinity), e.g. {0, 1}.
std::vector<int> cpu_set();
std::string format_cpu_set(const std::vector<int>& cpus);  // {0, 1, 2, 5} -> "0-2,5"

// Logs this rank's CPU set and thread count; warns (naming the keys and the launcher options
// that fix it) when the rank may run on fewer CPUs than it has threads.
void report_cpu_binding(int threads, const LaunchEnv& env);

}  // namespace t3d::runtime
