// The host a rank runs on, as the rooms above see it: where measurements of it are cached, and
// how a rank's compute threads are set up. The GEMM choice and the hardware peaks
// (runtime/machine/gemm_choice.h) measure through these.
#pragma once

#include <string>

#include "runtime/launch/launch.h"
#include "runtime/recipe/recipe.h"

namespace t3d::runtime {

// titan3d's cache of measurements of this host (GEMM rates and choice, hardware peaks, the
// planner's calibration): $XDG_CACHE_HOME/titan3d, else $HOME/.cache/titan3d, else
// /tmp/titan3d-cache. Not created here.
std::string cache_dir();

// Sets this rank's compute threads (the OpenMP pool every kernel runs on and the count OpenBLAS
// is told: kernels/gemm.h's set_rank_threads) to hardware.threads_per_rank, or this host's cores
// shared among its ranks, and returns the count. Logs the rank's CPU set (warning when it is
// smaller) when `report` is set. Every verb that computes sets its threads here.
int setup_rank_threads(const Recipe& r, const LaunchEnv& env, bool report);

}  // namespace t3d::runtime
