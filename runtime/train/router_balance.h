// A mixture of experts' routing, once per optimizer step, with one owner (docs/moe.md,
// "Balancing" and "Metrics"): the tokens the step routed to each expert (the Model's counts)
// summed over dp × cp, the load they show (ExpertLoad, expert_load.h) and the idle-expert warning,
// and aux-loss-free balancing (model.router_bias_rate): each router bias's step
// (kernels::moe_bias_delta), added to the biases this rank owns when the step is applied. The
// biases are the tensors of row BlockWeight::kRouterBias (ParamInfo::router_bias), which AdamW
// leaves alone.
#pragma once

#include <vector>

#include "runtime/model/expert_idle.h"
#include "runtime/train/expert_load.h"

namespace t3d::parallel {
class Mesh;
}

namespace t3d::runtime {

class Model;
class ShardedState;

class RouterBalance {
 public:
  // `dense`: the dense state group, which holds the router biases. A dense model: every call
  // does nothing.
  RouterBalance(const parallel::Mesh& mesh, Model& model, const ShardedState& dense);

  // Collective over the mesh, once per step after its backward: counts → all-reduce over dp × cp
  // → the load (returned; every rank the whole model's) and rank 0's idle-expert warning → the
  // biases' deltas. Restarts the Model's counts.
  ExpertLoad measure(int64_t step);
  // Adds the deltas of the last measure() to the biases this rank owns, before the optimizer
  // gathers the parameters (a step skipped for a non-finite loss calls nothing: no bias moves).
  void apply() const;

 private:
  const parallel::Mesh& mesh_;
  Model& model_;
  const ShardedState& dense_;
  std::vector<double> counts_;  // E per held MoE block (Model::moe_layers order)
  std::vector<float> deltas_;   // as counts_, the biases' step
  IdleExpertWatch idle_;
};

}  // namespace t3d::runtime
