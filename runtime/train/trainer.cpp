// The step loop of one rank. One file (under 600 lines) on purpose: every phase of a step
// (sampling, the executor, reduction, norm and clipping, AdamW, validation, divergence handling,
// metrics) reads the same Trainer::Impl state; the parts that stand alone live beside it
// (sharded_state, metrics, snapshots, stop_signal, training_math).
#include "runtime/train/trainer.h"

#include <spdlog/spdlog.h>

#include <algorithm>
#include <chrono>
#include <cmath>
#include <optional>
#include <thread>

#include "kernels/arena.h"
#include "kernels/blas.h"
#include "kernels/check.h"
#include "kernels/gemm.h"
#include "kernels/ops.h"
#include "kernels/ops_moe.h"
#include "parallel/fault.h"
#include "parallel/trace.h"
#include "parallel/zero.h"
#include "runtime/data/data.h"
#include "runtime/data/data_sampler.h"
#include "runtime/launch/logging.h"
#include "runtime/launch/stop_signal.h"
#include "runtime/machine/gemm_choice.h"
#include "runtime/model/model.h"
#include "runtime/stage/executor.h"
#include "runtime/stage/stage.h"
#include "runtime/train/gpu_op_times.h"
#include "runtime/train/metrics.h"
#include "runtime/train/replay.h"
#include "runtime/train/router_balance.h"
#include "runtime/train/sharded_state.h"
#include "runtime/train/snapshots.h"
#include "runtime/train/training_math.h"

namespace t3d::runtime {

using parallel::Dim;
using Clock = std::chrono::steady_clock;

namespace {

// Divergence (docs/recipe.md, train.dynamic_loss_scale): a mean loss above kDivergedLossFactor ·
// ln(vocab_size) counts as diverged like a non-finite one. ln(vocab) is the loss of a uniform
// guess; a hundred times that means logits hundreds of nats apart, which no learning run reaches.
constexpr double kDivergedLossFactor = 100.0;
// With train.dynamic_loss_scale, this many diverged steps in a row end the run (exit 2).
constexpr int64_t kMaxConsecutiveSkips = 8;

// A model part's name in messages: -1 the embedding, n_layers the final norm and LM head.
std::string unit_name(int64_t unit, int64_t n_layers) {
  if (unit < 0) return "model.embed_tokens";
  if (unit >= n_layers) return "model.norm / lm_head";
  return "model.layers." + std::to_string(unit);
}

// The stop signals of a step, agreed over the ranks (runtime/launch/stop_signal.h): an interrupt
// on any rank makes the stop an interrupt (the user stopped the run: no requeue).
struct StopSignals {
  int ranks = 0;  // ranks a stop signal reached
  bool interrupted = false;
  std::string cause() const {
    return interrupted ? "interrupted (Ctrl-C: SIGINT)"
                       : "preempted (SIGTERM or SIGUSR1 on " + std::to_string(ranks) + " rank(s))";
  }
  int exit_code() const { return interrupted ? kExitInterrupted : kExitPreempted; }
};

}  // namespace

struct Trainer::Impl {
  const Job& job;
  const Recipe& r;
  const parallel::Mesh& mesh;
  int dp_rank = 0, dp = 1, n_micro = 1;
  int64_t rows = 0, T = 0;
  TokenStream train_tokens, val_tokens;
  std::optional<Sampler> train_sampler, val_sampler;
  // The stage's parts (runtime/stage/stage.h), in its order: the device and groups outlive what
  // is built on them, and the arena outlives the groups (freeing it waits for the device).
  std::unique_ptr<kernels::Device> device;
  std::unique_ptr<kernels::Arena> arena;
  std::unique_ptr<StageGroups> groups;
  std::unique_ptr<PipelineExecutor> executor;
  std::unique_ptr<Model> model;
  std::unique_ptr<TrainingState> state;    // what this rank updates: ZeRO shards, moments, reducers
  std::unique_ptr<RouterBalance> balance;  // a mixture of experts' routing counts and biases
  std::optional<MicroBatchFeed> feed;      // a step's micro-batches, cut to this cp rank
  int cp = 1, cp_rank = 0;
  std::unique_ptr<MetricsWriter> metrics;
  std::unique_ptr<Snapshotter> snapshots;
  std::unique_ptr<Replay> replay;        // run.replay_every's checks, T3D_FAULT=flip's injections
  std::unique_ptr<GpuOpTimes> op_times;  // T3D_GPU_OP_TIMES's step-time breakdown on a GPU
  int64_t first_step = 0;                // > 0 when resumed from a snapshot
  int64_t consecutive_skips = 0;         // diverged steps in a row (train.dynamic_loss_scale)
  bool holds_loss = false;  // last pipeline stage and tp rank 0: contributes the loss once
  double flops_per_token = 0;
  HostPeaks peaks;
  int hosts = 1;
  double unigram_nats = 0;

