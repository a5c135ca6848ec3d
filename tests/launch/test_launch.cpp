// Launcher detection and the mpirun command titan3d re-executes itself under.
#include <fcntl.h>
#include <gtest/gtest.h>
#include <sys/wait.h>
#include <unistd.h>

#include <algorithm>
#include <csignal>
#include <cstdio>
#include <filesystem>
#include <fstream>

#include "kernels/check.h"
#include "runtime/launch/hosts.h"
#include "runtime/launch/launch.h"
#include "runtime/launch/stop_signal.h"

using namespace t3d::runtime;

TEST(Launch, DetectsNoLauncher) {
  const LaunchEnv e = detect_launch_env({{"HOME", "/root"}});
  EXPECT_EQ(e.launcher, Launcher::none);
}

TEST(Launch, DetectsOpenMpi) {
  const LaunchEnv e = detect_launch_env({{"OMPI_COMM_WORLD_SIZE", "8"},
                                         {"OMPI_COMM_WORLD_RANK", "5"},
                                         {"OMPI_COMM_WORLD_LOCAL_RANK", "1"},
                                         {"OMPI_COMM_WORLD_LOCAL_SIZE", "4"}});
  EXPECT_EQ(e.launcher, Launcher::openmpi);
  EXPECT_EQ(e.rank, 5);
  EXPECT_EQ(e.size, 8);
  EXPECT_EQ(e.local_rank, 1);
  EXPECT_EQ(e.local_size, 4);
}

TEST(Launch, DetectsSrunTasksButNotTheBatchScript) {
  const LaunchEnv batch = detect_launch_env({{"SLURM_JOB_ID", "77"}, {"SLURM_PROCID", "0"}});
  EXPECT_EQ(batch.launcher, Launcher::none);
  const LaunchEnv task = detect_launch_env({{"SLURM_JOB_ID", "77"},
                                            {"SLURM_STEP_ID", "0"},
                                            {"SLURM_PROCID", "3"},
                                            {"SLURM_NTASKS", "4"},
                                            {"SLURM_LOCALID", "1"},
                                            {"SLURM_NTASKS_PER_NODE", "2"}});
  EXPECT_EQ(task.launcher, Launcher::slurm);
  EXPECT_EQ(task.rank, 3);
  EXPECT_EQ(task.size, 4);
  EXPECT_EQ(task.local_rank, 1);
  EXPECT_EQ(task.job_id, "77");
}

TEST(Launch, DetectsPmix) {
  const LaunchEnv e = detect_launch_env({{"PMIX_RANK", "2"}});
  EXPECT_EQ(e.launcher, Launcher::pmix);
  EXPECT_EQ(e.rank, 2);
}

TEST(Launch, MpirunCommandOversubscribesOnlyWhenNeeded) {
  SpawnPlan plan;
  plan.ranks = 8;
  plan.cores = 2;
  plan.as_root = true;
  plan.env = {{"OPENBLAS_CORETYPE", "SkylakeX"}};
  plan.argv = {"titan3d", "train", "r.toml", "--set", "parallel.tp=2"};
  const auto cmd = mpirun_command(plan, "/opt/titan3d");
  const auto has = [&](const std::string& a) {
    return std::find(cmd.begin(), cmd.end(), a) != cmd.end();
  };
  EXPECT_EQ(cmd[0], "mpirun");
  EXPECT_EQ(cmd[1], "-np");
  EXPECT_EQ(cmd[2], "8");
  EXPECT_TRUE(has("--oversubscribe"));
  EXPECT_TRUE(has("--allow-run-as-root"));
  EXPECT_TRUE(has("OPENBLAS_CORETYPE=SkylakeX"));
  // Our own arguments follow the executable unchanged.
  const auto exe = std::find(cmd.begin(), cmd.end(), "/opt/titan3d");
  ASSERT_NE(exe, cmd.end());
  EXPECT_EQ(std::vector<std::string>(exe + 1, cmd.end()),
            (std::vector<std::string>{"train", "r.toml", "--set", "parallel.tp=2"}));

  plan.ranks = 2;
  plan.as_root = false;
  const auto small = mpirun_command(plan, "/opt/titan3d");
  EXPECT_EQ(std::count(small.begin(), small.end(), "--oversubscribe"), 0);
  EXPECT_EQ(std::count(small.begin(), small.end(), "--allow-run-as-root"), 0);
}

