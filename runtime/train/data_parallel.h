// Data parallelism for a Model: its gradient units bucketed and handed to a GradReducer (ZeRO 0-3,
// parallel/grad_reducer.h), shared by the trainer and the planner's memory test.
#pragma once

#include <memory>

#include "kernels/arena.h"
#include "parallel/comm.h"
#include "parallel/grad_reducer.h"
#include "runtime/model/model.h"

namespace t3d::runtime {

// The data-parallel reducer of `model`'s gradients on `dp` (parallel/grad_reducer.h): gradient
// units merged into buckets of about `bucket_mb`, the model's grad source and hook pointing at
// it. With ZeRO >= 2 the model must have been built without a gradient region
// (ModelOptions::grad_region), with ZeRO 3 also without a parameter region, whose shard and
// gathers the reducer then provides (the moment shard is ShardedState's). The reducer must
// outlive the model's training use.
std::unique_ptr<parallel::GradReducer> attach_grad_reducer(Model& model, const parallel::Comm& dp,
                                                           int zero, double bucket_mb,
                                                           kernels::Arena& arena);

}  // namespace t3d::runtime
