#include "runtime/train/replay.h"

#include <fmt/format.h>
#include <spdlog/spdlog.h>

#include <algorithm>
#include <chrono>
#include <cstdio>
#include <cstring>
#include <map>
#include <string>
#include <type_traits>
#include <utility>
#include <vector>

#include "checkpoint/hash.h"
#include "checkpoint/snapshot.h"
#include "kernels/check.h"
#include "kernels/ops.h"
#include "parallel/fault.h"
#include "parallel/trace.h"
#include "runtime/launch/logging.h"
#include "runtime/model/model.h"
#include "runtime/train/replay_kept.h"
#include "runtime/train/replay_update.h"
#include "runtime/train/replay_verdict.h"
#include "runtime/train/sharded_state.h"
#include "runtime/train/snapshots.h"

namespace t3d::runtime {

using parallel::Dim;
using parallel::fault::Flip;
using Clock = std::chrono::steady_clock;
using Finding = ReplayFinding;
using Verdict = ReplayVerdict;

namespace {

// The own pass's model on a T3D_FAULT=flip:...:act step: after the first training forward of its
// first chunk, a bit of that chunk's stored input (what its backward reads again) flips once.
class ActFlipStage final : public StageModel {
 public:
  explicit ActFlipStage(Model& model) : m_(model) {}
  void arm() { armed_ = true; }

  const std::vector<parallel::LayerRange>& chunks() const override { return m_.chunks(); }
  int64_t io_floats() const override { return m_.io_floats(); }
  const kernels::Exec& exec() const override { return m_.exec(); }
  void forward(int chunk, int slot, const int32_t* tokens, const int32_t* targets, float grad_scale,
               bool training) override {
    m_.forward(chunk, slot, tokens, targets, grad_scale, training);
    if (armed_ && training && chunk == 0) {
      kernels::flip_bit(m_.exec(), m_.input(chunk, slot), 0, parallel::fault::kFlipBit);
      armed_ = false;
    }
  }
  double take_loss_sum() override { return m_.take_loss_sum(); }
  void backward(int chunk, int slot, const float* dout) override { m_.backward(chunk, slot, dout); }
  void backward_input(int chunk, int slot, const float* dout) override {
    m_.backward_input(chunk, slot, dout);
  }
  void backward_weight(int chunk, int slot) override { m_.backward_weight(chunk, slot); }
  float* input(int chunk, int slot) override { return m_.input(chunk, slot); }
  const float* output(int chunk, int slot) const override { return m_.output(chunk, slot); }
  const float* input_grad(int chunk, int slot) const override { return m_.input_grad(chunk, slot); }

 private:
  Model& m_;
  bool armed_ = false;
};

// Impl::unit. The recipe's validation allows expert parallelism when ep divides dp (an EP group
// is ep consecutive dp coordinates of one cp rank) or dp divides ep (it holds every one).
int replay_unit(const parallel::MeshShape& shape) {
  const int dp = shape.size(Dim::dp), ep = shape.ep();
  if (ep <= 1) return 1;
  return dp % ep == 0 ? ep : dp;
}

}  // namespace

struct Replay::Impl {
  const Job& job;
  const parallel::Mesh& mesh;
  Model& model;
  TrainingState& state;
  Snapshotter& snapshots;
  const parallel::Comm& dp_group;  // same pp, tp, cp coordinates; group rank = dp coordinate
  const int dp, me;
  // dp coordinates that replay together: an EP group's (parallel.ep dividing dp), all of them
  // (an EP group holding every dp coordinate: each replays itself), else 1.
  const int unit;
  const int64_t every;
  const int micro;
  bool params_comparable = true;          // no group keeps a ZeRO-3 shard
  int64_t clean_through = 0;              // the last step whose checks passed (or the resumed step)
  std::vector<uint64_t>* sink = nullptr;  // where the taps append a bucket's hash
  std::vector<uint64_t> own, replayed, again;
  std::vector<uint64_t> replayed_by;  // this rank's share's hashes as its replayer computed them
  std::vector<std::pair<uint64_t, uint64_t>> where;  // (group, bucket) of each own reduction
  double seconds = 0;
  Flip flip = Flip::none;
  ActFlipStage act;
  std::unique_ptr<KeptParams> kept;     // replay on: the parameters only this rank keeps
  std::unique_ptr<UpdateCheck> update;  // replay on: peers recompute ZeRO owners' updates