TEST(Launch, MpirunCommandGivesEachRankItsThreadsCores) {
  SpawnPlan plan;
  plan.argv = {"titan3d", "train", "r.toml"};
  const auto binding = [&](int ranks, int threads, int cores) {
    plan.ranks = ranks, plan.threads = threads, plan.cores = cores;
    const auto cmd = mpirun_command(plan, "/opt/titan3d");
    std::string out;
    for (auto it = cmd.begin(); it != cmd.end() && *it != "/opt/titan3d"; ++it)
      if (*it == "--map-by" || *it == "--bind-to") out += *it + " " + *(it + 1) + " ";
    return out;
  };
  EXPECT_EQ(binding(1, 2, 2), "--map-by slot:PE=2 --bind-to core ");  // one rank, both cores
  EXPECT_EQ(binding(2, 1, 2), "--map-by slot:PE=1 --bind-to core ");
  EXPECT_EQ(binding(4, 4, 16), "--map-by slot:PE=4 --bind-to core ");
  EXPECT_EQ(binding(8, 1, 2), "--bind-to none ");  // oversubscribed: no rank pinned to one core
  EXPECT_EQ(binding(2, 2, 2), "--bind-to none ");  // more threads than cores
}

TEST(Launch, OpenMpThreadsSpinOnlyOnCoresTheirRankOwns) {
  using Env = std::pair<std::string, std::string>;
  const Env spin{"GOMP_SPINCOUNT", "300000"}, passive{"OMP_WAIT_POLICY", "PASSIVE"};
  EXPECT_EQ(openmp_wait_env(1, 2, 2, false), spin);  // one rank owns both cores
  EXPECT_EQ(openmp_wait_env(4, 4, 16, false), spin);
  EXPECT_EQ(openmp_wait_env(2, 2, 2, false), passive);  // two ranks would share each core
  EXPECT_EQ(openmp_wait_env(8, 1, 2, false), passive);  // oversubscribed
  EXPECT_EQ(openmp_wait_env(1, 2, 64, true), passive);  // a hostfile: other hosts' cores unknown
}

TEST(Launch, FormatsCpuSets) {
  EXPECT_EQ(format_cpu_set({0, 1, 2, 5}), "0-2,5");
  EXPECT_EQ(format_cpu_set({3}), "3");
  EXPECT_EQ(format_cpu_set({}), "?");
  EXPECT_FALSE(cpu_set().empty());
}

TEST(Launch, ThreadsPerRankShareTheCores) {
  EXPECT_EQ(threads_per_rank(0, 2, 1), 2);
  EXPECT_EQ(threads_per_rank(0, 2, 8), 1);
  EXPECT_EQ(threads_per_rank(0, 16, 4), 4);
  EXPECT_EQ(threads_per_rank(3, 2, 8), 3);
}

TEST(Launch, SlurmLocalSizeFromTheStepLayout) {
  // Uneven layout: node 1 of "3,2" runs 2 tasks. SLURM_NTASKS_PER_NODE is absent unless asked for.
  const LaunchEnv e = detect_launch_env({{"SLURM_JOB_ID", "9"},
                                         {"SLURM_STEP_ID", "0"},
                                         {"SLURM_PROCID", "4"},
                                         {"SLURM_NTASKS", "5"},
                                         {"SLURM_LOCALID", "1"},
                                         {"SLURM_NODEID", "1"},
                                         {"SLURM_TASKS_PER_NODE", "4(x2)"},
                                         {"SLURM_STEP_TASKS_PER_NODE", "3,2"}});
  EXPECT_EQ(e.local_size, 2);
  EXPECT_EQ(e.tasks_per_node, (std::vector<int>{3, 2}));
}

