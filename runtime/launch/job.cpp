#include "runtime/launch/job.h"

#include <malloc.h>
#include <spdlog/spdlog.h>
#include <unistd.h>

#include <chrono>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <ctime>
#include <filesystem>
#include <fstream>
#include <limits>
#include <sstream>
#include <thread>

#include "kernels/blas.h"
#include "kernels/check.h"
#include "runtime/data/data.h"
#include "runtime/launch/hosts.h"
#include "runtime/launch/logging.h"

namespace t3d::runtime {

namespace fs = std::filesystem;

MpiRuntime::MpiRuntime() {
  // Open MPI's non-blocking collectives malloc a message-sized temporary on every call (a
  // whole gradient bucket; a MoE layer's is tens of MiB). Above glibc's mmap threshold (at
  // most 32 MiB) each one is mapped and unmapped, and the ranks page-fault through it on
  // every call: measured, a MoE dp=2 step 2.1x slower. Heap memory that stays mapped is
  // reused instead. The device arena and the memory tier map their own memory and are not
  // affected.
  mallopt(M_MMAP_MAX, 0);
  mallopt(M_TRIM_THRESHOLD, std::numeric_limits<int>::max());
  int provided = 0;
  // SERIALIZED: the snapshot writer thread never calls MPI, but the watchdog may abort from it.
  MPI_Init_thread(nullptr, nullptr, MPI_THREAD_SERIALIZED, &provided);
}

MpiRuntime::~MpiRuntime() {
  int finalized = 0;
  MPI_Finalized(&finalized);
  if (!finalized) MPI_Finalize();
}

void check_inputs(const Recipe& r) {
  for (const auto& [key, path] : {std::pair<std::string, std::string>{"data.path", r.data.path},
                                  {"data.val_path", r.data.val_path}}) {
    if (path.empty()) continue;
    // A pattern of token-file shards (data_files) must match; anything else be a file.
    for (const std::string& file :
         data_files(path, "recipe error: " + r.origin(key) + ": `" + key + "`"))
      T3D_USER_CHECK(fs::is_regular_file(file), "recipe error: ", r.origin(key), ": `", key,
                     "`: file `", file, "` does not exist (relative paths start at ",
                     fs::current_path().string(),
                     "). For the default corpus run `bash scripts/get_data.sh`.");
  }
  // A SentencePiece model file (data.tokenizer = "bytes" names none); its vocabulary is checked
  // against model.vocab_size when the ranks load the data.
  if (r.data.tokenizer != "bytes")
    T3D_USER_CHECK(fs::is_regular_file(r.data.tokenizer),
                   "recipe error: ", r.origin("data.tokenizer"), ": `data.tokenizer`: model file `",
                   r.data.tokenizer, "` does not exist (relative paths start at ",
                   fs::current_path().string(), "). `titan3d tokenize --vocab N` trains one.");
  // The hosts of a multi-host job: read as the launch will (file, line and slots named).
  if (!r.run.hostfile.empty()) read_hostfile(r.run.hostfile, "run.hostfile");
}

void spawn_if_needed(const Recipe& recipe, const std::vector<std::string>& argv, int np_override) {
  if (detect_launch_env().launcher != Launcher::none) return;
  exec_mpirun(make_spawn_plan(recipe, argv, np_override));
}

SpawnPlan make_spawn_plan(const Recipe& recipe, const std::vector<std::string>& argv,
                          int np_override) {
  SpawnPlan plan;
  plan.ranks = static_cast<int>(recipe.world_size());
  if (np_override > 0) {
    Recipe resolved = recipe;
    resolved.resolve_world(np_override);  // names the keys if --np does not fit the recipe
    plan.ranks = np_override;
  }
  plan.cores = static_cast<int>(std::max(1u, std::thread::hardware_concurrency()));
  plan.as_root = geteuid() == 0;
  plan.argv = argv;
  plan.log_dir = job_run_dir(recipe.run.dir, detect_launch_env()) + "/logs";
  plan.stall_s = recipe.parallel.timeout_s;
  plan.stop_grace_s = recipe.run.stop_grace_s;
  plan.pid_dir = job_pid_dir(job_run_dir(recipe.run.dir, detect_launch_env()));
  if (!recipe.run.hostfile.empty()) {
    plan.hostfile = recipe.run.hostfile;
    plan.slots = total_slots(read_hostfile(plan.hostfile, "run.hostfile"));
  }
  const int threads =
      threads_per_rank(static_cast<int>(recipe.hardware.threads_per_rank), plan.cores, plan.ranks);
  plan.threads = threads;
  plan.env.emplace_back("OPENBLAS_NUM_THREADS", std::to_string(threads));
  // OpenBLAS reads its core type only when it loads: choose it now, for the ranks. The user's
  // environment wins, then the recipe; otherwise the best kernels this CPU supports.
  std::string coretype = recipe.hardware.openblas_coretype;
  if (const char* user = std::getenv("OPENBLAS_CORETYPE")) coretype = user;
  if (coretype == "auto") coretype = kernels::recommended_openblas_coretype();
  if (!coretype.empty()) plan.env.emplace_back("OPENBLAS_CORETYPE", coretype);
  plan.env.emplace_back("OMP_NUM_THREADS", std::to_string(threads));
  // A rank's kernels, GEMMs included, run on one OpenMP pool (kernels/gemm.h): how it waits.
  plan.env.push_back(openmp_wait_env(plan.ranks, threads, plan.cores, !plan.hostfile.empty()));
  return plan;
}

void agree_on(const parallel::Comm& world, const std::function<void()>& setup) {
  std::string error;
  int code = 0;
  try {
    setup();
  } catch (const UserError& e) {
    error = e.what(), code = 2;
  } catch (const std::exception& e) {
    error = std::string("internal error: ") + e.what(), code = 1;
  }
  // Lowest failing rank, or size() if none: that rank alone prints.
  const int first = first_failing_rank(world, code != 0);
  if (first == world.size()) return;
  int agreed = code;
  world.broadcast(&agreed, 1, first);
  if (world.rank() == first) {
    std::fprintf(stderr, "titan3d: %s%s\n",
                 first ? ("rank " + std::to_string(first) + ": ").c_str() : "", error.c_str());
    std::fflush(stderr);
  }
  world.barrier();  // the message is out before any rank can exit and have mpirun end the job
  throw AgreedFailure{agreed};
}

int first_failing_rank(const parallel::Comm& world, bool failed) {
  int first = failed ? world.rank() : world.size();
  world.all_reduce(&first, 1, parallel::ReduceOp::min);
  return first;
}

std::string agreed_error(const parallel::Comm& world, const std::string& error) {
  const int first = first_failing_rank(world, !error.empty());
  if (first == world.size()) return "";
  std::string message = error;
  world.broadcast(message, first);
  return "rank " + std::to_string(first) + ": " + message;
}

void Job::set_precision(const JobPrecision& precision) {
  T3D_ASSERT(!precision_, "the job's precision is decided once");
  precision_ = precision;
}

const JobPrecision& Job::precision() const {
  T3D_ASSERT(precision_.has_value(), "the job's precision is read before it was decided");
  return *precision_;
}

std::string host_name() {
  char host[256] = {};
  gethostname(host, sizeof(host) - 1);
  return host;
}

Job join_world(Recipe recipe, const std::string& log_level_override, bool needs_data,
               bool lock_run_dir) {
  Job job;
  job.env = detect_launch_env();
  job.hostname = host_name();
  auto world = parallel::Comm::world(recipe.parallel.timeout_s);
  // Every rank's host, before the mesh splits the world: the groups inherit it, so the watchdog
  // can name hosts, and rank 0 can check where the tp groups landed.
  constexpr size_t kHost = 256;
  std::vector<char> hosts(kHost * world.size());
  char host[kHost] = {};
  job.hostname.copy(host, kHost - 1);
  world.all_gather(host, hosts.data(), kHost);
  for (int r = 0; r < world.size(); ++r) job.hosts.emplace_back(hosts.data() + r * kHost);
  world.set_world_hosts(job.hosts);
  agree_on(world, [&] {
    recipe.resolve_world(world.size());
    if (needs_data) check_inputs(recipe);
  });
  job.recipe = std::move(recipe);
  const auto& p = job.recipe.parallel;
  parallel::MeshShape shape(static_cast<int>(p.pp), static_cast<int>(p.dp), static_cast<int>(p.cp),
                            static_cast<int>(p.tp), static_cast<int>(p.ep));
  job.run_dir = job_run_dir(job.recipe.run.dir, job.env);
  const int rank = world.rank();
  agree_on(world, [&] {
    std::error_code ec;
    fs::create_directories(job.run_dir + "/logs", ec);
    T3D_USER_CHECK(fs::is_directory(job.run_dir + "/logs"), "cannot create run directory `",
                   job.run_dir, "` (run.dir): ", ec.message());
  });
  // This rank's pid, for the self-launched job's parent: it names (and ends) a rank that stopped
  // (mpirun_watch.h). Best effort: a job joined from outside has no such parent.
  std::error_code pid_ec;
  fs::create_directories(job_pid_dir(job.run_dir), pid_ec);
  std::ofstream(job_pid_dir(job.run_dir) + "/rank" + std::to_string(rank) + ".pid")
      << getpid() << " " << job.hostname << "\n";
  if (lock_run_dir) job.lock = std::make_unique<RunLock>(world, job.run_dir, job.hostname, job.env);
  const std::string level =
      log_level_override.empty() ? job.recipe.run.log_level : log_level_override;
  setup_logging(shape.label(rank), job.run_dir + "/logs/rank" + std::to_string(rank) + ".log",
                rank == 0, level);
  if (rank == 0) {
    const std::string warning = tp_placement_warning(shape, job.hosts, job.env);
    if (!warning.empty()) spdlog::warn("{}", warning);
  }
  job.mesh = std::make_unique<parallel::Mesh>(shape, std::move(world));
  return job;
}

namespace {

// Start time of process `pid` in clock ticks since boot (/proc/<pid>/stat, field 22), "" if it
// does not exist or has exited (a zombie): with the pid, it names a live process even after its
// pid is reused.
std::string process_start(long pid) {
  std::FILE* f = std::fopen(fmt::format("/proc/{}/stat", pid).c_str(), "r");
  if (!f) return "";
  char buf[4096] = {};
  const size_t n = std::fread(buf, 1, sizeof(buf) - 1, f);
  std::fclose(f);
  const char* p = std::strrchr(buf, ')');  // the command name may hold spaces and parentheses
  if (!p || n == 0) return "";
  std::string rest(p + 1);
  std::istringstream in(rest);
  std::string state, field;
  in >> state;  // field 3
  if (state == "Z" || state == "X") return "";
  for (int i = 4; i <= 22 && (in >> field); ++i) {
  }
  return field;
}

std::string lock_field(const std::string& text, const std::string& key) {
  std::istringstream in(text);
  for (std::string line; std::getline(in, line);)
    if (line.rfind(key + "=", 0) == 0) return line.substr(key.size() + 1);
  return "";
}

std::string read_text(const std::string& path) {
  std::ifstream in(path);
  std::stringstream text;
  text << in.rdbuf();
  return text.str();
}

}  // namespace

RunLock::RunLock(const parallel::Comm& world, const std::string& run_dir,
                 const std::string& hostname, const LaunchEnv& env) {
  agree_on(world, [&] {
    if (world.rank() != 0) return;
    const std::string path = run_dir + "/lock";
    const long pid = static_cast<long>(::getpid());
    const char* launch = std::getenv("PMIX_NAMESPACE");
    const std::time_t now = std::time(nullptr);
    char started[64] = {};
    std::strftime(started, sizeof(started), "%Y-%m-%dT%H:%M:%S%z", std::localtime(&now));
    const std::string content = fmt::format(
        "host={}\npid={}\npid_start={}\nlaunch={}\nstarted={}\n", hostname, pid, process_start(pid),
        !env.job_id.empty() ? "slurm-" + env.job_id
        : launch            ? launch
                            : "none",
        started);
    // Written aside and linked into place: the lock appears whole, and link() fails if it exists.
    const std::string tmp = fmt::format("{}.{}.tmp", path, pid);
    {
      std::ofstream out(tmp);
      out << content;
      out.close();
      T3D_USER_CHECK(out.good(), "cannot write the run directory's lock `", tmp, "` (run.dir)");
    }
    for (int attempt = 0; attempt < 2; ++attempt) {
      if (::link(tmp.c_str(), path.c_str()) == 0) {
        std::remove(tmp.c_str());
        path_ = path, content_ = content;
        return;
      }
      const int err = errno;
      if (err != EEXIST) std::remove(tmp.c_str());
      T3D_USER_CHECK(err == EEXIST, "cannot create the run directory's lock `", path,
                     "` (run.dir): ", std::strerror(err));
      const std::string holder = read_text(path);
      const std::string host = lock_field(holder, "host");
      const long hpid = std::atol(lock_field(holder, "pid").c_str());
      const std::string who =
          fmt::format("host {}, pid {}, launch {}, started {}", host.empty() ? "?" : host, hpid,
                      lock_field(holder, "launch"), lock_field(holder, "started"));
      // A holder on this host that is just ending (its launcher already returned) gets a few
      // seconds to go.
      const auto holder_gone = [&] {
        return host == hostname && hpid > 0 &&
               process_start(hpid) != lock_field(holder, "pid_start");
      };
      bool gone = holder_gone();
      for (int i = 0; i < 30 && !gone && host == hostname; ++i) {
        std::this_thread::sleep_for(std::chrono::milliseconds(100));
        gone = holder_gone();
      }
      if (!gone) {
        std::remove(tmp.c_str());
        throw UserError(fmt::format(
            "run directory `{}` (run.dir) is in use by another titan3d job ({}): two jobs writing "
            "into one run directory would mix their snapshots and metrics. Wait for that job to "
            "end, or give this one another run.dir; if that job is known to be dead{}, delete "
            "`{}`.",
            run_dir, who, host == hostname ? "" : " (it ran on another host)", path));
      }
      spdlog::warn("run directory {}: taking over the lock of a job that is gone ({})", run_dir,
                   who);
      std::remove(path.c_str());
    }
    std::remove(tmp.c_str());
    throw UserError(
        fmt::format("cannot take the run directory's lock `{}`: another job keeps "
                    "taking it; give this job another run.dir",
                    path));
  });
}

bool release_lock_of_ended_job(const std::string& run_dir) {
  const std::string path = run_dir + "/lock";
  const std::string holder = read_text(path);
  if (holder.empty()) return false;
  const long pid = std::atol(lock_field(holder, "pid").c_str());
  if (lock_field(holder, "host") != host_name() || pid <= 0 ||
      process_start(pid) == lock_field(holder, "pid_start"))
    return false;
  return std::remove(path.c_str()) == 0;
}

RunLock::~RunLock() {
  // Only our own lock: a job that wrongly took it over keeps its own.
  if (!path_.empty() && read_text(path_) == content_) std::remove(path_.c_str());
}

int verify_mesh_groups(const parallel::Mesh& mesh) {
  int checked = 0;
  for (parallel::Dim d : parallel::kDims) {
    int64_t sum = mesh.rank();
    mesh.group(d).all_reduce(&sum, 1);
    int64_t expected = 0;
    for (int member : mesh.shape().group(d, mesh.rank())) expected += member;
    T3D_ASSERT(sum == expected, "group ", parallel::dim_name(d), " of rank ", mesh.rank(),
               ": all-reduce of world ranks gave ", sum, ", expected ", expected);
    ++checked;
  }
  return checked;
}

void report_mesh(const Job& job) {
  const auto& mesh = *job.mesh;
  constexpr size_t kLine = 256;
  char mine[kLine] = {};
  std::snprintf(mine, kLine, "rank %3d %-16s host %s", mesh.rank(), mesh.label().c_str(),
                job.hostname.c_str());
  spdlog::debug("{}", mine);
  std::vector<char> all(kLine * mesh.world().size());
  mesh.world().all_gather(mine, all.data(), kLine);
  const auto& s = mesh.shape();
  spdlog::info("mesh pp={} dp={} cp={} tp={} = {} ranks, launcher: {}{}", s.size(parallel::Dim::pp),
               s.size(parallel::Dim::dp), s.size(parallel::Dim::cp), s.size(parallel::Dim::tp),
               s.world(), launcher_name(job.env.launcher),
               job.env.job_id.empty() ? "" : ", SLURM job " + job.env.job_id);
  for (int r = 0; r < mesh.world().size(); ++r) spdlog::info("  {}", all.data() + r * kLine);
}

}  // namespace t3d::runtime
