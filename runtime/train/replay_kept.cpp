#include "runtime/train/replay_kept.h"

#include <algorithm>

#include "kernels/ops.h"
#include "runtime/train/sharded_state.h"

namespace t3d::runtime {

KeptParams::KeptParams(const TrainingState& state, int zero) : state_(state) {
  const auto& groups = state.groups();
  for (size_t g = 0; g < groups.size(); ++g)
    if (zero >= 1 || groups[g]->group_size() == 1) watched_.push_back(g);
  kept_.resize(watched_.size());
  updated();
}

uint64_t KeptParams::hash(size_t group) {
  const ShardedState::Store s = state_.groups()[group]->param_store();
  checkpoint::Hash64Stream h;
  if (s.sharded)  // the owned ranges back to back
    kernels::hash_floats(state_.exec(), h, s.data, s.floats);
  else
    for (const auto& r : s.ranges)
      kernels::hash_floats(state_.exec(), h, s.data + r.begin, r.size());
  return h.value();
}

void KeptParams::updated() {
  for (size_t i = 0; i < watched_.size(); ++i) kept_[i] = hash(watched_[i]);
}

void KeptParams::verify(int64_t step) {
  for (size_t i = 0; i < watched_.size(); ++i) {
    const uint64_t now = hash(watched_[i]);
    if (now == kept_[i] || change_.step != 0) continue;
    change_ = {step, watched_[i], kept_[i], now};
  }
}

}  // namespace t3d::runtime
