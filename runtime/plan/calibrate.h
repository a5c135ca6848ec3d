// `titan3d plan --calibrate`: measure this machine, under the recipe's own ranks, and
// turn the numbers into a cluster description the local plan uses instead of its guesses.
//
// The probe runs through the same machinery as `train` (make_spawn_plan, join_world): mpirun
// re-executes titan3d with one rank per device of the recipe, so oversubscription (8 ranks on 2
// cores), OpenBLAS's threads and shared-memory MPI are what training will see. It measures
//   - compute: forward + backward of one transformer block at the recipe's micro-batch shape
//     (rows, tp-sharded GEMMs), on every rank at once; the planner's FLOP count of that block over
//     the time is the effective rate (GEMMs, attention and element-wise work together);
//   - communication: all-reduce latency (tiny message) and bandwidth (1 MiB) of the group that
//     carries most of a step's collectives (tp, else the world), fitted to the ring model the
//     planner prices collectives with.
// The result is a cluster TOML (parse_cluster's format, so it can also be given to --cluster),
// cached per machine and shape; without --cluster, `plan` uses a cached calibration when one
// exists.
#pragma once

#include <string>
#include <vector>

#include "runtime/cost/cluster.h"
#include "runtime/recipe/recipe.h"

namespace t3d::runtime {

struct Job;

// Spawns the probe under mpirun (`argv`: this process's own command line, to re-execute), writes
// the cache file and returns the calibrated cluster. UserError if the probe fails.
Cluster calibrate_local(const Recipe& recipe, const std::vector<std::string>& argv);

// Inside the probe's world, in job.precision(): measures and, on rank 0, writes the cluster TOML
// to `out`.
void run_calibration_probe(const Job& job, const std::string& out);

}  // namespace t3d::runtime