TEST(Launch, ParsesSlurmTaskCounts) {
  EXPECT_EQ(parse_slurm_tasks_per_node("4"), (std::vector<int>{4}));
  EXPECT_EQ(parse_slurm_tasks_per_node("2(x3),1"), (std::vector<int>{2, 2, 2, 1}));
  EXPECT_EQ(parse_slurm_tasks_per_node("8(x2)"), (std::vector<int>{8, 8}));
  EXPECT_TRUE(parse_slurm_tasks_per_node("4x").empty());
  EXPECT_TRUE(parse_slurm_tasks_per_node("(x2)").empty());
}

TEST(Launch, RunDirectoryNamesTheSlurmJob) {
  EXPECT_EQ(job_run_dir("runs/tiny", detect_launch_env({{"HOME", "/"}})), "runs/tiny");
  // Also in the sbatch script itself (no rank yet), so a self-launched job logs to the same place.
  EXPECT_EQ(job_run_dir("runs/tiny", detect_launch_env({{"SLURM_JOB_ID", "1234"}})),
            "runs/tiny/slurm-1234");
}

TEST(Launch, TpGroupsInsideHostsAreFine) {
  const t3d::parallel::MeshShape shape(2, 2, 1, 2, 1);  // tp groups {0,1} {2,3} {4,5} {6,7}
  const std::vector<std::string> hosts = {"a", "a", "a", "a", "b", "b", "b", "b"};
  EXPECT_TRUE(tp_groups_straddling_hosts(shape, hosts).empty());
  EXPECT_EQ(tp_placement_warning(shape, hosts, LaunchEnv{}), "");
}

TEST(Launch, TpGroupStraddlingHostsIsNamed) {
  // 3 tasks per node put tp group {2,3} across hosts a and b.
  const t3d::parallel::MeshShape shape(1, 3, 1, 2, 1);
  const std::vector<std::string> hosts = {"a", "a", "a", "b", "b", "b"};
  const auto groups = tp_groups_straddling_hosts(shape, hosts);
  ASSERT_EQ(groups.size(), 1u);
  EXPECT_EQ(groups[0], "tp group of world ranks 2,3 spans hosts a (2), b (3)");
  LaunchEnv slurm;
  slurm.launcher = Launcher::slurm;
  slurm.tasks_per_node = {3, 3};
  const std::string w = tp_placement_warning(shape, hosts, slurm);
  EXPECT_NE(w.find("1 of 3 tensor-parallel groups straddle hosts"), std::string::npos) << w;
  EXPECT_NE(w.find("SLURM placed 3,3 tasks per node"), std::string::npos) << w;
  EXPECT_NE(w.find("--ntasks-per-node=<multiple of 2>"), std::string::npos) << w;
}

TEST(Launch, MpirunCommandWithAHostfileFillsItsSlotsUnbound) {
  SpawnPlan plan;
  plan.argv = {"titan3d", "train", "r.toml"};
  plan.ranks = 8, plan.threads = 1, plan.cores = 2;
  plan.hostfile = "/tmp/hosts", plan.slots = 8;
  auto cmd = mpirun_command(plan, "/opt/titan3d");
  const std::string text = [&] {
    std::string s;
    for (const auto& a : cmd) s += a + " ";
    return s;
  }();
  EXPECT_NE(text.find("--hostfile /tmp/hosts --map-by slot --bind-to none "), std::string::npos)
      << text;
  EXPECT_EQ(text.find("--oversubscribe"), std::string::npos) << "8 ranks fit 8 slots: " << text;
  EXPECT_EQ(text.find("PE="), std::string::npos) << "no binding from this host's cores: " << text;
  plan.slots = 4;
  cmd = mpirun_command(plan, "/opt/titan3d");
  EXPECT_EQ(std::count(cmd.begin(), cmd.end(), "--oversubscribe"), 1);
}

