// Launcher detection and the mpirun command titan3d re-executes itself under.
#include <gtest/gtest.h>

#include <algorithm>

#include "runtime/launch.h"

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

TEST(Launch, ThreadsPerRankShareTheCores) {
  EXPECT_EQ(threads_per_rank(0, 2, 1), 2);
  EXPECT_EQ(threads_per_rank(0, 2, 8), 1);
  EXPECT_EQ(threads_per_rank(0, 16, 4), 4);
  EXPECT_EQ(threads_per_rank(3, 2, 8), 3);
}
