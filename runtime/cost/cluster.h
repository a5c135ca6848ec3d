// A cluster description for `titan3d plan`: how many devices, how much memory and compute each
// has, and how fast they talk inside and between nodes. Its own small TOML file
// (recipes/clusters/*.toml), parsed as strictly as a recipe: an unknown key is an error that
// names it and suggests the closest known one. It is not part of the recipe schema: a recipe
// says what to train, a cluster file where.
#pragma once

#include <cstdint>
#include <string>
#include <vector>

namespace t3d::runtime {

struct Cluster {
  std::string name = "cluster";
  int64_t nodes = 1;
  int64_t devices_per_node = 1;
  double hbm_gib = 0;                // device memory per device
  double peak_tflops = 0;            // dense peak at the training precision, per device
  double compute_efficiency = 0.5;   // fraction of the peak the model's GEMMs reach
  double intra_node_gbps = 0;        // GB/s (1e9 B/s) one direction, per device
  double intra_node_latency_us = 1;  // per message inside a node
  double inter_node_gbps = 0;        // GB/s one direction, per node (all its NICs together)
  double inter_node_latency_us = 5;  // per message between nodes
  // Measured all-to-all of an expert-parallel group (plan --calibrate): bytes a rank sends per
  // second and the latency per peer. 0: priced from the links above.
  double all_to_all_gbps = 0;
  double all_to_all_latency_us = 0;

  std::string source;  // file it came from, for messages
  int64_t world() const { return nodes * devices_per_node; }
};

// UserError (exit 2) naming the file, line and key on: unknown section or key (with the closest
// known key), wrong type, missing required key, value out of range.
Cluster parse_cluster(const std::string& toml_text, const std::string& source_name);
Cluster load_cluster(const std::string& path);

}  // namespace t3d::runtime
