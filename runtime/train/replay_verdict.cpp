#include "runtime/train/replay_verdict.h"

#include <fmt/format.h>

#include <algorithm>
#include <map>

#include "checkpoint/hash.h"

namespace t3d::runtime {

// In this order: parameters changed at rest; an optimizer update (or a recomputation of one)
// outvoted; a parameter hash outvoted in its dp group; ranks whose own pass was not reproduced
// (transient); the ranks whose parameter hashes differ without a majority (dp = 2: not settled);
// an update and its one recomputation that differ (not settled); else the rank common to the most
// persistent disagreements (settled when it is one rank and dp ≥ 3).
ReplayVerdict judge_replay(const std::vector<ReplayFinding>& all, const parallel::MeshShape& shape,
                           int dp) {
  ReplayVerdict v;
  std::vector<size_t> at_rest, minority, transient, unsettled;
  std::vector<size_t> wrong_update, wrong_recompute, update_unsettled;
  std::map<size_t, int> disputes;  // rank -> persistent disagreements it takes part in
  for (size_t r = 0; r < all.size(); ++r) {
    const ReplayFinding& f = all[r];
    if (f.at_rest != 0) at_rest.push_back(r);
    if (f.params == kParamsMinority) minority.push_back(r);
    if (f.params == kParamsUnsettled) unsettled.push_back(r);
    if (f.verdict == kTransient || f.verdict == kUnstable) transient.push_back(r);
    if (f.verdict == kDisagrees) ++disputes[r], ++disputes[static_cast<size_t>(f.replayer)];
    if (f.update.verdict == UpdateCheck::Finding::kWrongUpdate) wrong_update.push_back(r);
    if (f.update.verdict == UpdateCheck::Finding::kWrongRecomputation) wrong_recompute.push_back(r);
    if (f.update.verdict == UpdateCheck::Finding::kUnsettled) update_unsettled.push_back(r);
  }
  if (!at_rest.empty()) {
    v.named = at_rest, v.settled = true;
    v.why =
        "its parameters changed in its memory between two optimizer steps, when nothing writes "
        "them";
    return v;
  }
  if (!wrong_update.empty()) {
    v.named = wrong_update, v.settled = true;
    v.why =
        "its optimizer update, which two peers recomputed alike from its inputs and found "
        "otherwise (wrong arithmetic in the update the all-gather hands to every replica)";
    return v;
  }
  if (!wrong_recompute.empty()) {
    v.named = wrong_recompute, v.settled = true;
    v.why =
        "its recomputation of a peer's optimizer update, which the owner and another peer "
        "computed alike and otherwise";
    return v;
  }
  if (!minority.empty()) {
    v.named = minority, v.settled = true;
    v.why = "parameters whose hash differs from the other replicas' (outvoted in its dp group)";
    return v;
  }
  if (!transient.empty()) {
    // A value corrupted in the backward (a stored activation, a gradient) changes what the
    // stages before it compute from its input gradient, never the stages after it: the most
    // downstream stage comes first, then the rank with the most differing buckets. (A fault in
    // the forward reaches every later stage too; all of them are named either way.)
    const auto stage = [&](size_t r) { return shape.coord_of(static_cast<int>(r)).pp; };
    std::stable_sort(transient.begin(), transient.end(), [&](size_t a, size_t b) {
      if (stage(a) != stage(b)) return stage(a) > stage(b);
      return all[a].differing > all[b].differing;
    });
    v.named = transient, v.settled = true;
    v.why = all[transient[0]].verdict == kTransient
                ? "gradients that neither a peer's replay nor its own recomputation reproduce (a "
                  "transient fault)"
                : "three passes over the same share gave three different gradients";
    return v;
  }
  if (!unsettled.empty()) {
    v.named = unsettled;
    v.why = "parameter hashes that differ, with no majority in their dp group";
    return v;
  }
  if (!update_unsettled.empty()) {
    v.named = update_unsettled;
    v.why =
        "an optimizer update and its recomputation by a peer that differ (no third rank of the "
        "state group recomputed it)";
    return v;
  }
  int top = 0;
  for (const auto& [r, n] : disputes) top = std::max(top, n);
  for (const auto& [r, n] : disputes)
    if (n == top) v.named.push_back(r);
  if (!v.named.empty()) {
    v.settled = v.named.size() == 1 && dp >= 3;
    v.why =
        "each reproduces its own gradients, which the peer replaying it does not (a persistent "
        "fault: its parameters or its arithmetic)";
  }
  return v;
}

// "; rank R: dense bucket B (...): hash H, its replay by rank Q: H'; parameter hash P".
std::string replay_detail(const std::vector<ReplayFinding>& all, size_t r) {
  const ReplayFinding& f = all[r];
  std::string text;
  if (f.differing > 0)
    text = fmt::format(
        " {} bucket {} (reduction {} of {}, {} differ): hash {}, its replay by rank {}: {};",
        f.group == 0 ? "dense" : "experts", f.bucket, f.first + 1, f.reductions, f.differing,
        checkpoint::to_hex(f.own), f.replayer, checkpoint::to_hex(f.replayed));
  if (f.params == kParamsMinority || f.params == kParamsUnsettled)
    text += " parameter hash " + checkpoint::to_hex(f.param_hash) + ";";
  if (f.at_rest != 0)
    text += fmt::format(
        " its {} parameters changed in memory after step {}'s update: hash {} then, {} before "
        "step {}'s;",
        f.rest_group == 0 ? "dense" : "experts", f.at_rest - 1, checkpoint::to_hex(f.rest_kept),
        checkpoint::to_hex(f.rest_found), f.at_rest);
  const UpdateCheck::Finding& u = f.update;
  if (u.verdict != UpdateCheck::Finding::kAgrees && u.recomputed == 0)
    text += fmt::format(" its update of the {} parameters: hash {}, recomputed by rank {}: {};",
                        u.group == 0 ? "dense" : "experts", checkpoint::to_hex(u.hash),
                        u.other_rank, checkpoint::to_hex(u.other));
  if (u.verdict != UpdateCheck::Finding::kAgrees && u.recomputed != 0)
    text += fmt::format(
        " its recomputation of rank {}'s update of the {} parameters: hash {}, rank {}'s own: {};",
        u.other_rank, u.group == 0 ? "dense" : "experts", checkpoint::to_hex(u.hash), u.other_rank,
        checkpoint::to_hex(u.other));
  if (text.empty()) return "";
  text.pop_back();
  return "; rank " + std::to_string(r) + ":" + text;
}

}  // namespace t3d::runtime
