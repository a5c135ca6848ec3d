// Elastic shrink (run.elastic): after a failure, the restart loop (supervisor.h) asks mpirun to
// reach every host of run.hostfile; when some cannot be reached, a relaunch on the same hosts
// cannot start, and with run.elastic the job continues on the hosts that remain with a smaller
// dp. train.global_batch stays: each remaining replica takes more micro-batches (gradient
// accumulation), and since the sampler's rows depend only on (seed, step) and a snapshot reshards
// onto any layout, the continued run computes the same steps up to the order of fp32 sums.
//
// A shrink gives each rank larger ZeRO shards and more micro-batches per step, and a mixture of
// experts' shrink also folds parallel.ep into the smaller dp·cp, so each rank holds more experts:
// every shrink is priced before it is taken, and when no smaller layout fits hardware.hbm_gib
// the job stops, saying so (docs/moe.md, "Elastic shrink").
#pragma once

#include <functional>
#include <optional>
#include <string>
#include <vector>

#include "runtime/launch/hosts.h"
#include "runtime/recipe/recipe.h"

namespace t3d::runtime {

// The layout of a shrunk job, or why there is none.
struct Shrink {
  int64_t dp = 0, micro_batches = 0;  // the new parallel.dp and train.micro_batches
  int64_t ep = 1;                     // the new parallel.ep: the old one, or its largest divisor
                                      // that still divides dp·cp
  int ranks = 0;                      // pp·dp·cp·tp after the shrink
  std::string why_not;                // non-empty: no smaller layout fits
  std::string note;                   // why a larger dp was passed over (memory), or empty
};

// The device bytes one rank of a recipe's layout needs, or nullopt where they are not priced.
// supervise sits below the cost model (CONTRIBUTING.md, "Layers"): apps/ passes its
// planned_rank_bytes (runtime/cost/planner.h), the figure `plan` and selfcheck use.
using RankBytes = std::function<std::optional<double>(const Recipe&)>;

// The largest dp below `recipe`'s (dp resolved) that divides it and whose world fits `capacity`
// ranks, with micro_batches scaled by the ratio so that dp·micro_batches, and so the rows of
// every micro-batch, stay as they were, and expert parallelism folded into what is left. Given
// `rank_bytes`, also the largest whose layout fits hardware.hbm_gib; none: why_not names what
// grew (ZeRO's shards, the micro-batches, a mixture of experts' experts per rank), the GiB and
// what to do.
Shrink plan_shrink(const Recipe& recipe, int capacity, const RankBytes& rank_bytes = {});

// `recipe` in the layout `shrink` gives it.
Recipe shrunk_recipe(const Recipe& recipe, const Shrink& shrink);

// How many ranks the hosts that remain can take: their slots when the hostfile gives every
// host's, else the world's share of the remaining hosts.
int remaining_capacity(const std::vector<HostEntry>& all, const std::vector<HostEntry>& remaining,
                       int world);

// "pp2 dp2 tp2 (8 ranks, 2 micro-batches)" — the words of the shrink's log line.
std::string describe_layout(const Recipe& recipe);

// The hosts of `hosts` mpirun cannot reach now (probe_host each, `timeout_s` each), with the
// reason for each, in hostfile order.
struct LostHost {
  HostEntry host;
  std::string why;
};
std::vector<LostHost> unreachable_hosts(const std::vector<HostEntry>& hosts, bool as_root,
                                        double timeout_s);

}  // namespace t3d::runtime
