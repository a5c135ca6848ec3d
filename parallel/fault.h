// Test-only fault injection for the communicator, read once from the environment variable
// T3D_FAULT. It exists so tests can prove that the watchdog and `titan3d selfcheck` name the
// culprit; nothing in a real run sets it, and with it unset every hook is one predictable branch.
//
//   T3D_FAULT=skip:RANK:GROUP:N     world rank RANK returns from its N-th operation (1-based:
//                                   collective, send or receive) on group GROUP without taking
//                                   part, as a rank with a bug that misses a collective would
//   T3D_FAULT=die:RANK:GROUP:N      ... SIGKILLs itself at that operation instead (a crashed rank)
//   T3D_FAULT=corrupt:RANK          RANK's contributions to floating-point sum all-reduces, and
//                                   the float rows it sends by all_to_allv, arrive doubled (one
//                                   flipped exponent bit per element: bad memory or a bad link)
//   T3D_FAULT=nosend:RANK           RANK's point-to-point sends are dropped (a rank that never
//                                   sends)
//   T3D_FAULT=die_at_step:RANK:K    RANK SIGKILLs itself when training step K starts, in every
//                                   run that reaches it (a deterministic crash)
//   T3D_FAULT=slow_step:RANK:MS     RANK sleeps MS milliseconds at the start of every training
//                                   step (a step longer than a stop's time limit)
//   T3D_FAULT=slow_link:A:B:MS      every point-to-point send between world ranks A and B (either
//                                   way) waits MS milliseconds first (a slow link of one pair)
//   T3D_FAULT=flip:RANK:STEP:WHAT   at training step STEP, RANK flips bit kFlipBit of one element
//                                   (silent data corruption, caught by run.replay_every:
//                                   docs/resilience.md, Replay) of WHAT: `grad` its local gradient,
//                                   the middle of the first bucket reduced, before the reduction;
//                                   `param` its parameters (ZeRO-3: its shard), the middle of the
//                                   dense ones, as the step starts; `act` a stored activation, the
//                                   first element of the input its first chunk keeps for the
//                                   backward of the first micro-batch, right after that forward.
//                                   `update` a parameter its AdamW update wrote (the middle of the
//                                   first piece it updates), before the all-gather hands it on (an
//                                   owner's wrong arithmetic).
//                                   Only the step's own pass, never its replay (a transient fault)
//
// GROUP is a group name (tp, dp, cp, pp, dp_cp, ep, edp, world) or `*` for any. A malformed value
// is a UserError.
#pragma once

#include <mpi.h>

#include <cstddef>
#include <string>

namespace t3d::parallel::fault {

namespace detail {
bool active();  // T3D_FAULT is set (parsed on first use)
bool before_operation(const std::string& group, int world_rank);
bool corrupts(int world_rank);
void corrupt_sum(void* data, size_t count, MPI_Datatype type, int world_rank);
bool drop_send(int world_rank);
void delay_send(int from_world_rank, int to_world_rank);
void at_step(int world_rank, long step);
}  // namespace detail

// What T3D_FAULT=flip:RANK:STEP:WHAT flips.
enum class Flip { none, grad, param, act, update };
// The bit a flip toggles: the highest mantissa bit, so a normal value changes by a factor between
// 0.75 and 1.5 and stays finite (the divergence checks do not see it; only a replay does).
inline constexpr int kFlipBit = 22;
// What this rank flips at training step `step` (1-based), if anything. Logs a warning when it does.
Flip flip_at(int world_rank, long step);

// Before each operation on `group`: true means "skip it"; may not return at all (die).
inline bool skip_operation(const std::string& group, int world_rank) {
  return detail::active() && detail::before_operation(group, world_rank);
}
// Before a sum all-reduce's contribution leaves this rank.
inline void corrupt_contribution(void* data, size_t count, MPI_Datatype type, int world_rank) {
  if (detail::active()) detail::corrupt_sum(data, count, type, world_rank);
}
// Does this rank corrupt what it sends (corrupt:RANK)? Callers with a const send buffer corrupt a
// copy.
inline bool corrupts(int world_rank) { return detail::active() && detail::corrupts(world_rank); }
inline bool drop_send(int world_rank) { return detail::active() && detail::drop_send(world_rank); }
// Before a point-to-point send leaves this rank for `to`; may sleep (slow_link).
inline void delay_send(int from_world_rank, int to_world_rank) {
  if (detail::active()) detail::delay_send(from_world_rank, to_world_rank);
}
// When training step `step` (1-based) starts; may not return (die_at_step), may sleep
// (slow_step).
inline void step_starts(int world_rank, long step) {
  if (detail::active()) detail::at_step(world_rank, step);
}

}  // namespace t3d::parallel::fault
