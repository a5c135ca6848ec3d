#include "runtime/model/expert_idle.h"

#include <fmt/format.h>

#include <algorithm>

namespace t3d::runtime {

std::string imbalance_field(int64_t layer) {
  return fmt::format("expert_imbalance_layer_{}", layer);
}
std::string idle_field(int64_t layer) { return fmt::format("idle_experts_layer_{}", layer); }

std::vector<IdleExpertWatch::Flag> IdleExpertWatch::step(int64_t step,
                                                         const std::vector<int64_t>& layers,
                                                         const std::vector<double>& idle) {
  std::vector<Flag> reached;
  for (size_t i = 0; i < layers.size(); ++i) {
    auto it = std::find_if(streaks_.begin(), streaks_.end(),
                           [&](const Streak& s) { return s.layer == layers[i]; });
    if (it == streaks_.end()) it = streaks_.insert(streaks_.end(), Streak{layers[i]});
    if (idle[i] <= 0) {
      it->steps = 0;
      continue;
    }
    if (it->steps == 0) it->since_step = step;
    if (++it->steps == kIdleExpertSteps) reached.push_back({it->layer, it->since_step, it->steps});
  }
  return reached;
}

std::vector<IdleExpertWatch::Flag> IdleExpertWatch::flagged() const {
  std::vector<Flag> out;
  for (const auto& s : streaks_)
    if (s.steps >= kIdleExpertSteps) out.push_back({s.layer, s.since_step, s.steps});
  return out;
}

std::string IdleExpertWatch::describe(const std::vector<Flag>& flags) {
  std::string which;
  for (const auto& f : flags)
    which += fmt::format("{}{} ({} steps since step {})", which.empty() ? "" : ", ", f.layer,
                         f.steps, f.since_step);
  const bool one = flags.size() == 1;
  return fmt::format(
      "MoE layer{} {}: some of {} experts got no token in any of those steps; {} collapsed onto "
      "the other experts (balance with model.router_bias_rate or model.router_aux_coef, "
      "docs/moe.md)",
      one ? "" : "s", which, one ? "its" : "their", one ? "its router has" : "their routers have");
}

}  // namespace t3d::runtime