  Impl(const Job& j) : job(j), r(j.recipe), mesh(*j.mesh) {}

  void build() {
    const auto& t = r.train;
    dp = mesh.shape().size(Dim::dp);
    dp_rank = mesh.coord().dp;
    n_micro = static_cast<int>(t.micro_batches);
    T = r.model.seq_len;

    // This rank's stage: threads, schedule and placement, executor, arena, model.
    Stage stage = build_stage(job, StagePurpose::kTrain);
    rows = stage.micro_rows;
    device = std::move(stage.device);
    groups = std::move(stage.groups);
    executor = std::move(stage.executor);
    arena = std::move(stage.arena);
    model = std::move(stage.model);
    holds_loss = stage.holds_loss;
    hosts = std::max(1, mesh.world().size() / std::max(1, job.env.local_size));
    cp = mesh.shape().size(Dim::cp), cp_rank = mesh.coord().cp;

    // Data: every rank maps the token file (or tokenizes the text) and samples only its own rows.
    StageData data = load_stage_data(r);
    train_tokens = std::move(data.train);
    val_tokens = std::move(data.val);
    // Rank 0 alone logs and reports it: one pass over the corpus less on every other rank.
    if (mesh.rank() == 0) unigram_nats = unigram_entropy_nats(train_tokens.tokens);
    const auto seed = static_cast<uint64_t>(t.seed);
    train_sampler.emplace(train_tokens.tokens, train_tokens.source,
                          SamplerConfig{r.data.sampler, seed, t.global_batch, T});
    if (!val_tokens.tokens.empty())
      val_sampler.emplace(val_tokens.tokens, val_tokens.source + " (validation)",
                          SamplerConfig{SampleMode::kSequential, seed, t.global_batch, T});
    // Over dp × cp: one overlapped reduction sums the gradients of other rows (dp) and of other
    // positions of the same rows (cp); ZeRO shards over the same ranks.
    // The routed experts over the ranks holding the same ones (dp × cp when parallel.ep = 1).
    state = std::make_unique<TrainingState>(*model, groups->dp_cp(), groups->edp(),
                                            static_cast<int>(r.parallel.zero), r.parallel.bucket_mb,
                                            *arena);
    state->init(seed);
    balance = std::make_unique<RouterBalance>(mesh, *model, state->dense());
    feed.emplace(rows, T, cp, cp_rank, n_micro);
    flops_per_token = model_train_flops_per_token(r.model);
    if (mesh.rank() == 0)
      metrics = std::make_unique<MetricsWriter>(job.run_dir + "/metrics.jsonl",
                                                /*append=*/!r.snapshot.resume.empty());
    snapshots =
        std::make_unique<Snapshotter>(job, *model, *state, metrics.get(), device->description());
  }

  // Collective, after build() succeeded on every rank: ranks agree on the snapshot they restore.
  void restore() {
    first_step = snapshots->restore();
    state->restored();
    replay = std::make_unique<Replay>(job, *model, *state, *snapshots, *arena, first_step);
  }

