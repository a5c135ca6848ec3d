// `titan3d plan`: the verb. Prints the ranked layouts of the cost model (runtime/cost/planner.h)
// for a recipe on a cluster, its --explain / --schedule / --write-recipe views, and with
// --calibrate first measures this machine (calibrate.h).
#pragma once

#include <cstdint>
#include <string>
#include <vector>

#include "runtime/recipe/recipe.h"

namespace t3d::runtime {

struct PlanOptions {
  std::string recipe;
  std::vector<Override> overrides;
  std::string cluster;  // empty: local_cluster()
  int64_t top = 10;
  int64_t explain = -1;      // -1 none; 0 the recipe's own layout; N row N of the table
  std::string write_recipe;  // write the best layout as a recipe here
  bool schedule = false;     // print the recipe layout's simulated timeline
  std::string svg;           // ... and draw it here
  bool calibrate = false;
  std::string calibrate_probe;    // internal: this process is a rank of the probe; write here
  std::vector<std::string> argv;  // titan3d's own command line, for the probe to re-execute
  std::vector<int64_t> zero;      // ZeRO stages to try; empty: all
};

// Runs the verb, printing to stdout. UserError for bad input (apps/ maps it to exit 2).
int run_plan(const PlanOptions& options);

}  // namespace t3d::runtime
