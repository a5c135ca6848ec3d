// The choice of a group's tensor path (runtime/stage/device_comm.h: NCCL or staged through host
// memory, every case of parallel.device_comm against the group's devices and NCCL's load) and
// NCCL's loader (parallel/nccl_library.h), on the CPU: no GPU is needed for either.
#include <gtest/gtest.h>

#include <cstdlib>
#include <string>
#include <vector>

#include "kernels/check.h"
#include "parallel/nccl_library.h"
#include "runtime/stage/device_comm.h"
#include "tests/stage/nccl_fixtures.h"

namespace t3d::runtime {
namespace {

using testing::loaded_nccl;
using testing::missing_nccl;

// Two hosts with two GPUs each, one rank per GPU.
std::vector<RankDevice> own_gpus() {
  return {{"a", "0000:1b:00.0", true},
          {"a", "0000:2c:00.0", true},
          {"b", "0000:1b:00.0", true},
          {"b", "0000:2c:00.0", true}};
}

std::string refusal(DeviceComm key, const std::vector<RankDevice>& ranks,
                    const parallel::NcclLibrary& nccl) {
  try {
    choose_device_comm(key, "dp × cp", ranks, nccl);
  } catch (const UserError& e) {
    return e.what();
  }
  return "";
}

TEST(DeviceComm, AGpuPerRankAndNcclLoadedIsNccl) {
  for (const DeviceComm key : {DeviceComm::kAuto, DeviceComm::kNccl}) {
    const DeviceCommPath p = choose_device_comm(key, "dp × cp", own_gpus(), loaded_nccl());
    EXPECT_TRUE(p.nccl);
    // The same bus id on another host is another GPU.
    EXPECT_EQ(p.detail, "NCCL 2.28.9 (4 ranks, one GPU each)");
  }
  // One rank: auto stages (nothing crosses between ranks), nccl takes NCCL.
  const DeviceCommPath one =
      choose_device_comm(DeviceComm::kAuto, "tp", {own_gpus()[0]}, loaded_nccl());
  EXPECT_FALSE(one.nccl);
  EXPECT_NE(one.detail.find("one rank"), std::string::npos) << one.detail;
  const DeviceCommPath asked =
      choose_device_comm(DeviceComm::kNccl, "tp", {own_gpus()[0]}, loaded_nccl());
  EXPECT_TRUE(asked.nccl);
  EXPECT_EQ(asked.detail, "NCCL 2.28.9 (1 rank, its own GPU)");
}

// Ranks on machines of one host name (containers) with the same bus id: other GPUs when their
// machines' boot ids differ, one GPU (NCCL refused) when they are the same.
TEST(DeviceComm, HostsOfOneNameAreToldApartByTheirMachine) {
  const std::vector<RankDevice> two_machines = {{"node", "0000:1b:00.0", true, "boot-1"},
                                                {"node", "0000:1b:00.0", true, "boot-2"}};
  EXPECT_TRUE(choose_device_comm(DeviceComm::kAuto, "dp × cp", two_machines, loaded_nccl()).nccl);
  const std::vector<RankDevice> one_machine = {{"node", "0000:1b:00.0", true, "boot-1"},
                                               {"node", "0000:1b:00.0", true, "boot-1"}};
  EXPECT_FALSE(choose_device_comm(DeviceComm::kAuto, "dp × cp", one_machine, loaded_nccl()).nccl);
  EXPECT_NE(refusal(DeviceComm::kNccl, one_machine, loaded_nccl()).find("share GPU"),
            std::string::npos);
}

TEST(DeviceComm, StagedIsAlwaysStaged) {
  for (const auto& nccl : {loaded_nccl(), missing_nccl()}) {
    const DeviceCommPath p = choose_device_comm(DeviceComm::kStaged, "tp", own_gpus(), nccl);
    EXPECT_FALSE(p.nccl);
    EXPECT_EQ(p.detail, "staged through host memory (parallel.device_comm = \"staged\")");
  }
}

TEST(DeviceComm, RanksSharingAGpuAreStagedOrRefused) {
  auto ranks = own_gpus();
  ranks[3].gpu = ranks[2].gpu;  // host b's two ranks on one GPU
  const DeviceCommPath p = choose_device_comm(DeviceComm::kAuto, "dp × cp", ranks, loaded_nccl());
  EXPECT_FALSE(p.nccl);
  EXPECT_EQ(p.detail,
            "staged through host memory (ranks 2 and 3 share GPU 0000:1b:00.0 on b, which NCCL "
            "refuses)");
  const std::string e = refusal(DeviceComm::kNccl, ranks, loaded_nccl());
  EXPECT_NE(e.find("parallel.device_comm = \"nccl\""), std::string::npos) << e;
  EXPECT_NE(e.find("dp × cp"), std::string::npos) << e;
  EXPECT_NE(e.find("ranks 2 and 3 share GPU 0000:1b:00.0 on b"), std::string::npos) << e;
}

TEST(DeviceComm, ARankOnTheCpuIsStagedOrRefused) {
  auto ranks = own_gpus();
  ranks[1].gpu.clear();
  const DeviceCommPath p = choose_device_comm(DeviceComm::kAuto, "tp", ranks, loaded_nccl());
  EXPECT_FALSE(p.nccl);
  EXPECT_NE(p.detail.find("rank 1 computes on the CPU"), std::string::npos) << p.detail;
  const std::string e = refusal(DeviceComm::kNccl, {RankDevice{}}, loaded_nccl());
  EXPECT_NE(e.find("parallel.device_comm"), std::string::npos) << e;
  EXPECT_NE(e.find("rank 0 computes on the CPU"), std::string::npos) << e;
}

TEST(DeviceComm, NcclNotLoadedIsStagedOrRefusedSayingWhereItLooked) {
  const DeviceCommPath p = choose_device_comm(DeviceComm::kAuto, "tp", own_gpus(), missing_nccl());
  EXPECT_FALSE(p.nccl);
  EXPECT_NE(p.detail.find("NCCL not loaded: looked for T3D_NCCL_LIBRARY=/nowhere/libnccl.so.2"),
            std::string::npos)
      << p.detail;
  EXPECT_NE(refusal(DeviceComm::kNccl, own_gpus(), missing_nccl()).find("/nowhere/libnccl.so.2"),
            std::string::npos);
  // Loaded here but not on another rank: every rank must agree, so the group is staged.
  auto ranks = own_gpus();
  ranks[2].nccl_loaded = false;
  const DeviceCommPath q = choose_device_comm(DeviceComm::kAuto, "tp", ranks, loaded_nccl());
  EXPECT_FALSE(q.nccl);
  EXPECT_NE(q.detail.find("NCCL not loaded on rank 2"), std::string::npos) << q.detail;
}

// Ranks that load different NCCL releases cannot share a communicator (the wire protocol changes
// between them): the group is staged, or refused, naming both versions.
TEST(DeviceComm, TwoNcclVersionsAreStagedOrRefused) {
  auto ranks = own_gpus();
  for (auto& r : ranks) r.nccl_version = 22809;
  EXPECT_TRUE(choose_device_comm(DeviceComm::kAuto, "tp", ranks, loaded_nccl()).nccl);
  ranks[3].nccl_version = 22105;
  const DeviceCommPath p = choose_device_comm(DeviceComm::kAuto, "tp", ranks, loaded_nccl());
  EXPECT_FALSE(p.nccl);
  EXPECT_NE(p.detail.find("ranks 0 and 3 load NCCL 2.28.9 and 2.21.5"), std::string::npos)
      << p.detail;
  const std::string e = refusal(DeviceComm::kNccl, ranks, loaded_nccl());
  EXPECT_NE(e.find("ranks 0 and 3 load NCCL 2.28.9 and 2.21.5"), std::string::npos) << e;
  EXPECT_NE(e.find("one version on every host"), std::string::npos) << e;
}

// NCCL's point to point has no tags: a group whose messages are taken out of send order (the pp
// group under ZB-V) is staged, or refused.
TEST(DeviceComm, MessagesOutOfSendOrderAreStagedOrRefused) {
  const DeviceCommPath p = choose_device_comm(DeviceComm::kAuto, "pp", own_gpus(), loaded_nccl(),
                                              /*in_send_order=*/false);
  EXPECT_FALSE(p.nccl);
  EXPECT_NE(p.detail.find("out of send order (parallel.schedule = \"zb_v\")"), std::string::npos)
      << p.detail;
  try {
    choose_device_comm(DeviceComm::kNccl, "pp", own_gpus(), loaded_nccl(), false);
    ADD_FAILURE() << "nccl with messages out of send order was not refused";
  } catch (const UserError& e) {
    EXPECT_NE(std::string(e.what()).find("zb_v"), std::string::npos) << e.what();
  }
}

TEST(NcclLibrary, VersionNames) {
  parallel::NcclLibrary lib;
  lib.version = 22809;
  EXPECT_EQ(lib.version_name(), "2.28.9");
  lib.version = 2708;  // before 2.9 the code was X·1000 + Y·100 + Z
  EXPECT_EQ(lib.version_name(), "2.7.8");
  EXPECT_EQ(parallel::nccl_version_name(22105), "2.21.5");
}

TEST(NcclLibrary, ABadPathIsNotLoadedAndSaysWhereItLooked) {
  const parallel::NcclLibrary lib = parallel::load_nccl_library("/nowhere/libnccl.so.2");
  EXPECT_FALSE(lib.loaded);
#ifdef T3D_HAVE_NCCL
  const std::string where = "T3D_NCCL_LIBRARY=/nowhere/libnccl.so.2";
#else  // a build without nccl.h never loads NCCL, and says so
  const std::string where = "built without NCCL's header";
#endif
  EXPECT_NE(lib.why_not.find(where), std::string::npos) << lib.why_not;
  // And the group it would have served is staged, saying so.
  const DeviceCommPath p = choose_device_comm(DeviceComm::kAuto, "pp", own_gpus(), lib);
  EXPECT_FALSE(p.nccl);
  EXPECT_NE(p.detail.find(where), std::string::npos) << p.detail;
}

// The library beside the toolkit's nccl.h (CMake's T3D_NCCL_TEST_LIBRARY) loads and reports the
// header's version.
TEST(NcclLibrary, TheToolkitsLibraryLoads) {
#if defined(T3D_HAVE_NCCL) && defined(T3D_NCCL_TEST_LIBRARY)
  const parallel::NcclLibrary lib = parallel::load_nccl_library(T3D_NCCL_TEST_LIBRARY);
  ASSERT_TRUE(lib.loaded) << lib.why_not;
  EXPECT_EQ(lib.path, T3D_NCCL_TEST_LIBRARY);
  EXPECT_EQ(lib.version, T3D_NCCL_HEADER_VERSION);
#else
  GTEST_SKIP() << "no NCCL library beside the toolkit's nccl.h at configure time";
#endif
}

}  // namespace
}  // namespace t3d::runtime
