// What a replay check found on each rank, and who is to blame (replay.h): every rank's finding
// travels to every rank as words, and each judges alike.
#pragma once

#include <cstdint>
#include <string>
#include <type_traits>
#include <vector>

#include "parallel/mesh.h"
#include "runtime/train/replay_update.h"

namespace t3d::runtime {

// What a check found about one rank; every rank learns every rank's (one all-gather).
enum : uint64_t { kAgrees, kTransient, kDisagrees, kUnstable };  // ReplayFinding::verdict
enum : uint64_t { kParamsAgree, kParamsMinority, kParamsUnsettled, kParamsNotCompared };
struct ReplayFinding {
  uint64_t verdict = kAgrees;  // of this rank's own gradients against its replayer's
  uint64_t params = kParamsAgree;
  uint64_t replayer = 0;                      // the world rank that replayed this rank's share
  uint64_t differing = 0, reductions = 0;     // buckets whose hashes differ, of all reductions
  uint64_t first = 0, group = 0, bucket = 0;  // the first differing reduction: index, where
  uint64_t own = 0, replayed = 0;             // its hashes: this rank's and the replayer's
  uint64_t param_hash = 0;
  uint64_t at_rest = 0;  // KeptParams::Change: the step before whose update they were found changed
  uint64_t rest_group = 0, rest_kept = 0, rest_found = 0;
  UpdateCheck::Finding update;  // the recomputation of ZeRO owners' updates (replay_update.h)
};
inline constexpr size_t kFindingWords = sizeof(ReplayFinding) / sizeof(uint64_t);
static_assert(std::is_trivially_copyable_v<ReplayFinding> &&
                  sizeof(ReplayFinding) % sizeof(uint64_t) == 0,
              "a Finding travels as words");

struct ReplayVerdict {
  std::vector<size_t> named;  // the culprit, or the candidates
  bool settled = false;
  std::string why;  // what the named rank(s) did, in words
};
// Who is to blame, from every rank's finding (the same on every rank), `dp` the size of the
// data-parallel groups.
ReplayVerdict judge_replay(const std::vector<ReplayFinding>& all, const parallel::MeshShape& shape,
                           int dp);
// What rank r's finding says: "; rank R: ..." (empty when it found nothing).
std::string replay_detail(const std::vector<ReplayFinding>& all, size_t r);

}  // namespace t3d::runtime
