// run.on_corruption = exclude's reading of a replay's account (runtime/supervise/exclude.h): the
// host to leave out comes from the last corruption line of incidents.jsonl, and is found in the
// hostfile by name or, when the ranks' host names are not the hostfile's, by the slots mpirun
// --map-by slot fills in order.
#include <gtest/gtest.h>

#include <cstdio>
#include <fstream>
#include <string>

#include "runtime/supervise/exclude.h"

using namespace t3d::runtime;

namespace {
std::string incidents_file(const std::string& text) {
  const std::string path = testing::TempDir() + "/incidents_" +
                           testing::UnitTest::GetInstance()->current_test_info()->name() + ".jsonl";
  std::ofstream(path) << text;
  return path;
}
HostEntry host(const std::string& name, int slots) { return {name, slots, name}; }
}  // namespace

TEST(Exclude, LastCorruptionIsTheLastAccountsHostRankAndSteps) {
  const std::string path = incidents_file(
      R"({"time": "t", "event": "corruption", "step": 4, "check": "gradients", "what": "rank 1: old", "verified_step": 2, "action": "exclude", "exclude_host": "hosta", "exclude_rank": 0, "exit_code": 6})"
      "\n"
      R"({"time": "t", "attempt": 1, "cause": "rank 1 died", "rank": 1, "host": "hostb", "action": "restart from snapshot step 6"})"
      "\n"
      R"({"time": "t", "event": "corruption", "step": 10, "check": "parameters at rest", "what": "rank 3: a \"quoted\" word", "verified_step": 8, "action": "exclude", "exclude_host": "hostb", "exclude_rank": 3, "exit_code": 6})"
      "\n");
  const auto a = last_corruption(path);
  ASSERT_TRUE(a.has_value());
  EXPECT_EQ(a->step, 10);
  EXPECT_EQ(a->verified_step, 8);
  EXPECT_EQ(a->host, "hostb");
  EXPECT_EQ(a->rank, 3);
  EXPECT_EQ(a->what, "rank 3: a \"quoted\" word");
  std::remove(path.c_str());
}

TEST(Exclude, NoHostWhenTheCandidatesAreOnSeveralHostsAndNoAccountWithoutALine) {
  const std::string path = incidents_file(
      R"({"time": "t", "event": "corruption", "step": 4, "verified_step": 2, "action": "stop", "exclude_host": null, "exclude_rank": -1, "exit_code": 6})"
      "\n");
  const auto a = last_corruption(path);
  ASSERT_TRUE(a.has_value());
  EXPECT_EQ(a->host, "");
  EXPECT_EQ(a->rank, -1);
  EXPECT_FALSE(last_corruption(incidents_file("{\"attempt\": 1, \"cause\": \"x\"}\n")));
  EXPECT_FALSE(last_corruption(testing::TempDir() + "/no_such_incidents.jsonl"));
}

TEST(Exclude, HostIndexByNameElseBySlotsInHostfileOrder) {
  const std::vector<HostEntry> hosts = {host("10.0.0.1", 2), host("10.0.0.2", 3), host("node3", 1)};
  EXPECT_EQ(host_index(hosts, "node3", 0), 2);  // the name wins over the rank
  EXPECT_EQ(host_index(hosts, "hostb", 0), 0);  // ranks 0-1 on the first host
  EXPECT_EQ(host_index(hosts, "hostb", 2), 1);  // ranks 2-4 on the second
  EXPECT_EQ(host_index(hosts, "hostb", 4), 1);
  EXPECT_EQ(host_index(hosts, "hostb", 5), 2);
  EXPECT_EQ(host_index(hosts, "hostb", 6), -1);                     // beyond every slot
  EXPECT_EQ(host_index(hosts, "hostb", -1), -1);                    // no rank named
  EXPECT_EQ(host_index({host("a", 0), host("b", 0)}, "c", 1), -1);  // slots unknown
}
