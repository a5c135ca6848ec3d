// A verb's life inside its world: spawn or join, MPI up, mesh and communicators built, run
// directory and logs in place. apps/ calls this and then the capability (trainer, selfcheck...).
#pragma once

#include <functional>
#include <memory>
#include <optional>
#include <string>
#include <vector>

#include "kernels/gemm.h"
#include "parallel/comm.h"
#include "runtime/launch/launch.h"
#include "runtime/recipe/recipe.h"

namespace t3d::runtime {

// This host's name (gethostname): in logs, locks, incidents and cache keys.
std::string host_name();

// MPI_Init_thread / MPI_Finalize as an RAII pair.
class MpiRuntime {
 public:
  MpiRuntime();
  ~MpiRuntime();
  MpiRuntime(const MpiRuntime&) = delete;
  MpiRuntime& operator=(const MpiRuntime&) = delete;
};

// Checks the recipe's inputs exist (data files, the tokenizer model) and that run.hostfile reads,
// so the user hears it before any rank starts (also `train --dry-run`).
void check_inputs(const Recipe& recipe);

// Outside a launcher, never returns: re-executes argv under mpirun with the recipe's rank count
// (`np_override` > 0 replaces it when dp = -1) and the ranks' environment (OpenBLAS core type and
// threads). Inside a launcher, returns immediately.
void spawn_if_needed(const Recipe& recipe, const std::vector<std::string>& argv, int np_override);
// What spawn_if_needed runs: ranks, their environment and log directory (run_spawned runs it and
// returns, for a verb that goes on after its ranks are done).
SpawnPlan make_spawn_plan(const Recipe& recipe, const std::vector<std::string>& argv,
                          int np_override);

// The run directory's lock, `<run_dir>/lock`, held by rank 0 of a training job for its life: a
// second live job writing into the same run directory would interleave its snapshots and metrics
// with the first's, so it is refused (UserError naming the holder: host, pid, launch id, start
// time). A lock whose holder is gone (same host, and its pid dead or now another process) is
// taken over with a warning; one held on another host cannot be checked and is refused, naming
// the file to delete if that job is known to be dead. Collective over `world`; taken before any
// rank opens its log, so a refused job does not truncate the holder's logs.
class RunLock {
 public:
  RunLock(const parallel::Comm& world, const std::string& run_dir, const std::string& hostname,
          const LaunchEnv& env);
  ~RunLock();  // removes the lock file (rank 0), unless another job took it over
  RunLock(const RunLock&) = delete;
  RunLock& operator=(const RunLock&) = delete;

 private:
  std::string path_, content_;  // empty on ranks other than 0
};

// Removes `run_dir`'s lock when it was taken on this host by a process that is gone (a rank
// killed, or a job that ended by a failure): what the supervisor does when its job has ended, so
// that the next start need not rely on stale-lock detection. Returns whether it removed one.
bool release_lock_of_ended_job(const std::string& run_dir);

// How a job computes: the linear layers' GEMM kind (kernels/gemm.h, which also decides attention's
// tile precision) and the resolved train.precision (fp32 or bf16, never auto). Decided once per
// job before any stage is built (runtime/machine/gemm_choice.h: measured for training, the
// snapshot's record for the verbs that read one) and passed from the Job to what computes with it
// or records it; the recipe keeps what the user wrote.
struct JobPrecision {
  kernels::GemmKind gemm = kernels::GemmKind::kOpenBlasF32;
  TrainPrecision train = TrainPrecision::kFp32;
  // On a GPU: the GEMM algorithms every rank installs (runtime/machine/gpu_gemm_table.h); "" on
  // the CPU, or where none was chosen (each shape then runs cuBLASLt's first heuristic answer).
  std::string gpu_gemm_table;
};

struct Job {
  Recipe recipe;  // as the user gave it (auto values stay auto: the decision is precision())
  LaunchEnv env;
  std::unique_ptr<parallel::Mesh> mesh;
  std::string run_dir;             // run.dir, or run.dir/slurm-<job id> under SLURM (job_run_dir)
  std::string hostname;            // host_name()
  std::vector<std::string> hosts;  // host name of every world rank
  std::unique_ptr<RunLock> lock;   // training jobs only (join_world's `lock_run_dir`)

  // Set once per job, before any stage is built; immutable after. Reading it before, or setting
  // it twice, is a caller's bug (InternalError).
  void set_precision(const JobPrecision& precision);
  const JobPrecision& precision() const;

 private:
  std::optional<JobPrecision> precision_;
};

// Inside the world: resolves dp = -1, builds the mesh and its communicators, the run directory
// (and its lock, with `lock_run_dir`: a job that writes snapshots) and per-rank logs; warns when a
// tensor-parallel group straddles hosts. Collective; a failure on any rank is agreed on and
// reported once.
Job join_world(Recipe recipe, const std::string& log_level_override, bool needs_data = true,
               bool lock_run_dir = false);

// Runs `setup` on every rank, then agrees: if any rank threw, the lowest such rank prints its error
// (only that one copy reaches the console) and every rank throws AgreedFailure with its exit code.
struct AgreedFailure {
  int exit_code;
};
// Exit code of a training job that a replay's mismatch stopped (run.on_corruption = stop,
// runtime/train/replay.h): silent data corruption, not to be restarted as it is.
inline constexpr int kExitCorruption = 6;
void agree_on(const parallel::Comm& world, const std::function<void()>& setup);
// Collective: the lowest rank of `world` on which `failed` holds, or world.size() when none; the
// one agreement on a failure that agree_on, agreed_error and the snapshots' commits share.
int first_failing_rank(const parallel::Comm& world, bool failed);
// Collective: "" when `error` is empty on every rank, else the lowest failing rank's error as
// "rank N: <error>", alike on every rank.
std::string agreed_error(const parallel::Comm& world, const std::string& error);

// Every group's all-reduce of world ranks equals the sum over the expected members: the
// communicators were built right. Returns the number of groups checked; throws on a mismatch.
int verify_mesh_groups(const parallel::Mesh& mesh);

// Rank 0 logs the mesh: one line per rank with host and coordinates (gathered from all ranks).
void report_mesh(const Job& job);

}  // namespace t3d::runtime