  void describe() {
    const auto& fp = model->footprint();
    const auto gib = [](size_t b) { return b / double(1 << 30); };
    std::string ranges;
    for (const auto& c : model->chunks())
      ranges += (ranges.empty() ? "" : ", ") + std::string("layers ") + std::to_string(c.begin) +
                "-" + std::to_string(c.end - 1) + (c.first ? " +embedding" : "") +
                (c.last ? " +head" : "");
    // ZeRO shards and buffers replace the model's parameter, gradient and optimizer regions.
    const parallel::StateBytes kept = state->footprint();
    // Every rank's own log gets its footprint (tests read it: tp, pp and ZeRO must shrink it).
    spdlog::info(
        "memory bytes: params {} grads {} optimizer {} activations {} scratch {} peak {} "
        "capacity {}; host snapshot staging {}; holds {}, {} activation slot(s)",
        static_cast<size_t>(kept.params), static_cast<size_t>(kept.grads),
        static_cast<size_t>(kept.optimizer), fp.activations, fp.scratch, arena->peak(),
        arena->capacity(), snapshots->staging_bytes(), ranges, executor->max_slots());
    state->log_footprint(mesh.rank() == 0);
    if (mesh.rank() != 0) return;
    spdlog::info("{}", kernels::openblas_config_string());
    spdlog::info(
        "model: {} layers, dim {}, {} heads ({} kv), ffn {}, vocab {}, seq {}; {:.2f} M "
        "parameters in all",
        r.model.n_layers, r.model.dim, r.model.n_heads, r.model.n_kv_heads, r.model.ffn_dim,
        r.model.vocab_size, r.model.seq_len, whole_model_params() / 1e6);
    spdlog::info(
        "data: {} train tokens, {} validation (text read through data.tokenizer = {}); "
        "unigram entropy {:.3f} nats/token (the loss to beat); global batch {} × {} "
        "tokens, {} micro-batch(es) of {} rows per dp rank",
        train_tokens.size(), val_tokens.size(), r.data.tokenizer, unigram_nats,
        r.train.global_batch, T, n_micro, rows);
    spdlog::info("arena peak {:.3f} GiB of {:.3f} (hardware.hbm_gib)", gib(arena->peak()),
                 gib(arena->capacity()));
  }

  // Parameters of the whole model (not this rank's share), for the log.
  double whole_model_params() const {
    double n = 0;
    for (const auto& p : param_table(r.model))  // with tp = 1 a rank holds every tensor whole
      n += static_cast<double>(tp_shard_box(p, 1, 0).numel());
    return n;
  }

  // The step's own pass (its loss sum), reading the weights' bf16 copy rounded here: after the
  // replay's pass and its fault injection (which may flip a weight); nothing writes a weight until
  // the optimizer.
  double own_pass(int64_t step, float grad_scale) {
    const RoundedWeights rounded(*model);
    return executor->run(replay->stage(), source(*train_sampler, step), grad_scale, true);
  }

  MicroBatchSource source(const Sampler& sampler, int64_t step) {
    return feed->source(sampler, step, dp_rank, dp, n_micro);
  }

  double validate() {
    const float scale = 0;  // forward only
    double sum = 0;
    for (int64_t b = 0; b < r.train.val_batches; ++b)
      sum += executor->run(*model, source(*val_sampler, b), scale, false);
    double contribution = holds_loss ? sum : 0.0;
    mesh.world().all_reduce(&contribution, 1);
    return contribution / static_cast<double>(r.train.val_batches * r.train.global_batch * T);
  }

  bool diverged(double loss, double norm) const {
    return !std::isfinite(loss) || !std::isfinite(norm) ||
           loss > kDivergedLossFactor * std::log(static_cast<double>(r.model.vocab_size));
  }

