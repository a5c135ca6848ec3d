// Pipeline schedules as data.
//
// A schedule is a pure function (pp stages, n_micro micro-batches, v chunks per stage) -> one
// ordered action list per pipeline rank. The executor runs the list over MPI, the simulator
// (parallel/simulator.h) predicts and draws it, the tests validate it; all read the same table.
//
// Chunks: the model's layers are cut into K = pp * v consecutive blocks ("chunks"); an action's
// `chunk` is that global index k in [0, K). Placement is a table `chunk_stage[k]`:
// round-robin (k % pp) for every schedule but ZB-V, so with v = 1 chunk k is simply stage k;
// ZB-V's V shape puts chunks k and 2pp-1-k on stage k (parallel/pipeline_split.h).
// Consecutive chunks on one rank (ZB-V's two chunks on stage pp-1) hand over locally: the
// dependency is the same, there is just no transfer.
//
// Actions, for micro-batch mb and chunk k:
//   F(mb,k)   forward.
//   B(mb,k)   backward for the input gradient only (zero-bubble schedules).
//   W(mb,k)   backward for the weight gradient (zero-bubble schedules).
//   BW(mb,k)  the whole backward as one action: B then W with nothing between. Plain schedules
//             (GPipe, 1F1B, interleaved) use BW, so their tables are exactly Megatron's.
// Every (mb, k) has one F and either one BW or one B and one W.
//
// Communication is implied, never listed: F(mb,k) needs the output of F(mb,k-1), received from
// stage chunk_stage[k-1] when that is another rank; B/BW(mb,k) needs the input gradient of
// B/BW(mb,k+1). W(mb,k) needs B(mb,k) on the same rank. Semantics the executor must provide (and
// the validator assumes): a send is posted right after the producing action and does not block
// (isend); an action blocks until its inputs have been received.
#pragma once

#include <cstdint>
#include <map>
#include <string>
#include <string_view>
#include <tuple>
#include <utility>
#include <vector>

#include "parallel/schedule_kind.h"

namespace t3d::parallel {

enum class Op : uint8_t { kF, kB, kW, kBW };

struct Action {
  Op op = Op::kF;
  int mb = 0;
  int chunk = 0;

  friend bool operator==(const Action&, const Action&) = default;
};

std::string to_string(Op op);
std::string to_string(const Action& a);  // e.g. "F(3,1)", "BW(0,2)"

// One of kScheduleKindNames (parallel/schedule_kind.h); UserError naming `key` otherwise.
ScheduleKind parse_schedule_kind(std::string_view text, std::string_view key = "parallel.schedule");

struct Schedule {
  ScheduleKind kind = ScheduleKind::k1F1B;
  int pp = 1;
  int n_micro = 1;
  int v = 1;                               // chunks per stage
  std::vector<int> chunk_stage;            // chunk k -> stage holding it, size pp * v
  std::vector<std::vector<Action>> ranks;  // ranks[stage]: actions in execution order

  int num_chunks() const { return pp * v; }
};

// The generators. UserError (naming the recipe keys) for impossible shapes: pp, n_micro, v < 1;
// interleaved with n_micro not a multiple of pp (Megatron's requirement); ZB-V with pp = 1.
Schedule make_gpipe(int pp, int n_micro);
Schedule make_1f1b(int pp, int n_micro);
Schedule make_interleaved_1f1b(int pp, int n_micro, int v);
Schedule make_zb_h1(int pp, int n_micro);
Schedule make_zb_v(int pp, int n_micro);  // v = 2, V-shaped placement
// The placement table every schedule of `kind` carries as chunk_stage (chunk k -> stage): round
// robin, or ZB-V's V (pipeline_split.h stage_of_chunk). The planner reads it without building the
// schedule; the trainer, eval and the executor read the schedule's copy.
std::vector<int> placement(ScheduleKind kind, int pp, int v);

// Dispatch; `v` is used by the interleaved schedule, must be 2 for ZB-V and 1 for the others.
Schedule make_schedule(ScheduleKind kind, int pp, int n_micro, int v = 1);

// Peak number of micro-batch chunks whose forward has run and whose backward has not finished
// (BW, or W for split backwards: W still reads the saved layer inputs), per rank. In chunk units:
// one chunk holds 1/v of a stage's activations.
std::vector<int> peak_in_flight(const Schedule& s);

// The bound each generator promises for peak_in_flight(s)[stage]:
//   GPipe n_micro; 1F1B min(pp - stage, n_micro); interleaved
//   min(v * n_micro, 2 (pp - stage - 1) + (v - 1) pp + 1); ZB-H1 min(pp, n_micro) (the peak of
//   1F1B, over all ranks: ZB-H1 spends the slack later stages have under 1F1B); ZB-V
//   min(2 pp, 2 n_micro) chunks = min(pp, n_micro) micro-batches of a whole stage, 1F1B's peak.
int promised_in_flight(const Schedule& s, int stage);

// The messages between stages, per ordered pair (from, to): what each carries as (micro-batch,
// chunk, gradient), in the order the sender sends them (`sent`) and the receiver takes them
// (`taken`), as the executor does (F receives from the previous chunk's stage and sends to the
// next's, B and BW the other way; hand-overs within a stage are not messages).
struct PipelineMessages {
  using Message = std::tuple<int, int, bool>;
  std::map<std::pair<int, int>, std::vector<Message>> sent, taken;
};
PipelineMessages pipeline_messages(const Schedule& s);
// Whether every stage takes each other stage's messages in the order they were sent: what NCCL's
// point to point, which has no tags, needs (runtime/stage/device_comm.h). False for ZB-V, whose
// turn of the V sends a stage activations and gradients in another order than it takes them.
bool receives_in_send_order(const Schedule& s);

// Every problem found, empty when the schedule is valid: placement (each action on the rank
// holding its chunk), each F / B / W / BW present exactly once and B+W not mixed with BW, and a
// deadlock-free execution under the semantics above (found by simulation; a stall reports
// each rank's blocked action and what it waits for).
std::vector<std::string> validate(const Schedule& s);

}  // namespace t3d::parallel
