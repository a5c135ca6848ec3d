// The launcher's filter of mpirun's stderr: a dead rank is named, echo banners dropped, anything
// else passes through unchanged.
#include <gtest/gtest.h>
#include <sys/wait.h>
#include <unistd.h>

#include <csignal>

#include "runtime/launch/mpirun_watch.h"

namespace t3d::runtime {
namespace {

const std::string kRule(74, '-');

std::vector<std::string> feed_all(MpirunStderrFilter& f, const std::vector<std::string>& lines) {
  std::vector<std::string> out;
  for (const auto& l : lines)
    for (auto& o : f.feed(l)) out.push_back(o);
  for (auto& o : f.finish()) out.push_back(o);
  return out;
}

TEST(MpirunWatch, NamesTheDeadRankAndDropsEchoes) {
  MpirunStderrFilter f("runs/x/logs");
  const auto out = feed_all(
      f, {"rank output", kRule, "Primary job  terminated normally, but 1 process returned",
          "a non-zero exit code. Per user-direction, the job has been aborted.", kRule, kRule,
          "mpirun noticed that process rank 3 with PID 4242 on node n7 exited on signal 9 "
          "(Killed).",
          kRule});
  ASSERT_EQ(out.size(), 2u);
  EXPECT_EQ(out[0], "rank output");
  EXPECT_EQ(out[1],
            "titan3d: rank 3 (pid 4242 on host n7) died: signal 9 (Killed); Open MPI ended the "
            "job. Its log: runs/x/logs/rank3.log");
}

TEST(MpirunWatch, WatchdogAbortBannerIsDropped) {
  MpirunStderrFilter f("logs");
  EXPECT_TRUE(feed_all(f, {kRule,
                           "MPI_ABORT was invoked on rank 0 in communicator "
                           "MPI_COMM_WORLD",
                           "with errorcode 3.", kRule})
                  .empty());
}

// After Ctrl-C the launcher said it stops every rank: mpirun's note of the signal it forwards,
// and the banner of a rank without a stop handler that the interrupt signal ended, repeat it.
TEST(MpirunWatch, InterruptEchoesAreDropped) {
  MpirunStderrFilter f("logs");
  EXPECT_TRUE(feed_all(f, {"mpirun: Forwarding signal 12 to job", kRule,
                           "mpirun noticed that process rank 0 with PID 77 on node n1 exited on "
                           "signal 12 (User defined signal 2).",
                           kRule})
                  .empty());
  EXPECT_EQ(f.dead_rank(), -1);
}

TEST(MpirunWatch, UnknownBannersPassThrough) {
  MpirunStderrFilter f("logs");
  const auto out = feed_all(f, {kRule, "There are not enough slots available", kRule});
  ASSERT_EQ(out.size(), 2u);
  EXPECT_EQ(out[1], "There are not enough slots available");
}

}  // namespace
}  // namespace t3d::runtime

// The stall watch reads a rank's state from /proc: a stopped process reads 'T'.
TEST(ProcessState, StoppedProcessReadsT) {
  const pid_t child = fork();
  ASSERT_GE(child, 0);
  if (child == 0) {
    for (;;) pause();
  }
  EXPECT_NE(t3d::runtime::process_state(child), 'T');
  kill(child, SIGSTOP);
  int status = 0;
  waitpid(child, &status, WUNTRACED);
  EXPECT_EQ(t3d::runtime::process_state(child), 'T');
  kill(child, SIGKILL);
  waitpid(child, &status, 0);
  EXPECT_EQ(t3d::runtime::process_state(child), 0);  // gone
}