  // Where a diverged step went wrong, the same text on every rank (collective). Always names a
  // model part: the first with non-finite parameters, else the first whose stored output is
  // non-finite, else the first with non-finite gradients, else (all finite, the loss merely
  // huge) the one with the largest gradient norm.
  std::string divergence_site() {
    const int64_t L = r.model.n_layers, none = INT64_MAX;
    // Per part (index unit + 1): [0] non-finite parameters, [1] non-finite gradients; and the
    // gradient's sum of squares, counted once per element as in the global norm.
    std::vector<int64_t> bad_params(L + 2, 0), bad_grads(L + 2, 0);
    std::vector<double> grad_sq(L + 2, 0.0);
    const auto units = model->grad_units();
    // Index block + 1 of the unit holding `offset` (a block's experts count as the block).
    const auto part_of = [&](int64_t offset) {
      for (const auto& u : units)
        if (offset >= u.range.begin && offset < u.range.end)
          return static_cast<size_t>(unit_block(r.model, u.unit) + 1);
      return size_t{0};
    };
    for (const auto& group : state->groups()) {
      const ShardedState& st = *group;
      st.for_each_piece(st.partition(), [&](const ShardedState::Piece& p) {
        const size_t i = part_of(p.lo);
        // Each rank checks its partition's parameters: together, every parameter once.
        const kernels::Exec& exec = model->exec();
        if (kernels::count_nonfinite(exec, st.params(p), p.size()) > 0) bad_params[i] = 1;
        if (kernels::count_nonfinite(exec, st.grads(p), p.size()) > 0)
          bad_grads[i] = 1;
        else  // read only while every gradient is finite
          grad_sq[i] += kernels::sum_of_squares(exec, st.grads(p), p.size());
      });
    }
    mesh.world().all_reduce(bad_params.data(), bad_params.size(), parallel::ReduceOp::max);
    mesh.world().all_reduce(bad_grads.data(), bad_grads.size(), parallel::ReduceOp::max);
    mesh.world().all_reduce(grad_sq.data(), grad_sq.size());
    // Stored outputs: every slot, since the schedule leaves different micro-batches in each.
    int64_t layer = none;
    for (int slot = 0; slot < executor->max_slots(); ++slot)
      layer = std::min(layer, model->first_nonfinite_layer(slot));
    mesh.world().all_reduce(&layer, 1, parallel::ReduceOp::min);
    const auto first = [&](const std::vector<int64_t>& bad) -> int64_t {
      for (size_t i = 0; i < bad.size(); ++i)
        if (bad[i]) return static_cast<int64_t>(i) - 1;
      return none;
    };
    if (const int64_t u = first(bad_params); u != none)
      return "the first non-finite parameters are in " + unit_name(u, L);
    if (layer != none) return "the first non-finite output is " + unit_name(layer, L);
    if (const int64_t u = first(bad_grads); u != none)
      return "outputs are finite; the first non-finite gradient is in " + unit_name(u, L);
    const size_t top =
        static_cast<size_t>(std::max_element(grad_sq.begin(), grad_sq.end()) - grad_sq.begin());
    return "outputs and gradients are finite; the largest gradient is in " +
           unit_name(static_cast<int64_t>(top) - 1, L) + " (norm " +
           fmt::format("{:.3g}", std::sqrt(grad_sq[top])) + ")";
  }

  std::string divergence_text(int64_t step, double loss, double norm) {
    const double bound = kDivergedLossFactor * std::log(static_cast<double>(r.model.vocab_size));
    return "training diverged at step " + std::to_string(step) + ": loss " +
           fmt::format("{:.6g}", loss) +
           (std::isfinite(loss) && loss > bound
                ? fmt::format(" (above {:.4g} = {} · ln(vocab_size))", bound, kDivergedLossFactor)
                : "") +
           ", gradient norm " + fmt::format("{:.6g}", norm) + "; " + divergence_site();
  }

  [[noreturn]] void stop_diverged(int64_t step, double loss, double norm) {
    const std::string text = divergence_text(step, loss, norm);
    throw UserError(text +
                    ". Lower train.lr, keep train.grad_clip on, or set "
                    "train.dynamic_loss_scale = true to skip such steps.");
  }

