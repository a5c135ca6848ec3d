// The pipeline's messages between two stages arrive in the order they were sent, for every
// schedule but ZB-V: the executor's sends and receives (runtime/stage/executor.cpp: F receives from
// the previous chunk's stage and sends to the next's, B / BW the other way, same-stage hand-overs
// local) listed per ordered pair of stages. NCCL's point to point has no tags and matches a
// pair's messages in order (parallel/nccl_comm.h), so this is what lets the pp group use it (ZB-V
// keeps it staged: runtime/stage/device_comm.h); MPI matches by tag and needs none of it.
#include <gtest/gtest.h>

#include <map>
#include <string>
#include <tuple>
#include <utility>
#include <vector>

#include "parallel/schedule.h"

namespace t3d::parallel {
namespace {

// (micro-batch, chunk, gradient): what a message carries, as the executor's tag encodes it.
using Message = std::tuple<int, int, bool>;
using Pair = std::pair<int, int>;  // (from stage, to stage)

// Per ordered pair of stages, the messages in the order the sender sends them and in the order
// the receiver takes them.
void list_messages(const Schedule& s, std::map<Pair, std::vector<Message>>& sent,
                   std::map<Pair, std::vector<Message>>& taken) {
  const int K = s.num_chunks();
  const auto stage = [&](int k) { return s.chunk_stage[static_cast<size_t>(k)]; };
  for (int r = 0; r < s.pp; ++r) {
    for (const Action& a : s.ranks[static_cast<size_t>(r)]) {
      if (a.op == Op::kF) {
        if (a.chunk > 0 && stage(a.chunk - 1) != r)
          taken[{stage(a.chunk - 1), r}].emplace_back(a.mb, a.chunk, false);
        if (a.chunk + 1 < K && stage(a.chunk + 1) != r)
          sent[{r, stage(a.chunk + 1)}].emplace_back(a.mb, a.chunk + 1, false);
      } else if (a.op != Op::kW) {
        if (a.chunk + 1 < K && stage(a.chunk + 1) != r)
          taken[{stage(a.chunk + 1), r}].emplace_back(a.mb, a.chunk, true);
        if (a.chunk > 0 && stage(a.chunk - 1) != r)
          sent[{r, stage(a.chunk - 1)}].emplace_back(a.mb, a.chunk - 1, true);
      }
    }
  }
}

// Every schedule but ZB-V delivers in send order; receives_in_send_order says so, and
// pipeline_messages lists what this listing does.
TEST(MessageOrder, EveryScheduleButZbVReceivesInSendOrder) {
  int checked = 0, zb_v_out_of_order = 0;
  for (const ScheduleKind kind :
       {ScheduleKind::kGPipe, ScheduleKind::k1F1B, ScheduleKind::kInterleaved1F1B,
        ScheduleKind::kZBH1, ScheduleKind::kZBV}) {
    for (int pp = 2; pp <= 8; ++pp) {
      for (int n_micro = 1; n_micro <= 3 * pp; ++n_micro) {
        for (int v = 1; v <= 3; ++v) {
          const bool interleaved = kind == ScheduleKind::kInterleaved1F1B;
          if (kind == ScheduleKind::kZBV ? v != 2 : (!interleaved && v != 1)) continue;
          if (interleaved && (v < 2 || n_micro % pp != 0)) continue;
          const Schedule s = make_schedule(kind, pp, n_micro, v);
          std::map<Pair, std::vector<Message>> sent, taken;
          list_messages(s, sent, taken);
          const std::string what = std::string(to_string(kind)) + " pp " + std::to_string(pp) +
                                   " n_micro " + std::to_string(n_micro);
          const PipelineMessages m = pipeline_messages(s);
          EXPECT_EQ(m.sent, sent) << what;
          EXPECT_EQ(m.taken, taken) << what;
          EXPECT_EQ(receives_in_send_order(s), sent == taken) << what;
          if (kind != ScheduleKind::kZBV) EXPECT_TRUE(sent == taken) << what;
          zb_v_out_of_order += kind == ScheduleKind::kZBV && sent != taken;
          ++checked;
        }
      }
    }
  }
  EXPECT_GT(checked, 100);
  EXPECT_GT(zb_v_out_of_order, 0);  // the reason the pp group is staged under ZB-V
}

}  // namespace
}  // namespace t3d::parallel
