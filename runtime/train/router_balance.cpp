#include "runtime/train/router_balance.h"

#include <spdlog/spdlog.h>

#include <algorithm>
#include <limits>

#include "kernels/ops.h"
#include "kernels/ops_moe.h"
#include "parallel/comm.h"
#include "runtime/model/model.h"
#include "runtime/train/sharded_state.h"

namespace t3d::runtime {

namespace {

// The load of `counts` (E per held block, summed over dp × cp already): collective over the
// world, every rank returns the whole model's values (each pp stage gives its blocks'); the
// dropped slots are summed here; `state` holds the router biases, gathered into `biases` (the
// Exec's memory) to cross to the host at once: one wait a step, not one a block.
ExpertLoad measure_load(const parallel::Mesh& mesh, const Model& model, const ShardedState& state,
                        const std::vector<double>& counts, kernels::Buffer& biases) {
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
    const auto each_bias = [&](const auto& use) {
      state.for_each_piece(state.owned(), [&](const ShardedState::Piece& p) {
        if (params[p.param].router_bias()) use(p);
      });
    };
    int64_t floats = 0;
    each_bias([&](const ShardedState::Piece& p) { floats += p.size(); });
    if (biases.bytes() < static_cast<size_t>(floats) * sizeof(float))
      biases.reserve(model.exec(), static_cast<size_t>(floats) * sizeof(float), "router biases");
    int64_t at = 0;
    each_bias([&](const ShardedState::Piece& p) {
      kernels::copy(model.exec(), biases.as<float>() + at, state.params(p), p.size());
      at += p.size();
    });
    std::vector<float> v(static_cast<size_t>(floats));
    if (floats > 0)
      kernels::copy_to_host(model.exec(), v.data(), biases.as<float>(), v.size() * sizeof(float));
    for (const float b : v) {
      bias_range[0] = std::max(bias_range[0], -static_cast<double>(b));
      bias_range[1] = std::max(bias_range[1], static_cast<double>(b));
    }
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

}  // namespace

RouterBalance::RouterBalance(const parallel::Mesh& mesh, Model& model, const ShardedState& dense)
    : mesh_(mesh), model_(model), dense_(dense) {}

ExpertLoad RouterBalance::measure(int64_t step) {
  const ModelConfig& m = model_.config();
  if (!m.moe()) return {};
  counts_ = model_.expert_counts();
  if (!counts_.empty()) mesh_.dp_cp().all_reduce(counts_.data(), counts_.size());
  ExpertLoad load = measure_load(mesh_, model_, dense_, counts_, biases_);
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
  const kernels::Exec& exec = model_.exec();
  const size_t bytes = deltas_.size() * sizeof(float);
  deltas_in_model_.reserve(exec, bytes, "router bias deltas");
  kernels::copy_from_host(exec, deltas_in_model_.as<float>(), deltas_.data(), bytes);
  const auto& params = model_.params();
  const auto& layers = model_.moe_layers();
  const int64_t E = model_.config().n_experts;
  dense_.for_each_piece(dense_.owned(), [&](const ShardedState::Piece& p) {
    const ParamInfo& info = params[p.param];
    if (!info.router_bias()) return;
    const auto at = std::find(layers.begin(), layers.end(), info.unit);
    T3D_ASSERT(at != layers.end(), info.name, " is not a router bias of a held block");
    // The piece's share of its block's deltas, whatever part of the tensor this rank owns.
    const float* delta = deltas_in_model_.as<float>() + (at - layers.begin()) * E +
                         (p.lo - model_.layout().at(info.name).offset);
    kernels::add_inplace(exec, dense_.params(p), delta, p.size());
  });
}

}  // namespace t3d::runtime