  // This host's hardware and GEMM peaks (rank 0 measures or reads the cache, all ranks agree).
  void measure_peaks() {
    const int cores = static_cast<int>(std::max(1u, std::thread::hardware_concurrency()));
    if (mesh.rank() == 0 && device->on_gpu())
      peaks = gpu_peaks(*device, job.precision().gemm, job.env.local_size);
    else if (mesh.rank() == 0)
      peaks = host_peaks(job.precision().gemm, std::max<int64_t>(rows * T / cp, 512), r.model.dim,
                         r.model.ffn_dim, cores);
    double both[2] = {peaks.hardware_gflops, peaks.gemm_gflops};
    mesh.world().broadcast(both, 2, 0);
    peaks.hardware_gflops = both[0], peaks.gemm_gflops = both[1];
    if (mesh.rank() == 0 && !device->on_gpu())
      spdlog::info(
          "MFU against {:.0f} GFLOP/s per host ({} peak, measured: {} cores × one core); "
          "mfu_gemm against {:.0f} GFLOP/s ({} on one thread at the model's shapes × cores)",
          peaks.hardware_gflops, peaks.hardware_what, cores, peaks.gemm_gflops,
          kernels::gemm_kind_name(job.precision().gemm));
  }

  // A diverged step (every rank sees the same all-reduced loss and norm): stops the run, or with
  // train.dynamic_loss_scale skips it, giving up after kMaxConsecutiveSkips in a row. agree_on
  // has rank 0 alone print the reason before any rank exits (a rank exiting first could get
  // mpirun to kill rank 0 mid-message).
  void skip_diverged(int64_t step, double loss, double norm) {
    if (!r.train.dynamic_loss_scale)
      agree_on(mesh.world(), [&] { stop_diverged(step, loss, norm); });
    if (++consecutive_skips >= kMaxConsecutiveSkips) {
      const std::string text = divergence_text(step, loss, norm);
      agree_on(mesh.world(), [&] {
        throw UserError("giving up: " + std::to_string(consecutive_skips) +
                        " steps in a row diverged and were skipped "
                        "(train.dynamic_loss_scale allows " +
                        std::to_string(kMaxConsecutiveSkips) + "); the last, " + text +
                        ". Lower train.lr or keep train.grad_clip on.");
      });
    }
    spdlog::warn(
        "step {}: non-finite or exploding loss or gradients (loss {:.6g}, gradient "
        "norm {:.6g}); skipped (train.dynamic_loss_scale, {} in a row)",
        step, loss, norm, consecutive_skips);
  }

  // The groups whose waits the step's communication shares are: tp, dp × cp, pp, cp, ep, and edp
  // (the routed experts' gradient reduction: in the dp share).
  static constexpr int kGroups = 6;
  // Speed, communication shares (mean over ranks since `waited`) and the largest arena peak of a
  // step whose step_time_s is set: two small all-reduces, the first also counting the ranks a
  // stop signal reached (returned: every rank sees the same count and cause).
  StopSignals measure_step(StepRecord& rec, const parallel::Comm* const groups[kGroups],
                           const double waited[kGroups]) {
    double shares[kGroups + 3];
    for (int i = 0; i < kGroups; ++i)
      shares[i] =
          (groups[i]->counters().wait_s - waited[i]) / rec.step_time_s / mesh.world().size();
    shares[kGroups] = stop_requested() != 0 ? 1.0 : 0.0;
    shares[kGroups + 1] = metrics_error.empty() ? 0.0 : 1.0;  // the previous step's metrics write
    shares[kGroups + 2] = stop_is_interrupt() ? 1.0 : 0.0;
    mesh.world().all_reduce(shares, kGroups + 3);
    if (shares[kGroups + 1] > 0) stop_on_metrics_error();
    rec.tp_comm_share = shares[0], rec.dp_comm_share = shares[1], rec.pp_wait_share = shares[2];
    rec.cp_comm_share = shares[3], rec.ep_comm_share = shares[4];
    rec.dp_comm_share += shares[5];
    rec.peak_mem_gib = arena->peak() / double(1 << 30);
    mesh.world().all_reduce(&rec.peak_mem_gib, 1, parallel::ReduceOp::max);
    rec.tokens_per_s = static_cast<double>(r.train.global_batch * T) / rec.step_time_s;
    const auto fraction_of = [&](double gflops) {  // 0 where there is no peak (a GPU's GEMMs)
      return gflops > 0 ? flops_per_token * rec.tokens_per_s / (hosts * gflops * 1e9) : 0.0;
    };
    rec.mfu = fraction_of(peaks.hardware_gflops);
    rec.mfu_gemm = fraction_of(peaks.gemm_gflops);
    return {static_cast<int>(shares[kGroups] + 0.5), shares[kGroups + 2] > 0};
  }