  Impl(const Job& j, Model& m, TrainingState& s, Snapshotter& snap, kernels::Arena& arena,
       int64_t first_step)
      : job(j),
        mesh(*j.mesh),
        model(m),
        state(s),
        snapshots(snap),
        dp_group(j.mesh->group(Dim::dp)),
        dp(dp_group.size()),
        me(dp_group.rank()),
        unit(replay_unit(j.mesh->shape())),
        every(j.recipe.run.replay_every),
        micro(static_cast<int>(j.recipe.train.micro_batches)),
        clean_through(first_step),
        act(m) {
    if (every == 0) return;  // no taps: the step runs as without replay
    kept = std::make_unique<KeptParams>(state, static_cast<int>(j.recipe.parallel.zero));
    update =
        std::make_unique<UpdateCheck>(mesh, state, static_cast<int>(j.recipe.parallel.zero), arena);
    const auto& groups = state.groups();
    for (size_t g = 0; g < groups.size(); ++g) {
      if (groups[g]->param_store().sharded) params_comparable = false;
      groups[g]->set_tap([this, g](int b, const float* data, int64_t n) { tap(g, b, data, n); });
    }
    if (mesh.rank() != 0) return;
    spdlog::info(
        "replay: every {} steps each data-parallel replica replays a peer's share of the step and "
        "compares gradient hashes{}",
        every,
        params_comparable ? ", and the replicas compare parameter hashes"
                          : "; parallel.zero = 3 keeps no parameters two replicas share, so "
                            "parameter hashes are not compared");
    if (kept->active())
      spdlog::info(
          "replay: the parameters no replica comparison covers (a ZeRO stage's, or a "
          "replica's of one rank) are hashed after every update and before the next");
    if (update->active())
      spdlog::info(
          "replay: at each check a peer recomputes each ZeRO owner's optimizer update from its "
          "inputs (two peers where the state group has three ranks or more)");
    if (dp == unit)
      spdlog::warn(
          "replay: {}: no other replica holds these parameters, so each replica "
          "replays its own step; this catches transient faults only, not a rank that is "
          "persistently wrong",
          dp == 1 ? std::string("parallel.dp = 1")
                  : fmt::format("one expert-parallel group (parallel.ep = {}) spans every replica "
                                "(parallel.dp = {})",
                                mesh.shape().ep(), dp));
  }

  ~Impl() {
    for (const auto& g : state.groups()) g->set_tap({});
  }

  bool due(int64_t step) const { return every > 0 && step % every == 0; }
  // Replica d replays replica (d + shift) mod dp at the check of `step`: whole EP groups (unit
  // dp coordinates each) replay whole EP groups, so their all-to-alls assemble the same tokens.
  int shift(int64_t step) const {
    const int replicas = dp / unit;
    return replicas == 1 ? 0 : unit * (1 + static_cast<int>((step / every - 1) % (replicas - 1)));
  }

  void tap(size_t g, int b, const float* data, int64_t n) {
    if (!sink) return;
    const auto t0 = Clock::now();
    checkpoint::Hash64Stream h;
    kernels::hash_floats(model.exec(), h, data, n);
    sink->push_back(h.value());
    if (sink != &own) return;  // a replayed pass: timed whole by begin_step
    where.push_back({g, static_cast<uint64_t>(b)});
    seconds += seconds_since(t0);  // the own pass's hashing is the replay's cost too
  }

