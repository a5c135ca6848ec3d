// A mixture of experts' routing, once per optimizer step, with one owner (docs/moe.md,
// "Balancing" and "Metrics"): the tokens the step routed to each expert (the Model's counts)
// summed over dp × cp, the load they show (ExpertLoad) and the idle-expert warning,
// and aux-loss-free balancing (model.router_bias_rate): each router bias's step
// (kernels::moe_bias_delta), added to the biases this rank owns when the step is applied. The
// biases are the tensors of row BlockWeight::kRouterBias (ParamInfo::router_bias), which AdamW
// leaves alone.
#pragma once

#include <cstdint>
#include <vector>

#include "kernels/arena.h"
#include "runtime/model/expert_idle.h"

namespace t3d::parallel {
class Mesh;
}

namespace t3d::runtime {

class Model;
class ShardedState;

// What a step's routing looked like in every MoE block of the model (metrics.jsonl's MoE fields,
// docs/moe.md "Metrics").
struct ExpertLoad {
  std::vector<int64_t> layers;        // the model's MoE blocks (global index), ascending
  std::vector<double> imbalance;      // per layer: the busiest expert's tokens over the mean
  std::vector<double> idle;           // per layer: experts that got no token
  double largest_imbalance = 0;       // over the layers
  double routed_slots = 0;            // the most slots a block routed (each counted once)
  double dropped_slots = 0;           // the most slots a block dropped (model.capacity_factor)
  double bias_min = 0, bias_max = 0;  // over every block's router bias (router_bias_rate > 0)
};

class RouterBalance {
 public:
  // `dense`: the dense state group, which holds the router biases. A dense model: every call
  // does nothing.
  RouterBalance(const parallel::Mesh& mesh, Model& model, const ShardedState& dense);

  // Collective over the mesh, once per step after its backward: counts → all-reduce over dp × cp
  // → the load (returned; every rank the whole model's) and rank 0's idle-expert warning → the
  // biases' deltas. Restarts the Model's counts.
  ExpertLoad measure(int64_t step);
  // Adds the deltas of the last measure() to the biases this rank owns (the deltas cross into the
  // model's memory once: the MoE routing counts' crossing), before the optimizer gathers the
  // parameters (a step skipped for a non-finite loss calls nothing: no bias moves).
  void apply() const;

 private:
  const parallel::Mesh& mesh_;
  Model& model_;
  const ShardedState& dense_;
  std::vector<double> counts_;               // E per held MoE block (Model::moe_layers order)
  std::vector<float> deltas_;                // as counts_, the biases' step
  mutable kernels::Buffer deltas_in_model_;  // deltas_ where the model's memory is (apply)
  kernels::Buffer biases_;                   // the owned router biases gathered (measure)
  IdleExpertWatch idle_;
};

}  // namespace t3d::runtime