  // After the snapshot of `step` started on every rank: waits for its commit and ends the run
  // with the stop's exit code (every rank alike; rank 0 says so).
  [[noreturn]] void stop_signalled(int64_t step, const StopSignals& stop) {
    snapshots->finish();
    if (mesh.rank() == 0) {
      if (r.snapshot.every > 0)
        spdlog::warn(
            "{}: stopped after step {} with its snapshot committed; continue with `titan3d train "
            "<recipe> --set snapshot.resume=latest` (exit {})",
            stop.cause(), step, stop.exit_code());
      else
        spdlog::warn(
            "{}: stopped after step {}; snapshot.every = 0, so nothing was saved (exit {})",
            stop.cause(), step, stop.exit_code());
    }
    end_stopped(stop);
  }

  // Every rank alike: the stop's exit code, recorded for the self-launched launcher
  // (stop_signal.h: mpirun's own exit code does not say it).
  [[noreturn]] void end_stopped(const StopSignals& stop) {
    if (job.env.local_rank == 0) record_stop(job_pid_dir(job.run_dir), stop.exit_code());
    throw AgreedFailure{stop.exit_code()};
  }

  // Collective, before the first step: a stop signal that came while the job started ends it
  // (nothing has been trained to save).
  void stop_if_signalled_early() {
    install_stop_signals();  // also done before MPI started (apps): idempotent
    int early[2] = {stop_requested() != 0 ? 1 : 0, stop_is_interrupt() ? 1 : 0};
    mesh.world().all_reduce(early, 2);
    if (const StopSignals stop{early[0], early[1] > 0}; stop.ranks > 0) {
      if (mesh.rank() == 0)
        spdlog::warn(
            "{} before step {}: nothing new to snapshot; {} (exit {})", stop.cause(),
            first_step + 1,
            first_step > 0 ? "the snapshot it resumed from stands" : "the run had not trained yet",
            stop.exit_code());
      end_stopped(stop);
    }
  }