  // A pass over replica `replica`'s share, reduced nowhere, its buckets' hashes into `into`.
  void run_local(const Pass& pass, int replica, std::vector<uint64_t>& into) {
    parallel::trace::Span span("replay", "train");
    into.clear();
    sink = &into;
    state.begin_step(micro, /*local=*/true);
    pass(replica);
    state.finish_step();
    sink = nullptr;
    // A mixture of experts counts the routing of its training forwards (RouterBalance reads the
    // counts after the step for the load and the bias step): the step's own pass alone counts.
    model.reset_moe_stats();
  }

  void flip_param() {
    // The middle of the dense store: inside a block's weights, which every forward reads (the
    // first element, token 0's embedding, may never be read).
    const ShardedState::Store s = state.dense().param_store();
    const parallel::FloatRange& r = s.ranges.front();
    float* x = s.sharded ? s.data + s.floats / 2 : s.data + r.begin + r.size() / 2;
    // After the previous step's snapshot copies (on a GPU they may still run): the flip belongs
    // to this step, as on the CPU, where they are done.
    kernels::compute_after_copies(model.exec());
    kernels::flip_bit(model.exec(), x, 0, parallel::fault::kFlipBit);
  }

  void begin_step(int64_t step, const Pass& pass) {
    seconds = 0;
    flip = parallel::fault::flip_at(mesh.rank(), static_cast<long>(step));
    if (flip == Flip::param) flip_param();
    if (due(step)) {
      const auto t0 = Clock::now();
      run_local(pass, (me + shift(step)) % dp, replayed);
      own.clear();
      where.clear();
      sink = &own;
      seconds += seconds_since(t0);
    }
    // Armed after the replay: the fault hits the step's own pass only.
    if (flip == Flip::grad) state.dense().arm_grad_flip(parallel::fault::kFlipBit);
    if (flip == Flip::act) act.arm();
    if (flip == Flip::update) state.dense().arm_update_flip(parallel::fault::kFlipBit);
  }

  void before_update(int64_t step, double lr, float grad_scale) {
    if (!due(step) || !update->active()) return;
    const auto t0 = Clock::now();
    parallel::trace::Span span("replay update", "train");
    update->recompute(step / every, job.recipe.train, lr, step, grad_scale);
    seconds += seconds_since(t0);
  }

  // Each state group's parameter region, hashed.
  std::vector<uint64_t> param_hashes() {
    std::vector<uint64_t> out;
    for (const auto& g : state.groups()) {
      const ShardedState::Store s = g->param_store();
      checkpoint::Hash64Stream h;
      for (const auto& r : s.ranges)
        kernels::hash_floats(model.exec(), h, s.data + r.begin, r.size());
      out.push_back(h.value());
    }
    return out;
  }

  // The parameter hashes of this rank's dp group, per state group among the ranks that hold the
  // same part (the dense one: every replica; the experts: the same dp coordinate mod ep): is this
  // rank's the majority's in each?
  void judge_params(Finding& f) {
    if (!params_comparable) {
      f.params = kParamsNotCompared;
      return;
    }
    const std::vector<uint64_t> mine = param_hashes();
    const size_t groups = mine.size();
    std::vector<uint64_t> all(groups * static_cast<size_t>(dp));
    dp_group.all_gather(mine.data(), all.data(), groups);
    const int ep = mesh.shape().ep();
    f.params = kParamsAgree;
    f.param_hash = mine[0];
    for (size_t g = 0; g < groups; ++g) {
      std::map<uint64_t, int> votes;
      for (int d = 0; d < dp; ++d)
        if (g == 0 || d % ep == me % ep) ++votes[all[static_cast<size_t>(d) * groups + g]];
      int top = 0, tops = 0;
      for (const auto& [h, n] : votes) top = std::max(top, n);
      for (const auto& [h, n] : votes) tops += n == top;
      if (votes.size() == 1 || (tops == 1 && votes[mine[g]] == top)) continue;
      const uint64_t verdict = tops == 1 ? kParamsMinority : kParamsUnsettled;
      if (f.params == kParamsAgree || verdict == kParamsMinority)
        f.params = verdict, f.param_hash = mine[g];
    }
  }

