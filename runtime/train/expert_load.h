// Mixture of experts, seen from outside (docs/moe.md, docs/metrics.md): what a step's routing
// looked like in every MoE block of the model (the idle-expert rule the trainer's warning and
// `titan3d selfcheck` share is runtime/model/expert_idle.h).
#pragma once

#include <cstdint>
#include <string>
#include <vector>

#include "runtime/model/expert_idle.h"

namespace t3d::parallel {
class Mesh;
}

namespace t3d::runtime {

class Model;
class ShardedState;

struct ExpertLoad {
  std::vector<int64_t> layers;        // the model's MoE blocks (global index), ascending
  std::vector<double> imbalance;      // per layer: the busiest expert's tokens over the mean
  std::vector<double> idle;           // per layer: experts that got no token
  double largest_imbalance = 0;       // over the layers
  double routed_slots = 0;            // the most slots a block routed (each counted once)
  double dropped_slots = 0;           // the most slots a block dropped (model.capacity_factor)
  double bias_min = 0, bias_max = 0;  // over every block's router bias (router_bias_rate > 0)
};

// RouterBalance::measure's (router_balance.h). Collective over the mesh's world, once per step,
// before Model::reset_moe_stats. `counts`: E
// per held block in Model::moe_layers() order, already summed over dp × cp; the dropped slots
// are summed here. Every rank returns the whole model's values (each pp stage gives its blocks').
// `state`: the dense state group, which holds the router biases.
ExpertLoad measure_expert_load(const parallel::Mesh& mesh, const Model& model,
                               const ShardedState& state, const std::vector<double>& counts);

}  // namespace t3d::runtime