  TrainSummary run() {
    const auto& t = r.train;
    TrainSummary summary;
    summary.unigram_entropy_nats = unigram_nats;
    measure_peaks();
    summary.peak_gflops = peaks.hardware_gflops;
    summary.gemm_peak_gflops = peaks.gemm_gflops;
    summary.device = device->description();
    describe();
    op_times = std::make_unique<GpuOpTimes>(*device, first_step, t.steps);

    const double tokens_per_step = static_cast<double>(t.global_batch * T);
    const float grad_scale = static_cast<float>(1.0 / tokens_per_step);
    const auto run_start = Clock::now();
    // The gradient reduction runs on dp × cp, the routed experts' on edp: their waits are
    // dp_comm_share. The experts' all-to-alls run on the EP group (one rank alone when
    // parallel.ep = 1: no waits).
    const parallel::Comm* groups[kGroups] = {&mesh.group(Dim::tp), &mesh.dp_cp(),
                                             &mesh.group(Dim::pp), &mesh.group(Dim::cp),
                                             &mesh.ep(),           &mesh.edp()};
    stop_if_signalled_early();
    for (int64_t step = first_step; step < t.steps; ++step) {
      parallel::fault::step_starts(mesh.rank(), static_cast<long>(step + 1));
      const auto t0 = Clock::now();
      const int64_t waits_before = kernels::host_waits();
      parallel::trace::Span step_span("step", "train");
      step_span.arg("step", step + 1);
      double waited[kGroups];
      for (int i = 0; i < kGroups; ++i) waited[i] = groups[i]->counters().wait_s;
      // A replay (run.replay_every) runs replica `d`'s share of this step through this stage.
      const Replay::Pass pass = [&](int d) {
        executor->run(*model, feed->source(*train_sampler, step, d, dp, n_micro), grad_scale, true);
      };
      replay->begin_step(step + 1, pass);
      state->begin_step(n_micro);
      const double loss_sum = own_pass(step, grad_scale);
      // Data and context parallel: buckets were reduced over dp × cp during the backward; the
      // gradients are means over the global batch's tokens once summed.
      state->finish_step();
      replay->check_gradients(step + 1, pass);
      // One all-reduce for the loss and the exact global gradient norm (each dp × cp rank sums
      // its partition, so every element counts once).
      // MoE: the auxiliary loss rides along (tp ranks hold the same value: tp rank 0 gives it).
      double sums[3] = {holds_loss ? loss_sum : 0.0, state->grad_sum_of_squares(),
                        mesh.coord().tp == 0 ? model->aux_loss() : 0.0};
      mesh.world().all_reduce(sums, r.model.moe() ? 3 : 2);
      const double loss = sums[0] / tokens_per_step, norm = std::sqrt(sums[1]);
      StepRecord rec;
      rec.step = step + 1;
      rec.loss = loss;
      rec.grad_norm = norm;
      rec.lr = learning_rate(t, step);
      rec.aux_loss = sums[2];
      rec.expert_load = balance->measure(rec.step);
      // loss and norm are all-reduced: every rank takes the same branch.
      if (diverged(loss, norm)) {
        skip_diverged(step + 1, loss, norm);
        rec.skipped = true;
      } else {
        consecutive_skips = 0;
        parallel::trace::Span optimizer_span("optimizer", "compute");
        snapshots->before_state_changes();
        balance->apply();
        const float clip = clip_coefficient(t.grad_clip, norm);
        replay->before_update(step + 1, rec.lr, clip);
        state->adamw_step(t, rec.lr, step + 1, clip);
      }
      replay->check_parameters(step + 1);
      rec.replay_s = replay->seconds();
      const bool last = step + 1 == t.steps;
      if (val_sampler && t.val_every > 0 && ((step + 1) % t.val_every == 0 || last))
        rec.val_loss = validate();
      rec.step_time_s = seconds_since(t0);
      rec.host_waits = kernels::host_waits() - waits_before;
      op_times->after_step(rec.step, rec.step_time_s);
      const StopSignals stop = measure_step(rec, groups, waited);
      summary.steps.push_back(rec);
      // Rank 0 writes the metrics; a failed write (a full disk) ends every rank together at the
      // next step's measure_step all-reduce (after the loop for the last step).
      report_or_keep_error(rec, seconds_since(run_start));
      // A stop signal on any rank: every rank snapshots this step and stops.
      snapshots->after_step(step + 1, last || stop.ranks > 0);
      if (stop.ranks > 0 && !last) stop_signalled(step + 1, stop);
    }
    int last_write_failed = metrics_error.empty() ? 0 : 1;
    mesh.world().all_reduce(&last_write_failed, 1);
    if (last_write_failed > 0) stop_on_metrics_error();
    snapshots->finish();
    op_times->report();
    summary.peak_arena_bytes = arena->peak();
    // Every rank's own log: bytes it sent or contributed per group (tests check that bf16 and
    // sequence parallelism halve them).
    spdlog::info("communication bytes: tp {} dp {} pp {} cp {} ep {} edp {}",
                 groups[0]->counters().bytes, groups[1]->counters().bytes,
                 groups[2]->counters().bytes, groups[3]->counters().bytes,
                 groups[4]->counters().bytes, groups[5]->counters().bytes);
    state->log_counters();
    return summary;
  }

