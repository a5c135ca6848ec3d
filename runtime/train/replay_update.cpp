#include "runtime/train/replay_update.h"

#include <algorithm>

#include "checkpoint/hash.h"
#include "kernels/ops.h"
#include "runtime/train/sharded_state.h"

namespace t3d::runtime {

namespace {
constexpr int kUpdateTag = 7043;  // the inputs of an update, owner to checker, in chunk order
constexpr int kArrays = 4;        // parameters, gradients, first and second moments
}  // namespace

UpdateCheck::UpdateCheck(const parallel::Mesh& mesh, TrainingState& state, int zero,
                         kernels::Arena& arena)
    : mesh_(mesh), state_(state) {
  if (zero < 1) return;
  const auto& groups = state.groups();
  for (size_t i = 0; i < groups.size(); ++i) {
    const parallel::Comm& comm =
        groups[i]->kind() == StateGroup::kDense ? mesh.dp_cp() : mesh.edp();
    T3D_ASSERT(comm.size() == groups[i]->group_size(), "the state group of ",
               groups[i]->group_size(), " ranks is not its mesh group of ", comm.size());
    if (comm.size() < 2) continue;
    Group g;
    g.index = i, g.comm = &comm, g.n = comm.size(), g.me = comm.rank();
    g.paired.assign(static_cast<size_t>(g.n), false);
    checked_.push_back(g);
  }
  if (checked_.empty()) return;
  send_ = arena.alloc_floats("replay update check (sent)", kArrays * kChunkFloats);
  recv_ = arena.alloc_floats("replay update check (received)", kArrays * kChunkFloats);
}

UpdateCheck::~UpdateCheck() = default;

UpdateCheck::Plan UpdateCheck::plan_of(const Group& g, int group_rank) const {
  const ShardedState& st = *state_.groups()[g.index];
  const std::vector<parallel::FloatRange> ranges =
      group_rank == g.me ? st.partition() : st.partition_of(group_rank);
  Plan plan;
  int64_t chunk = 0, used = 0;
  st.for_each_piece(ranges, [&](const ShardedState::Piece& p) {
    if (!st.updates(p)) return;
    for (int64_t o = 0; o < p.size();) {
      if (used == kChunkFloats) plan.chunk_floats.push_back(used), ++chunk, used = 0;
      const int64_t n = std::min(p.size() - o, kChunkFloats - used);
      plan.segments.push_back({p.param, p.lo + o, n, p.at + o, chunk, used});
      used += n, o += n;
    }
  });
  if (used > 0) plan.chunk_floats.push_back(used);
  return plan;
}

void UpdateCheck::pack(const ShardedState& st, const Plan& plan, size_t& i, int64_t chunk,
                       bool grads) {
  const kernels::Exec& exec = state_.exec();
  const int64_t n = plan.chunk_floats[static_cast<size_t>(chunk)];
  for (; i < plan.segments.size() && plan.segments[i].chunk == chunk; ++i) {
    const Segment& s = plan.segments[i];
    const ShardedState::Piece p{s.param, s.lo, s.lo + s.n, s.at};
    kernels::copy(exec, send_ + s.offset, st.params(p), s.n);
    if (grads) kernels::copy(exec, send_ + n + s.offset, st.grads(p), s.n);
    kernels::copy(exec, send_ + 2 * n + s.offset, st.exp_avg(p), s.n);
    kernels::copy(exec, send_ + 3 * n + s.offset, st.exp_avg_sq(p), s.n);
  }
}

void UpdateCheck::recompute(int64_t check, const TrainConfig& t, double lr, int64_t step,
                            float grad_scale) {
  for (Group& g : checked_) {
    g.shifts[0] = 1 + static_cast<int>((check - 1) % (g.n - 1));
    g.shifts[1] = g.n >= 3 ? 1 + static_cast<int>(check % (g.n - 1)) : 0;
    for (size_t slot = 0; slot < 2; ++slot)
      if (g.shifts[slot] != 0) stream(g, g.shifts[slot], slot, t, lr, step, grad_scale);
  }
  pending_ = true;
}

// Sends this rank's inputs to the rank that checks it (me − shift) and recomputes the update of
// the rank it checks (me + shift), one chunk at a time: [parameters | gradients | m | v], each
// chunk_floats long, in one message.
void UpdateCheck::stream(Group& g, int shift, size_t slot, const TrainConfig& t, double lr,
                         int64_t step, float grad_scale) {
  const ShardedState& st = *state_.groups()[g.index];
  const kernels::Exec& exec = state_.exec();
  const parallel::TensorComm& comm = st.group();
  const int owner = (g.me + shift) % g.n, checker = (g.me - shift + g.n) % g.n;
  if (!g.paired[static_cast<size_t>(shift)]) {  // every rank of the group at once, this shift
    comm.prepare_pairs({checker}, {owner});     // each sends before it receives: see there
    g.paired[static_cast<size_t>(shift)] = true;
  }
  const Plan mine = plan_of(g, g.me), theirs = plan_of(g, owner);
  const auto chunks = std::max(mine.chunk_floats.size(), theirs.chunk_floats.size());
  checkpoint::Hash64Stream h;
  size_t im = 0, it = 0;
  for (size_t c = 0; c < chunks; ++c) {
    parallel::Request sent;
    if (c < mine.chunk_floats.size()) {
      const int64_t n = mine.chunk_floats[c];
      pack(st, mine, im, static_cast<int64_t>(c), /*grads=*/true);
      sent = comm.isend(send_, static_cast<size_t>(kArrays * n), checker, kUpdateTag);
    }
    if (c < theirs.chunk_floats.size()) {
      const int64_t n = theirs.chunk_floats[c];
      comm.recv(recv_, static_cast<size_t>(kArrays * n), owner, kUpdateTag);
      for (; it < theirs.segments.size() && theirs.segments[it].chunk == static_cast<int64_t>(c);
           ++it) {
        const Segment& s = theirs.segments[it];
        const ShardedState::Piece p{s.param, s.lo, s.lo + s.n, s.at};
        float* at = recv_ + s.offset;
        kernels::adamw_step(exec, at, at + n, at + 2 * n, at + 3 * n, s.n,
                            st.adamw_config(t, lr, grad_scale, p), step);
      }
      kernels::hash_floats(exec, h, recv_, n);
      kernels::hash_floats(exec, h, recv_ + 2 * n, n);
      kernels::hash_floats(exec, h, recv_ + 3 * n, n);
    }
    if (c < mine.chunk_floats.size()) comm.wait(sent, "replay: an update's inputs", checker);
  }
  g.recomputed[slot] = h.value();
}

uint64_t UpdateCheck::own_hash(const Group& g) {
  const ShardedState& st = *state_.groups()[g.index];
  const kernels::Exec& exec = state_.exec();
  const Plan mine = plan_of(g, g.me);
  checkpoint::Hash64Stream h;
  size_t i = 0;
  for (size_t c = 0; c < mine.chunk_floats.size(); ++c) {
    const int64_t n = mine.chunk_floats[c];
    pack(st, mine, i, static_cast<int64_t>(c), /*grads=*/false);
    kernels::hash_floats(exec, h, send_, n);
    kernels::hash_floats(exec, h, send_ + 2 * n, n);
    kernels::hash_floats(exec, h, send_ + 3 * n, n);
  }
  return h.value();
}

UpdateCheck::Finding UpdateCheck::compare() {
  Finding f;
  if (!pending_) return f;
  pending_ = false;
  const auto note = [&](uint64_t verdict, const Group& g, uint64_t hash, uint64_t other,
                        int other_rank, bool recomputed) {
    const bool stronger = f.verdict == Finding::kAgrees ||
                          (f.verdict == Finding::kUnsettled && verdict != Finding::kUnsettled);
    if (!stronger) return;
    f = {verdict,
         static_cast<uint64_t>(g.index),
         hash,
         other,
         static_cast<uint64_t>(g.comm->world_ranks().at(static_cast<size_t>(other_rank))),
         recomputed ? 1u : 0u};
  };
  for (const Group& g : checked_) {
    // Per group rank: its own update's hash, then its recomputations (shift slots 0 and 1).
    const uint64_t words[3] = {own_hash(g), g.recomputed[0], g.recomputed[1]};
    std::vector<uint64_t> all(3 * static_cast<size_t>(g.n));
    g.comm->all_gather(words, all.data(), 3);
    const auto own = [&](int r) { return all[3 * static_cast<size_t>(r)]; };
    const auto by = [&](int checker, size_t slot) {  // checker's recomputation in `slot`
      return all[3 * static_cast<size_t>(checker) + 1 + slot];
    };
    const auto checker_of = [&](int r, size_t slot) { return (r - g.shifts[slot] + g.n) % g.n; };
    const bool two = g.shifts[1] != 0;
    // This rank as an owner.
    const int k0 = checker_of(g.me, 0), k1 = two ? checker_of(g.me, 1) : -1;
    const uint64_t a = by(k0, 0), b = two ? by(k1, 1) : a, mine = own(g.me);
    if (a != mine || b != mine) {
      if (!two)
        note(Finding::kUnsettled, g, mine, a, k0, false);
      else if (a == b)
        note(Finding::kWrongUpdate, g, mine, a, k0, false);
      else if (a != mine && b != mine)
        note(Finding::kUnsettled, g, mine, a, k0, false);
    }
    // This rank as a checker, of the owner of each slot.
    for (size_t slot = 0; slot < (two ? 2u : 1u); ++slot) {
      const int o = (g.me + g.shifts[slot]) % g.n;
      const uint64_t r = g.recomputed[slot];
      if (r == own(o)) continue;
      if (!two) {
        note(Finding::kUnsettled, g, r, own(o), o, true);
        continue;
      }
      const uint64_t other = by(checker_of(o, 1 - slot), 1 - slot);
      if (other == own(o))
        note(Finding::kWrongRecomputation, g, r, own(o), o, true);
      else if (other != r)
        note(Finding::kUnsettled, g, r, own(o), o, true);
    }
  }
  return f;
}

}  // namespace t3d::runtime