  // Every step with replay on: the parameters KeptParams watches, before the update reads them;
  // a change is reported at the next check (or at the run's last step).
  void verify_kept(int64_t step, Finding& f) {
    if (!kept || !kept->active()) return;
    const auto t0 = Clock::now();
    kept->verify(step);
    const KeptParams::Change& c = kept->change();
    f.at_rest = static_cast<uint64_t>(c.step);
    f.rest_group = c.group, f.rest_kept = c.kept, f.rest_found = c.found;
    seconds += seconds_since(t0);
  }

  void check_gradients(int64_t step, const Pass& pass) {
    Finding f;
    verify_kept(step, f);
    // Every rank alike (a stage without experts may watch nothing): the collective below runs at
    // every check and at the run's last step.
    const bool last = every > 0 && step == job.recipe.train.steps;
    if (!due(step) && !last) return;
    const auto t0 = Clock::now();
    sink = nullptr;
    const size_t n = due(step) ? own.size() : 0;
    if (due(step)) compare_gradients(step, f);
    int bad[2] = {f.differing > 0 ? 1 : 0, f.at_rest > 0 ? 1 : 0};
    mesh.world().all_reduce(bad, 2, parallel::ReduceOp::max);
    if (bad[0] == 0 && bad[1] == 0) {
      seconds += seconds_since(t0);
      return;
    }
    if (bad[0] != 0) {
      // Settle: every replica computes its own share once more (collective, like the replay).
      run_local(pass, me, again);
      T3D_ASSERT(again.size() == n, "the recomputation made ", again.size(), " reductions, not ",
                 n);
      if (f.differing > 0) {
        const uint64_t* theirs = replayed_by.data();
        const bool like_replayer = std::equal(again.begin(), again.end(), theirs);
        f.verdict = like_replayer ? kTransient : again == own ? kDisagrees : kUnstable;
      }
    }
    judge_params(f);
    stop(step, f, bad[0] != 0 ? "gradients" : "parameters at rest");
  }

  // This rank's own bucket hashes against its replayer's (one all-gather over the dp group).
  void compare_gradients(int64_t step, Finding& f) {
    const size_t n = own.size();
    T3D_ASSERT(replayed.size() == n && where.size() == n, "the replay made ", replayed.size(),
               " reductions, the step's own pass ", n);
    std::vector<uint64_t> all_replayed(n * static_cast<size_t>(dp));
    dp_group.all_gather(replayed.data(), all_replayed.data(), n);
    const int replayer = (me - shift(step) + dp) % dp;
    const uint64_t* theirs = all_replayed.data() + static_cast<size_t>(replayer) * n;
    replayed_by.assign(theirs, theirs + n);
    f.replayer = static_cast<uint64_t>(dp_group.world_ranks().at(static_cast<size_t>(replayer)));
    f.reductions = n;
    for (size_t i = 0; i < n; ++i) {
      if (own[i] == theirs[i] || f.differing++ > 0) continue;
      f.first = i, f.group = where[i].first, f.bucket = where[i].second;
      f.own = own[i], f.replayed = theirs[i];
    }
  }

  void check_parameters(int64_t step) {
    if (kept) {
      const auto t0 = Clock::now();
      kept->updated();
      seconds += seconds_since(t0);
    }
    if (!due(step)) return;
    const auto t0 = Clock::now();
    Finding f;
    f.update = update->compare();
    judge_params(f);
    int bad[2] = {f.params == kParamsMinority || f.params == kParamsUnsettled ? 1 : 0,
                  f.update.verdict != UpdateCheck::Finding::kAgrees ? 1 : 0};
    mesh.world().all_reduce(bad, 2, parallel::ReduceOp::max);
    seconds += seconds_since(t0);
    if (bad[0] == 0 && bad[1] == 0) {
      clean_through = step;
      return;
    }
    stop(step, f, bad[1] != 0 ? "update" : "parameters");
  }