  // Rank 0's failed metrics write, kept until every rank learns of it (no extra collective).
  std::string metrics_error;
  void report_or_keep_error(const StepRecord& rec, double elapsed) {
    try {
      report(rec, elapsed);
    } catch (const UserError& e) {
      metrics_error = e.what();
    }
  }
  // Collective: every rank stops with rank 0's message (exit 2).
  void stop_on_metrics_error() {
    agree_on(mesh.world(), [&] {
      if (!metrics_error.empty()) throw UserError(metrics_error);
    });
  }

  void report(const StepRecord& rec, double elapsed) {
    if (mesh.rank() != 0) return;
    const double peak_gib = rec.peak_mem_gib;
    std::vector<std::pair<std::string, double>> fields = {
        {"step", double(rec.step)},
        {"loss", rec.loss},
        {"lr", rec.lr},
        {"grad_norm", rec.grad_norm},
        {"tokens_per_s", rec.tokens_per_s},
        {"mfu", rec.mfu},
        {"mfu_gemm", rec.mfu_gemm},
        {"step_time_s", rec.step_time_s},
        {"peak_mem_gib", peak_gib},
        {"tp_comm_share", rec.tp_comm_share},
        {"dp_comm_share", rec.dp_comm_share},
        {"pp_wait_share", rec.pp_wait_share},
        {"cp_comm_share", rec.cp_comm_share},
        {"ep_comm_share", rec.ep_comm_share},
        {"host_waits", double(rec.host_waits)},
        {"val_loss", rec.val_loss >= 0 ? rec.val_loss : NAN},
        {"skipped", rec.skipped ? 1.0 : 0.0}};
    if (r.run.replay_every > 0) fields.push_back({"replay_s", rec.replay_s});
    if (r.model.moe()) {
      fields.push_back({"aux_loss", rec.aux_loss});
      const ExpertLoad& load = rec.expert_load;
      fields.push_back({"expert_imbalance", load.largest_imbalance});
      fields.push_back({"routed_slots", load.routed_slots});
      fields.push_back({"dropped_slots", load.dropped_slots});
      if (r.model.router_bias_rate > 0) {
        fields.push_back({"router_bias_min", load.bias_min});
        fields.push_back({"router_bias_max", load.bias_max});
      }
      for (size_t i = 0; i < load.layers.size(); ++i)
        fields.push_back({imbalance_field(load.layers[i]), load.imbalance[i]});
      for (size_t i = 0; i < load.layers.size(); ++i)
        fields.push_back({idle_field(load.layers[i]), load.idle[i]});
    }
    metrics->write(fields);
    const int64_t steps = r.train.steps;
    if (rec.step % r.train.log_every != 0 && rec.step != steps && rec.val_loss < 0) return;
    const double eta = elapsed / (rec.step - first_step) * (steps - rec.step);
    std::string val = rec.val_loss >= 0 ? fmt::format(" | val {:.4f}", rec.val_loss) : "";
    spdlog::info(
        "step {:>{}}/{} {:3.0f}% | loss {:.4f}{} | lr {:.2e} | gnorm {:.3f} | {:.0f} tok/s "
        "| MFU {:.1f}% | comm tp {:.0f}% dp {:.0f}% pp {:.0f}%{}{} | mem {:.3f} GiB | eta {}",
        rec.step, std::to_string(steps).size(), steps, 100.0 * rec.step / steps, rec.loss, val,
        rec.lr, rec.grad_norm, rec.tokens_per_s, 100 * rec.mfu, 100 * rec.tp_comm_share,
        100 * rec.dp_comm_share, 100 * rec.pp_wait_share,
        cp > 1 ? fmt::format(" cp {:.0f}%", 100 * rec.cp_comm_share) : "",
        r.parallel.ep > 1 ? fmt::format(" ep {:.0f}%", 100 * rec.ep_comm_share) : "", peak_gib,
        format_duration(eta));
  }
};

Trainer::Trainer(const Job& job) : impl_(std::make_unique<Impl>(job)) {
  agree_on(job.mesh->world(), [&] { impl_->build(); });
  impl_->restore();
}

Trainer::~Trainer() = default;

TrainSummary Trainer::run() { return impl_->run(); }

}  // namespace t3d::runtime
