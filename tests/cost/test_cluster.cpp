// Cluster files: strict parsing with messages that name the key and suggest a fix.
#include <gtest/gtest.h>

#include "kernels/check.h"
#include "runtime/cost/cluster.h"

namespace t3d::runtime {
namespace {

const char* kValid = R"(
[cluster]
name = "test"
nodes = 2
devices_per_node = 4
[device]
hbm_gib = 16
peak_tflops = 100.0
[network]
intra_node_gbps = 300
inter_node_gbps = 50
)";

std::string error_of(const std::string& text) {
  try {
    parse_cluster(text, "c.toml");
  } catch (const UserError& e) {
    return e.what();
  }
  return "";
}

TEST(Cluster, ParsesValuesAndDefaults) {
  const Cluster c = parse_cluster(kValid, "c.toml");
  EXPECT_EQ(c.name, "test");
  EXPECT_EQ(c.world(), 8);
  EXPECT_DOUBLE_EQ(c.hbm_gib, 16);  // integer literal accepted for a number
  EXPECT_DOUBLE_EQ(c.peak_tflops, 100);
  EXPECT_DOUBLE_EQ(c.compute_efficiency, 0.5);
  EXPECT_DOUBLE_EQ(c.inter_node_latency_us, 5);
}

TEST(Cluster, UnknownKeySuggestsTheClosest) {
  std::string text = kValid;
  text.replace(text.find("hbm_gib"), 7, "hbm_gb");
  const std::string e = error_of(text);
  EXPECT_NE(e.find("c.toml:7"), std::string::npos) << e;
  EXPECT_NE(e.find("`device.hbm_gb`: unknown key"), std::string::npos) << e;
  EXPECT_NE(e.find("Did you mean `device.hbm_gib`?"), std::string::npos) << e;
}

TEST(Cluster, KeyInTheWrongSectionFindsItsHome) {
  std::string text = kValid;
  text.insert(text.find("[network]"), "intra_node_latency_us = 1.0\n");  // under [device]
  const std::string e = error_of(text);
  EXPECT_NE(e.find("Did you mean `network.intra_node_latency_us`?"), std::string::npos) << e;
}

TEST(Cluster, MissingRequiredKeyIsNamed) {
  std::string text = kValid;
  text.erase(text.find("peak_tflops"), std::string("peak_tflops = 100.0\n").size());
  const std::string e = error_of(text);
  EXPECT_NE(e.find("`device.peak_tflops`: missing"), std::string::npos) << e;
}

TEST(Cluster, WrongTypesAndRangesAreErrors) {
  std::string fractional_nodes = kValid;
  fractional_nodes.replace(fractional_nodes.find("nodes = 2"), 9, "nodes = 2.5");
  EXPECT_NE(error_of(fractional_nodes).find("expected an integer"), std::string::npos);
  EXPECT_NE(error_of(std::string(kValid) + "[netwrok]\n").find("unknown section"),
            std::string::npos);
  std::string zero_bw = kValid;
  zero_bw.replace(zero_bw.find("inter_node_gbps = 50"), 20, "inter_node_gbps = 0");
  EXPECT_NE(error_of(zero_bw).find("must be positive"), std::string::npos);
  std::string efficiency = kValid;
  efficiency.insert(efficiency.find("[network]"), "compute_efficiency = 2.0\n");
  EXPECT_NE(error_of(efficiency).find("(0, 1]"), std::string::npos) << error_of(efficiency);
  EXPECT_NE(error_of("top = 1\n").find("top-level keys"), std::string::npos);
  EXPECT_NE(error_of("[cluster\n").find("not valid TOML"), std::string::npos);
}

TEST(Cluster, ReferenceClustersLoad) {
  const Cluster npu = load_cluster(T3D_SOURCE_DIR "/recipes/clusters/npu64.toml");
  EXPECT_EQ(npu.world(), 64);
  EXPECT_DOUBLE_EQ(npu.hbm_gib, 32);
  const Cluster h100 = load_cluster(T3D_SOURCE_DIR "/recipes/clusters/h100_1024.toml");
  EXPECT_EQ(h100.world(), 1024);
  EXPECT_DOUBLE_EQ(h100.hbm_gib, 80);
  EXPECT_THROW(load_cluster("/nonexistent/cluster.toml"), UserError);
  // device.gpu: the datasheet's HBM and dense bf16 peak.
  const Cluster gpus = load_cluster(T3D_SOURCE_DIR "/recipes/clusters/h100_64.toml");
  EXPECT_EQ(gpus.world(), 64);
  EXPECT_DOUBLE_EQ(gpus.hbm_gib, 80);
  EXPECT_DOUBLE_EQ(gpus.peak_tflops, 989.4);
}

// device.gpu names a GPU of kernels/gpu_specs.h: its figures fill the device keys not given, an
// explicit key wins, an unknown GPU is refused listing the known ones.
TEST(Cluster, AGpuByNameFillsTheDeviceKeys) {
  const std::string net =
      "[network]\nintra_node_gbps = 300.0\ninter_node_gbps = 200.0\n[cluster]\nnodes = 2\n"
      "devices_per_node = 8\n";
  const Cluster a100 = parse_cluster(net + "[device]\ngpu = \"a100-sxm-40\"\n", "a100.toml");
  EXPECT_DOUBLE_EQ(a100.hbm_gib, 40);
  EXPECT_DOUBLE_EQ(a100.peak_tflops, 312);
  const Cluster h200 =
      parse_cluster(net + "[device]\ngpu = \"h200\"\npeak_tflops = 700.0\n", "h200.toml");
  EXPECT_DOUBLE_EQ(h200.hbm_gib, 141);
  EXPECT_DOUBLE_EQ(h200.peak_tflops, 700);
  try {
    parse_cluster(net + "[device]\ngpu = \"h300\"\n", "x.toml");
    FAIL() << "an unknown GPU was taken";
  } catch (const UserError& e) {
    const std::string what = e.what();
    EXPECT_NE(what.find("`device.gpu`: unknown GPU \"h300\"; known: h100-sxm"), std::string::npos)
        << what;
  }
  // Without device.gpu the figures stay required.
  try {
    parse_cluster(net + "[device]\nhbm_gib = 80.0\n", "y.toml");
    FAIL() << "a cluster without a peak was taken";
  } catch (const UserError& e) {
    EXPECT_NE(std::string(e.what()).find("device.peak_tflops"), std::string::npos) << e.what();
  }
}

}  // namespace
}  // namespace t3d::runtime
