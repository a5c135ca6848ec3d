#include "runtime/train/router_balance.h"

#include <spdlog/spdlog.h>

#include <algorithm>

#include "kernels/ops.h"
#include "kernels/ops_moe.h"
#include "parallel/comm.h"
#include "runtime/model/model.h"
#include "runtime/train/sharded_state.h"

namespace t3d::runtime {

RouterBalance::RouterBalance(const parallel::Mesh& mesh, Model& model, const ShardedState& dense)
    : mesh_(mesh), model_(model), dense_(dense) {}

ExpertLoad RouterBalance::measure(int64_t step) {
  const ModelConfig& m = model_.config();
  if (!m.moe()) return {};
  counts_ = model_.expert_counts();
  if (!counts_.empty()) mesh_.dp_cp().all_reduce(counts_.data(), counts_.size());
  ExpertLoad load = measure_expert_load(mesh_, model_, dense_, counts_);
  for (const auto& flag : idle_.step(step, load.layers, load.idle))
    if (mesh_.rank() == 0) spdlog::warn("{}", IdleExpertWatch::describe({flag}));
  model_.reset_moe_stats();
  deltas_.clear();
  if (m.router_bias_rate > 0) {
    const int64_t E = m.n_experts;
    deltas_.resize(counts_.size());
    for (size_t b = 0; b < counts_.size(); b += static_cast<size_t>(E))
      kernels::moe_bias_delta(deltas_.data() + b, counts_.data() + b, E,
                              static_cast<float>(m.router_bias_rate));
  }
  return load;
}

void RouterBalance::apply() const {
  if (deltas_.empty()) return;
  const auto& params = model_.params();
  const auto& layers = model_.moe_layers();
  const int64_t E = model_.config().n_experts;
  dense_.for_each_piece(dense_.owned(), [&](const ShardedState::Piece& p) {
    const ParamInfo& info = params[p.param];
    if (!info.router_bias()) return;
    const auto at = std::find(layers.begin(), layers.end(), info.unit);
    T3D_ASSERT(at != layers.end(), info.name, " is not a router bias of a held block");
    // The piece's share of its block's deltas, whatever part of the tensor this rank owns.
    const float* delta =
        deltas_.data() + (at - layers.begin()) * E + (p.lo - model_.layout().at(info.name).offset);
    kernels::add_inplace(kernels::kCpu, dense_.params(p), delta, p.size());
  });
}

}  // namespace t3d::runtime