TEST(Launch, ReadsAHostfileAndNamesItsBadLines) {
  const std::string path = ::testing::TempDir() + "/t3d_hostfile";
  std::ofstream(path) << "# the cluster\n10.0.0.1 slots=4\n\n  nodeb slots=2 max_slots=8 # b\n";
  const auto hosts = read_hostfile(path, "run.hostfile");
  ASSERT_EQ(hosts.size(), 2u);
  EXPECT_EQ(hosts[0].host, "10.0.0.1");
  EXPECT_EQ(hosts[0].slots, 4);
  EXPECT_EQ(hosts[1].host, "nodeb");
  EXPECT_EQ(hosts[1].slots, 2);
  EXPECT_EQ(total_slots(hosts), 6);
  write_hostfile(path + ".kept", {hosts[1]});
  const auto kept = read_hostfile(path + ".kept", "run.hostfile");
  ASSERT_EQ(kept.size(), 1u);
  EXPECT_EQ(kept[0].host, "nodeb");
  EXPECT_EQ(total_slots({hosts[0], HostEntry{"c", 0, "c"}}), 0) << "a host without slots";

  std::ofstream(path) << "a slots=4\nb slots=four\n";
  try {
    read_hostfile(path, "run.hostfile");
    FAIL() << "slots=four accepted";
  } catch (const t3d::UserError& e) {
    EXPECT_NE(std::string(e.what()).find(path + ":2: `slots=four`"), std::string::npos) << e.what();
  }
  std::ofstream(path) << "# nobody\n";
  EXPECT_THROW(read_hostfile(path, "run.hostfile"), t3d::UserError);
  EXPECT_THROW(read_hostfile(path + ".missing", "run.hostfile"), t3d::UserError);
}

TEST(Launch, NamesTheHostAWatchdogWaitedOn) {
  EXPECT_EQ(watchdog_waited_host(
                "watchdog: world rank 3 waited more than 5 s (parallel.timeout_s) in recv on group "
                "`pp` (peer world rank 7); on host hosta, waiting on host hostb (world rank 7); a "
                "peer is stuck"),
            "hostb");
  EXPECT_EQ(watchdog_waited_host("watchdog: world rank 1 ...; on host a, waiting on no other host"),
            "");
  EXPECT_EQ(watchdog_waited_host("rank 0: waiting on host b"), "") << "not a watchdog line";
}

// The restart loop's StopRequest: once it says stop, the watched command gets SIGUSR1 (as a
// preemption), once, and the outcome says the stop was asked. The command here stands in for
// mpirun and its ranks: it exits 75 (kExitPreempted) on SIGUSR1, and 1 if never asked.
TEST(Launch, StopRequestSendsOneSigusr1AndIsRecorded) {
  const std::string dir = ::testing::TempDir();
  const std::vector<std::string> job = {
      "sh", "-c",
      "trap 'exit 75' USR1; i=0; while [ $i -lt 200 ]; do sleep 0.05; i=$((i+1)); done; exit 1"};
  int polls = 0;
  const MpirunOutcome stopped = run_mpirun_watched(job, dir, 0, "", [&] { return ++polls == 2; });
  EXPECT_TRUE(stopped.stop_asked);
  EXPECT_EQ(stopped.code, 75);
  EXPECT_EQ(stopped.signal, 0);  // not a signal the launcher was sent
  EXPECT_GE(polls, 2);
  const MpirunOutcome left = run_mpirun_watched(
      {"sh", "-c", "trap 'exit 75' USR1; sleep 1.5; exit 4"}, dir, 0, "", [] { return false; });
  EXPECT_FALSE(left.stop_asked);
  EXPECT_EQ(left.code, 4);
}

// A preemption signal to the launcher after the stop was asked: the ranks already got SIGUSR1,
// and a second would end them before their snapshot; the signal is recorded (so the restart loop
// stops rather than regrows) and not passed on again. The command exits 74 + the USR1s it got.
TEST(Launch, SignalAfterAStopRequestIsNotPassedOnTwice) {
  const std::vector<std::string> job = {
      "sh", "-c",
      "n=0; trap 'n=$((n+1))' USR1; i=0; while [ $i -lt 200 ]; do sleep 0.05; i=$((i+1)); "
      "if [ $n -gt 0 ]; then sleep 1.5; exit $((74+n)); fi; done; exit 1"};
  const MpirunOutcome out = run_mpirun_watched(job, ::testing::TempDir(), 0, "", [] {
    raise(SIGTERM);  // arrives as the stop is asked: handled on the watch's next turn
    return true;
  });
  EXPECT_TRUE(out.stop_asked);
  EXPECT_EQ(out.signal, SIGTERM);
  EXPECT_EQ(out.code, 75);  // one SIGUSR1
}

