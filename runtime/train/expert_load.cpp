#include "runtime/train/expert_load.h"

#include <algorithm>
#include <limits>

#include "parallel/comm.h"
#include "runtime/model/model.h"
#include "runtime/train/sharded_state.h"

namespace t3d::runtime {

ExpertLoad measure_expert_load(const parallel::Mesh& mesh, const Model& model,
                               const ShardedState& state, const std::vector<double>& counts) {
  const ModelConfig& m = model.config();
  const size_t E = static_cast<size_t>(m.n_experts);
  ExpertLoad load;
  for (int64_t l = 0; l < m.n_layers; ++l)
    if (m.moe_block(l)) load.layers.push_back(l);
  const size_t n = load.layers.size();
  std::vector<double> dropped = model.dropped_slots();
  if (!dropped.empty()) mesh.dp_cp().all_reduce(dropped.data(), dropped.size());
  // One max-reduction over the world: per layer the imbalance and the idle experts (0 on the
  // stages that do not hold it; tp and dp × cp ranks agree), then the most slots a block routed
  // and dropped, and the bias range as (−min, max).
  constexpr double kLowest = std::numeric_limits<double>::lowest();
  std::vector<double> all(2 * n + 4, 0.0);
  double* routed = &all[2 * n];
  double* most_dropped = &all[2 * n + 1];
  double* bias_range = &all[2 * n + 2];
  bias_range[0] = bias_range[1] = kLowest;
  const auto& held = model.moe_layers();
  for (size_t b = 0; b < held.size(); ++b) {
    const size_t at = static_cast<size_t>(
        std::lower_bound(load.layers.begin(), load.layers.end(), held[b]) - load.layers.begin());
    double total = 0, busiest = 0, idle = 0;
    for (size_t e = b * E; e < (b + 1) * E; ++e) {
      total += counts[e], busiest = std::max(busiest, counts[e]);
      if (counts[e] == 0) ++idle;
    }
    all[at] = total > 0 ? busiest * static_cast<double>(E) / total : 0.0;
    all[n + at] = idle;
    *routed = std::max(*routed, total);
    *most_dropped = std::max(*most_dropped, dropped[b]);
  }
  if (m.router_bias_rate > 0) {
    const auto& params = model.params();
    state.for_each_piece(state.owned(), [&](const ShardedState::Piece& p) {
      if (!params[p.param].router_bias()) return;
      const float* v = state.params(p);
      for (int64_t i = 0; i < p.size(); ++i) {
        bias_range[0] = std::max(bias_range[0], -static_cast<double>(v[i]));
        bias_range[1] = std::max(bias_range[1], static_cast<double>(v[i]));
      }
    });
  }
  mesh.world().all_reduce(all.data(), all.size(), parallel::ReduceOp::max);
  load.imbalance.assign(all.begin(), all.begin() + static_cast<std::ptrdiff_t>(n));
  load.idle.assign(all.begin() + static_cast<std::ptrdiff_t>(n),
                   all.begin() + static_cast<std::ptrdiff_t>(2 * n));
  load.largest_imbalance = *std::max_element(load.imbalance.begin(), load.imbalance.end());
  load.routed_slots = *routed;
  load.dropped_slots = *most_dropped;
  if (m.router_bias_rate > 0) load.bias_min = -bias_range[0], load.bias_max = bias_range[1];
  return load;
}

}  // namespace t3d::runtime