  [[noreturn]] void stop(int64_t step, const Finding& mine, const char* check);
  std::string rank_name(size_t r) const {
    return fmt::format("rank {} {} on host {}", r, mesh.shape().label(static_cast<int>(r)),
                       job.hosts.at(r));
  }
  void set_aside_unverified(int64_t step) const;
  void report(int64_t step, const char* check, const std::vector<Finding>& all,
              const Verdict& v) const;
};

// Rank 0: the committed snapshots after the last passed check may hold the corruption (a flip
// lands up to replay_every steps before it is seen); they move to snapshot.dir/unverified-step-N,
// so that `resume latest` and snapshot.keep see only verified ones. A failure to move them is
// said, not fatal: the account names the step to resume from either way.
void Replay::Impl::set_aside_unverified(int64_t step) const {
  const std::string& dir = job.recipe.snapshot.dir;
  if (job.recipe.snapshot.every <= 0) return;
  std::vector<int64_t> later;
  for (const int64_t s : checkpoint::committed_steps(dir))
    if (s > clean_through) later.push_back(s);
  if (later.empty()) return;
  const std::string into = dir + "/unverified-step-" + std::to_string(step);
  try {
    checkpoint::set_aside(dir, later, into);
    spdlog::warn("the snapshots after the last passed check (steps {}) moved to {}: not verified",
                 fmt::join(later, ", "), into);
  } catch (const UserError& e) {
    spdlog::error("the snapshots after the last passed check (steps {}) could not be set aside: {}",
                  fmt::join(later, ", "), e.what());
  }
}

// Rank 0's account: the log, stderr (as agree_on prints a failure) and incidents.jsonl.
void Replay::Impl::report(int64_t step, const char* check, const std::vector<Finding>& all,
                          const Verdict& v) const {
  std::string names, details, ranks, hosts;
  for (size_t r : v.named) {
    names += (names.empty() ? "" : " and ") + rank_name(r);
    details += replay_detail(all, r);
    ranks += (ranks.empty() ? "" : ", ") + std::to_string(r);
    hosts += (hosts.empty() ? "" : ", ") + parallel::trace::json_string(job.hosts.at(r));
  }
  // run.on_corruption = exclude: the host of the culprit, or of every candidate when they share
  // one (runtime/supervise/exclude.h reads it from incidents.jsonl).
  const size_t first = v.named.front();
  const bool one_host = std::all_of(v.named.begin(), v.named.end(), [&](size_t r) {
    return job.hosts.at(r) == job.hosts.at(first);
  });
  const bool exclude = job.recipe.run.on_corruption == OnCorruption::kExclude && one_host;
  const std::string action =
      exclude
          ? fmt::format(
                "run.on_corruption = exclude: step {} is not applied; the last check "
                "passed at step {}: {} without host {} from the newest snapshot at or "
                "before it{}",
                step, clean_through,
                job.env.job_id.empty() ? "a self-launched job on several hosts continues"
                                       : "scripts/slurm/train.sbatch submits this SLURM job again",
                job.hosts.at(first), job.env.job_id.empty() ? " (any other stops here)" : "")
          : fmt::format(
                "run.on_corruption = stop{}: step {} is not applied; the last check "
                "passed at step {}: resume from the newest snapshot at or before it "
                "(later ones are not verified)",
                one_host ? "" : " (exclude: the candidates are on different hosts)", step,
                clean_through);
  const std::string text = fmt::format(
      "silent data corruption at step {} ({} check){}{}: {}{}{}. {} (exit {})", step, check,
      v.settled ? ": " : ", not settled: candidates ", names, v.why,
      !v.settled && dp == 2 ? "; with dp = 2 no third replica can say which is wrong" : "", details,
      action, kExitCorruption);
  spdlog::error("{}", text);
  std::fprintf(stderr, "titan3d: %s\n", text.c_str());
  std::fflush(stderr);
  const Finding& f = all.at(first);
  const std::string what = replay_detail(all, v.named.front());  // "; rank R: ..." or empty
  append_incident(
      job.run_dir,
      fmt::format("\"event\": \"corruption\", \"step\": {}, \"check\": \"{}\", \"settled\": "
                  "{}, \"rank\": {}, \"host\": {}, \"ranks\": [{}], \"hosts\": [{}], "
                  "\"bucket\": {}, \"hash\": \"{}\", \"replayed_hash\": \"{}\", "
                  "\"replayed_by\": {}, \"param_hash\": \"{}\", \"what\": {}, "
                  "\"verified_step\": {}, \"action\": \"{}\", \"exclude_host\": {}, "
                  "\"exclude_rank\": {}, \"exit_code\": {}",
                  step, check, v.settled ? "true" : "false",
                  v.settled ? std::to_string(v.named.front()) : "-1",
                  v.settled ? parallel::trace::json_string(job.hosts.at(v.named.front())) : "null",
                  ranks, hosts, f.differing ? std::to_string(f.bucket) : "null",
                  checkpoint::to_hex(f.own), checkpoint::to_hex(f.replayed),
                  f.differing ? std::to_string(f.replayer) : "null",
                  checkpoint::to_hex(f.param_hash),
                  parallel::trace::json_string(what.size() > 2 ? what.substr(2) : what),
                  clean_through, exclude ? "exclude" : "stop",
                  exclude ? parallel::trace::json_string(job.hosts.at(first)) : "null",
                  exclude ? static_cast<int>(first) : -1, kExitCorruption));
}

void Replay::Impl::stop(int64_t step, const Finding& mine, const char* check) {
  const int world = mesh.world().size();
  std::vector<uint64_t> words(kFindingWords * static_cast<size_t>(world));
  mesh.world().all_gather(reinterpret_cast<const uint64_t*>(&mine), words.data(), kFindingWords);
  std::vector<Finding> all(static_cast<size_t>(world));
  std::memcpy(static_cast<void*>(all.data()), words.data(), words.size() * sizeof(uint64_t));
  const std::string here = replay_detail(all, static_cast<size_t>(mesh.rank()));
  if (!here.empty()) spdlog::warn("replay at step {} ({} check): {}", step, check, here.substr(2));
  Verdict v = judge_replay(all, mesh.shape(), dp);
  if (v.named.empty()) {  // not expected: then name every rank whose hashes differ
    for (size_t r = 0; r < all.size(); ++r)
      if (!replay_detail(all, r).empty()) v.named.push_back(r);
    v.why = "hashes that differ";
  }
  T3D_ASSERT(!v.named.empty(), "a replay mismatch with no rank to name");
  // The snapshots in flight are of earlier steps: they commit; this step is never snapshotted.
  snapshots.finish();
  mesh.world().barrier();  // every rank's commits (the index and `latest`) are done
  if (mesh.rank() == 0) {
    set_aside_unverified(step);
    report(step, check, all, v);
  }
  mesh.world().barrier();  // the account is out before any rank exits
  throw AgreedFailure{kExitCorruption};
}

Replay::Replay(const Job& job, Model& model, TrainingState& state, Snapshotter& snapshots,
               kernels::Arena& arena, int64_t first_step)
    : impl_(std::make_unique<Impl>(job, model, state, snapshots, arena, first_step)) {}
Replay::~Replay() = default;
void Replay::begin_step(int64_t step, const Pass& pass) { impl_->begin_step(step, pass); }
StageModel& Replay::stage() {
  if (impl_->flip == Flip::act) return impl_->act;
  return impl_->model;
}
void Replay::check_gradients(int64_t step, const Pass& pass) { impl_->check_gradients(step, pass); }
void Replay::before_update(int64_t step, double lr, float grad_scale) {
  impl_->before_update(step, lr, grad_scale);
}
void Replay::check_parameters(int64_t step) { impl_->check_parameters(step); }
double Replay::seconds() const { return impl_->seconds; }

}  // namespace t3d::runtime