// Ctrl-C to the launcher reaches the ranks as kInterruptSignal (mpirun forwards it as it is, where
// it would turn SIGINT into SIGTERM, a preemption): the command, standing in for mpirun and a
// training rank, exits with kExitInterrupted on it, and the job's code is that.
TEST(Launch, InterruptIsPassedOnAsTheInterruptSignal) {
  const std::vector<std::string> job = {
      "sh", "-c",
      "trap 'exit 130' USR2; trap 'exit 75' TERM; i=0; while [ $i -lt 200 ]; do sleep 0.05; "
      "i=$((i+1)); done; exit 1"};
  bool raised = false;
  const MpirunOutcome out = run_mpirun_watched(job, ::testing::TempDir(), 0, "", [&] {
    if (!raised) raise(SIGINT);  // handled on the watch's next turn
    raised = true;
    return false;
  });
  EXPECT_EQ(out.signal, SIGINT);
  EXPECT_EQ(out.code, kExitInterrupted);
}

// How the ranks stopped is read from <pid dir>/stopped, not from mpirun's code (mpirun that was
// signalled itself exits 1 after its ranks stopped); a record an earlier attempt left is removed
// before mpirun starts.
TEST(Launch, RecordedStopIsTheJobsCode) {
  const std::string pids = ::testing::TempDir() + "/recorded_stop_pids";
  std::filesystem::create_directories(pids);
  const MpirunOutcome stopped = run_mpirun_watched(
      {"sh", "-c", "echo 75 > " + pids + "/stopped; exit 1"}, ::testing::TempDir(), 0, pids);
  EXPECT_EQ(stopped.code, kExitPreempted);
  record_stop(pids, kExitPreempted);  // as if an earlier attempt had stopped
  const MpirunOutcome failed =
      run_mpirun_watched({"sh", "-c", "exit 1"}, ::testing::TempDir(), 0, pids);
  EXPECT_EQ(failed.code, 1);
}

// The ranks' stdout goes through the launcher, which checks each write: a job that succeeded
// but whose output could not be written (here /dev/full) ends with exit 2.
TEST(Launch, OutputThatCannotBeWrittenIsExit2) {
  std::fflush(stdout);
  const int saved = dup(STDOUT_FILENO);
  const int full = open("/dev/full", O_WRONLY);
  ASSERT_GE(full, 0);
  dup2(full, STDOUT_FILENO);
  const MpirunOutcome lost =
      run_mpirun_watched({"sh", "-c", "echo result; exit 0"}, ::testing::TempDir());
  const MpirunOutcome failed =
      run_mpirun_watched({"sh", "-c", "echo result; exit 4"}, ::testing::TempDir());
  dup2(saved, STDOUT_FILENO);
  close(saved), close(full);
  EXPECT_EQ(lost.code, 2);
  EXPECT_EQ(failed.code, 4);  // the job's own failure stays what it was
  EXPECT_EQ(run_mpirun_watched({"sh", "-c", "echo result; exit 0"}, ::testing::TempDir()).code, 0);
}

// A stop signal within kStopEchoSeconds of the first is that stop come by another route (a
// scheduler signals a rank directly, mpirun and the launcher pass it on): not the second signal
// that exits at once. An interrupt among them makes the stop an interrupt. A signal after that
// window exits at once with 128 + signal. In a child: the handlers stay out of this process.
TEST(StopSignals, EchoesOfTheFirstSignalAreNotASecondOne) {
  const pid_t child = fork();
  ASSERT_GE(child, 0);
  if (child == 0) {
    install_stop_signals();
    raise(SIGTERM);
    raise(SIGUSR1);
    if (stop_requested() != SIGTERM || stop_is_interrupt()) _exit(10);
    raise(SIGINT);
    if (!stop_is_interrupt()) _exit(11);
    sleep(kStopEchoSeconds + 1);
    raise(SIGTERM);  // a second signal: now
    _exit(12);
  }
  int status = 0;
  waitpid(child, &status, 0);
  ASSERT_TRUE(WIFEXITED(status));
  EXPECT_EQ(WEXITSTATUS(status), 128 + SIGTERM);  // not 128 + SIGUSR1: the echo did not end it
}
