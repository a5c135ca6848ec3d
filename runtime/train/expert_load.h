// Mixture of experts, seen from outside (docs/moe.md, docs/metrics.md): what a step's routing
// looked like in every MoE block of the model, and the idle-expert rule the trainer's warning and
// `titan3d selfcheck` share.
#pragma once

#include <cstdint>
#include <string>
#include <vector>

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

// Collective over the mesh's world, once per step, before Model::reset_moe_stats. `counts`: E
// per held block in Model::moe_layers() order, already summed over dp × cp; the dropped slots
// are summed here. Every rank returns the whole model's values (each pp stage gives its blocks').
// `state`: the dense state group, which holds the router biases.
ExpertLoad measure_expert_load(const parallel::Mesh& mesh, const Model& model,
                               const ShardedState& state, const std::vector<double>& counts);

// metrics.jsonl's names for a layer's values.
std::string imbalance_field(int64_t layer);  // "expert_imbalance_layer_<l>"
std::string idle_field(int64_t layer);       // "idle_experts_layer_<l>"

// A MoE layer is flagged when some of its experts got no token in each of kIdleExpertSteps
// consecutive steps: its router collapsed onto the others (with balancing off, a common fate).
constexpr int64_t kIdleExpertSteps = 20;

class IdleExpertWatch {
 public:
  struct Flag {
    int64_t layer, since_step, steps;
  };
  // Feeds one step's idle experts, per layer of `layers` (ExpertLoad's). Returns the layers
  // whose streak reached kIdleExpertSteps at this step (each reported once per streak).
  std::vector<Flag> step(int64_t step, const std::vector<int64_t>& layers,
                         const std::vector<double>& idle);
  // The layers whose streak is at least kIdleExpertSteps now.
  std::vector<Flag> flagged() const;
  // One sentence naming the layers, since when, and the cure.
  static std::string describe(const std::vector<Flag>& flags);

 private:
  struct Streak {
    int64_t layer, since_step = 0, steps = 0;
  };
  std::vector<Streak> streaks_;
};

}  // namespace t3d::runtime
