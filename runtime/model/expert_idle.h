// A mixture of experts' idle-expert rule and the metrics.jsonl names of its per-layer load: the
// trainer's warning (runtime/train/router_balance.h) and `titan3d selfcheck`, which reads a run's
// metrics.jsonl, share them (docs/moe.md, "Idle experts").
#pragma once

#include <cstdint>
#include <string>
#include <vector>

namespace t3d::runtime {

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
