#include "runtime/trainer.h"

#include <spdlog/spdlog.h>

#include <algorithm>
#include <chrono>
#include <cmath>
#include <cstdlib>
#include <filesystem>
#include <fstream>
#include <limits>
#include <optional>
#include <sstream>
#include <thread>

#include "kernels/arena.h"
#include "kernels/blas.h"
#include "kernels/check.h"
#include "kernels/ops.h"
#include "parallel/grad_reducer.h"
#include "parallel/pipeline_split.h"
#include "parallel/schedule.h"
#include "parallel/trace.h"
#include "runtime/data.h"
#include "runtime/data_sampler.h"
#include "runtime/executor.h"
#include "runtime/metrics.h"
#include "runtime/data_parallel.h"
#include "runtime/model.h"
#include "runtime/snapshots.h"

namespace t3d::runtime {

namespace fs = std::filesystem;
using parallel::Dim;
using Clock = std::chrono::steady_clock;

namespace {

double seconds_since(Clock::time_point t) {
  return std::chrono::duration<double>(Clock::now() - t).count();
}

// Linear warm-up to lr, then cosine decay to min_lr at the last step.
double learning_rate(const TrainConfig& t, int64_t step /* 0-based */) {
  if (step < t.warmup_steps) return t.lr * static_cast<double>(step + 1) / t.warmup_steps;
  const double span = std::max<int64_t>(1, t.steps - t.warmup_steps);
  const double progress = std::min(1.0, (step - t.warmup_steps) / span);
  return t.min_lr + 0.5 * (t.lr - t.min_lr) * (1.0 + std::cos(M_PI * progress));
}

// "none" -> 0, "full" -> 1, "every:K" -> K (the recipe validated the text).
int64_t checkpoint_every(const std::string& text) {
  if (text == "none") return 0;
  if (text == "full") return 1;
  return std::stoll(text.substr(6));
}

TokenStream load_stream(const std::string& path, const std::string& format, int vocab) {
  if (format == "text") return read_text_file(path);
  if (format == "bin") return read_token_file(path, vocab);
  return load_corpus(path, vocab);
}

// The host's sgemm peak: one core's best rate at the model's main GEMM shapes times the cores.
// One thread, because ranks usually run single-threaded BLAS side by side, and the per-core rate
// is what a host can sustain on all cores at once. Measured once per machine and shape, cached in
// ~/.cache/titan3d (a measurement takes a second; every run's MFU needs it).
double host_peak_gflops(int64_t M, int64_t N, int64_t K, int cores) {
  const int threads = 1;
  const char* home = std::getenv("HOME");
  const fs::path cache = fs::path(home ? home : "/tmp") / ".cache/titan3d/sgemm_peak.txt";
  std::ostringstream key;
  key << kernels::openblas_corename() << "/cores" << cores << "/" << M << "x" << N << "x" << K
      << "+" << M << "x" << K << "x" << K;
  {
    std::ifstream in(cache);
    std::string k;
    double v;
    while (in >> k >> v)
      if (k == key.str()) return v;
  }
  // The peak is the best the BLAS reaches at these shapes: the best of a few medians, so a burst of
  // load from elsewhere on a shared machine does not lower it. Delete the file to measure again.
  double gflops = 0;
  for (int i = 0; i < 3; ++i)
    gflops = std::max({gflops, kernels::measure_sgemm_gflops(M, N, K, threads, 5),
                       kernels::measure_sgemm_gflops(M, K, K, threads, 5)});
  std::error_code ec;
  fs::create_directories(cache.parent_path(), ec);
  gflops *= cores;
  std::ofstream(cache, std::ios::app) << key.str() << " " << gflops << "\n";
  return gflops;
}

}  // namespace

struct Trainer::Impl {
  const Job& job;
  const Recipe& r;
  const parallel::Mesh& mesh;
  int dp_rank = 0, dp = 1, n_micro = 1;
  int64_t rows = 0, T = 0;
  TokenStream train_tokens, val_tokens;
  std::optional<Sampler> train_sampler, val_sampler;
  std::unique_ptr<kernels::Arena> arena;
  std::unique_ptr<PipelineExecutor> executor;
  std::unique_ptr<Model> model;
  std::unique_ptr<parallel::GradReducer> reducer;
  std::vector<int32_t> tokens_buf, targets_buf;  // (n_micro, rows·T) each
  // Context parallelism: whole sampled rows, of which this cp rank keeps its positions.
  std::vector<int32_t> cp_tokens, cp_targets;  // (rows·T) each
  int cp = 1, cp_rank = 0;
  std::unique_ptr<MetricsWriter> metrics;
  std::unique_ptr<Snapshotter> snapshots;
  int64_t first_step = 0;  // > 0 when resumed from a snapshot
  bool holds_loss = false;  // last pipeline stage and tp rank 0: contributes the loss once
  double flops_per_token = 0, peak_gflops = 0;
  int hosts = 1;
  double unigram_nats = 0;

  Impl(const Job& j) : job(j), r(j.recipe), mesh(*j.mesh) {}

  void build() {
    const auto& p = r.parallel;
    const auto& t = r.train;
    dp = mesh.shape().size(Dim::dp);
    dp_rank = mesh.coord().dp;
    n_micro = static_cast<int>(t.micro_batches);
    T = r.model.seq_len;

    // BLAS: threads share this host's cores among its ranks; refuse a BLAS that computes wrong.
    const int cores = static_cast<int>(std::max(1u, std::thread::hardware_concurrency()));
    const int local = std::max(1, job.env.local_size);
    hosts = std::max(1, mesh.world().size() / local);
    kernels::set_blas_threads(
        threads_per_rank(static_cast<int>(r.hardware.threads_per_rank), cores, local));
    kernels::verify_gemm();

    // Data: every rank reads the corpus (megabytes) and samples only its own rows.
    const auto all = load_stream(r.data.path, r.data.format, static_cast<int>(r.model.vocab_size));
    if (!r.data.val_path.empty()) {
      train_tokens = all;
      val_tokens = load_stream(r.data.val_path, r.data.format, static_cast<int>(r.model.vocab_size));
    } else if (r.data.val_fraction > 0) {
      auto split = split_train_val(all, r.data.val_fraction, T + 1);
      train_tokens = std::move(split.train);
      val_tokens = std::move(split.val);
    } else {
      train_tokens = all;
    }
    unigram_nats = unigram_entropy_nats(train_tokens.tokens);
    const auto seed = static_cast<uint64_t>(t.seed);
    train_sampler.emplace(train_tokens.tokens, train_tokens.source,
                          SamplerConfig{parse_sample_mode(r.data.sampler), seed, t.global_batch, T});
    rows = train_sampler->rows_per_micro(dp, n_micro);
    if (!val_tokens.tokens.empty())
      val_sampler.emplace(val_tokens.tokens, val_tokens.source + " (validation)",
                          SamplerConfig{SampleMode::kSequential, seed, t.global_batch, T});

    // Pipeline: the schedule's table for this stage, the layer ranges of its chunks.
    const int pp = mesh.shape().size(Dim::pp);
    const int v = static_cast<int>(p.virtual_stages);
    auto schedule =
        parallel::make_schedule(parallel::parse_schedule_kind(p.schedule), pp, n_micro, v);
    const auto all_chunks = parallel::split_layers(
        r.model.n_layers, pp * v,
        parallel::head_cost_in_layers(r.model.vocab_size, r.model.dim, r.model.ffn_dim),
        p.pipeline_split);
    std::vector<parallel::LayerRange> mine;
    // The schedule's placement (ZB-V folds the chunks into a V): the executor reads the same table.
    for (int k = 0; k < schedule.num_chunks(); ++k)
      if (schedule.chunk_stage[k] == mesh.coord().pp) mine.push_back(all_chunks[k]);
    executor = std::make_unique<PipelineExecutor>(std::move(schedule), mesh.group(Dim::pp));

    arena = std::make_unique<kernels::Arena>(
        static_cast<size_t>(r.hardware.hbm_gib * 1024.0 * 1024.0 * 1024.0));
    ModelOptions options;
    options.micro_rows = rows;
    options.slots = executor->max_slots();
    options.with_optimizer = p.zero == 0;  // ZeRO: the reducer holds the moment shard
    options.grad_region = p.zero < 2;      // ZeRO-2, 3: the reducer holds the gradient shard
    options.param_region = p.zero < 3;     // ZeRO-3: and the parameter shard
    options.checkpoint_every = checkpoint_every(t.activation_checkpoint);
    options.split_backward = executor->splits_backward();
    options.bf16 = t.precision == "bf16";
    options.sequence_parallel = p.sequence_parallel;
    options.chunk_slots.assign(executor->slots_per_chunk().begin(),
                               executor->slots_per_chunk().end());
    options.cp = &mesh.group(Dim::cp);
    cp = mesh.shape().size(Dim::cp), cp_rank = mesh.coord().cp;
    model = std::make_unique<Model>(r.model, mine, mesh.group(Dim::tp), *arena, options);
    build_reducer();
    tokens_buf.resize(static_cast<size_t>(n_micro * rows * T / cp));
    targets_buf.resize(tokens_buf.size());
    if (cp > 1) cp_tokens.resize(static_cast<size_t>(rows * T)), cp_targets.resize(cp_tokens.size());
    holds_loss = mine.back().last && mesh.coord().tp == 0;
    flops_per_token = model_train_flops_per_token(r.model);
    if (mesh.rank() == 0)
      metrics = std::make_unique<MetricsWriter>(job.run_dir + "/metrics.jsonl",
                                                /*append=*/!r.snapshot.resume.empty());
    snapshots = std::make_unique<Snapshotter>(job, *model, metrics.get());
  }

  // Collective, after build() succeeded on every rank: ranks agree on the snapshot they restore.
  void restore() {
    first_step = snapshots->restore();
    if (r.parallel.zero == 3) reducer->gather_params(nullptr);  // restored: gathers are stale
  }

  void build_reducer() {
    reducer = attach_grad_reducer(*model, mesh.group(Dim::dp), static_cast<int>(r.parallel.zero),
                                  r.parallel.bucket_mb, *arena);
    const auto seed = static_cast<uint64_t>(r.train.seed);
    if (r.parallel.zero < 3) return model->init(seed);
    // ZeRO-3: the full model exists only here, on the host, long enough to keep this rank's shard.
    std::vector<float> full(static_cast<size_t>(model->layout().total_floats()), 0.0f);
    model->init(seed, full.data());
    reducer->scatter_params(full.data());
  }

  // AdamW over what this rank owns, each piece with its tensor's weight decay.
  void optimizer_step(double lr, int64_t step) {
    const auto& t = r.train;
    auto& state = model->state();
    const auto& shard = model->moment_shard();
    kernels::AdamWConfig cfg{static_cast<float>(lr), static_cast<float>(t.beta1),
                             static_cast<float>(t.beta2), static_cast<float>(t.eps), 0.0f};
    int64_t compact = 0;  // offset of the current range in the ZeRO moment arrays
    float* grads = reducer->owned_grads();
    const bool compact_grads = reducer->compact_grads();
    float* params = r.parallel.zero == 3 ? reducer->param_shard() : state.params.data();
    for (const auto& range : reducer->owned()) {
      for (const auto& p : model->params()) {
        const auto& e = model->layout().at(p.name);
        const int64_t lo = std::max(range.begin, e.offset), hi = std::min(range.end, e.offset + e.numel);
        if (lo >= hi) continue;
        float* m = shard.m ? shard.m + compact + (lo - range.begin) : state.adam_m.data() + lo;
        float* v = shard.v ? shard.v + compact + (lo - range.begin) : state.adam_v.data() + lo;
        cfg.weight_decay = p.decay ? static_cast<float>(t.weight_decay) : 0.0f;
        const float* g = compact_grads ? grads + compact + (lo - range.begin) : grads + lo;
        // ZeRO-3's parameter shard is laid out like the gradient shard.
        float* w = r.parallel.zero == 3 ? params + compact + (lo - range.begin) : params + lo;
        kernels::adamw_step(w, g, m, v, hi - lo, cfg, step);
      }
      compact += range.size();
    }
    reducer->gather_params(state.params.data());
  }

  void describe() {
    const auto& fp = model->footprint();
    const auto gib = [](size_t b) { return b / double(1 << 30); };
    std::string ranges;
    for (const auto& c : model->chunks())
      ranges += (ranges.empty() ? "" : ", ") + std::string("layers ") + std::to_string(c.begin) +
                "-" + std::to_string(c.end - 1) + (c.first ? " +embedding" : "") +
                (c.last ? " +head" : "");
    const size_t optimizer =
        r.parallel.zero > 0 ? 2 * sizeof(float) * reducer->owned_floats() : fp.optimizer;
    // ZeRO-2, 3: the shard plus its staging buffers (the model then holds no gradient region);
    // ZeRO-3 also the parameter shard plus its gather buffers.
    const size_t grads = r.parallel.zero >= 2 ? reducer->grad_bytes() : fp.grads;
    const size_t params =
        r.parallel.zero == 3
            ? reducer->param_shard_bytes() +
                  parallel::GradReducer::kGatherBuffers * reducer->gather_bytes()
            : fp.params;
    // Every rank's own log gets its footprint (tests read it: tp, pp and ZeRO must shrink it).
    spdlog::info("memory bytes: params {} grads {} optimizer {} activations {} scratch {} peak {} "
                 "capacity {}; holds {}, {} activation slot(s)",
                 params, grads, optimizer, fp.activations, fp.scratch, arena->peak(),
                 arena->capacity(), ranges, executor->max_slots());
    if (r.parallel.zero == 3)
      spdlog::info("ZeRO-3 parameter bytes: shard {} + {} gather buffers × {} (the largest bucket)",
                   reducer->param_shard_bytes(), parallel::GradReducer::kGatherBuffers,
                   reducer->gather_bytes());
    if (r.parallel.zero >= 2) {
      spdlog::info("ZeRO-2 gradient bytes: shard {} + {} staging buffers × {} (the largest bucket)",
                   reducer->shard_bytes(), parallel::GradReducer::kStagingBuffers,
                   reducer->staging_bytes());
      // A bucket is at least one layer; parallel.bucket_mb larger than the stage's gradients/dp
      // makes the staging buffers cost more than the sharding saves.
      if (mesh.rank() == 0 &&
          parallel::GradReducer::kStagingBuffers * reducer->staging_bytes() > reducer->shard_bytes())
        spdlog::warn("parallel.zero = 2: the {} staging buffers ({} bytes each, the largest gradient "
                     "bucket) outweigh the gradient shard ({} bytes); lower parallel.bucket_mb "
                     "(now {}) to about 1/{} of the stage's gradients or less, or use ZeRO-1",
                     parallel::GradReducer::kStagingBuffers, reducer->staging_bytes(),
                     reducer->shard_bytes(), r.parallel.bucket_mb, 4 * dp);
    }
    if (mesh.rank() != 0) return;
    spdlog::info("{}", kernels::openblas_config_string());
    spdlog::info("model: {} layers, dim {}, {} heads ({} kv), ffn {}, vocab {}, seq {}; {:.2f} M "
                 "parameters in all",
                 r.model.n_layers, r.model.dim, r.model.n_heads, r.model.n_kv_heads,
                 r.model.ffn_dim, r.model.vocab_size, r.model.seq_len,
                 flops_per_token_params() / 1e6);
    spdlog::info("data: {} train tokens, {} validation; unigram entropy {:.3f} nats/token (the loss "
                 "to beat); global batch {} × {} tokens, {} micro-batch(es) of {} rows per dp rank",
                 train_tokens.size(), val_tokens.size(), unigram_nats, r.train.global_batch, T,
                 n_micro, rows);
    spdlog::info("arena peak {:.3f} GiB of {:.3f} (hardware.hbm_gib)", gib(arena->peak()),
                 gib(arena->capacity()));
  }

  // Parameters of the whole model (not this rank's share), for the log.
  double flops_per_token_params() const {
    const auto& m = r.model;
    const double per_layer = 2.0 * m.dim + m.dim * m.head_dim() * (2 * m.n_heads + 2 * m.n_kv_heads) +
                             3.0 * m.dim * m.ffn_dim;
    return m.n_layers * per_layer + m.dim + m.vocab_size * m.dim * (m.tie_embeddings ? 1 : 2);
  }

  MicroBatchSource source(const Sampler& sampler, int64_t step) {
    return [this, &sampler, step](int mb, const int32_t** tokens, const int32_t** targets) {
      const int64_t Tc = T / cp;  // positions per sequence on this cp rank
      const size_t off = static_cast<size_t>(mb * rows * Tc);
      const std::span<int32_t> tok(tokens_buf.data() + off, rows * Tc);
      const std::span<int32_t> tgt(targets_buf.data() + off, rows * Tc);
      if (cp == 1) {
        sampler.sample(step, dp_rank, dp, mb, n_micro, tok, tgt);
      } else {  // every cp rank samples the same rows and keeps its own positions
        sampler.sample(step, dp_rank, dp, mb, n_micro, cp_tokens, cp_targets);
        cp_local_positions(cp_tokens.data(), tok.data(), rows, T, cp, cp_rank);
        cp_local_positions(cp_targets.data(), tgt.data(), rows, T, cp, cp_rank);
      }
      *tokens = tok.data();
      *targets = tgt.data();
    };
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

  [[noreturn]] void stop_non_finite(int64_t step, double loss, double norm) {
    int64_t layer = model->first_nonfinite_layer(executor->max_slots() - 1);
    mesh.world().all_reduce(&layer, 1, parallel::ReduceOp::min);
    const std::string where = layer == INT64_MAX ? "no stored activation (only the gradients)"
                              : layer < 0        ? "model.embed_tokens"
                                                 : "model.layers." + std::to_string(layer);
    throw UserError("training diverged at step " + std::to_string(step) + ": loss " +
                    std::to_string(loss) + ", gradient norm " + std::to_string(norm) +
                    "; the first non-finite output is " + where +
                    ". Lower train.lr, keep train.grad_clip on, or set "
                    "train.dynamic_loss_scale = true to skip such steps.");
  }

  TrainSummary run() {
    const auto& t = r.train;
    TrainSummary summary;
    summary.unigram_entropy_nats = unigram_nats;
    const int cores = static_cast<int>(std::max(1u, std::thread::hardware_concurrency()));
    if (mesh.rank() == 0)
      peak_gflops = host_peak_gflops(std::max<int64_t>(rows * T, 512), r.model.ffn_dim,
                                     r.model.dim, cores);
    mesh.world().broadcast(&peak_gflops, 1, 0);
    summary.peak_gflops = peak_gflops;
    describe();

    const double tokens_per_step = static_cast<double>(t.global_batch * T);
    const float grad_scale = static_cast<float>(1.0 / tokens_per_step);
    const auto run_start = Clock::now();
    const parallel::Comm* groups[4] = {&mesh.group(Dim::tp), &mesh.group(Dim::dp),
                                       &mesh.group(Dim::pp), &mesh.group(Dim::cp)};
    for (int64_t step = first_step; step < t.steps; ++step) {
      const auto t0 = Clock::now();
      parallel::trace::Span step_span("step", "train");
      step_span.arg("step", step + 1);
      double waited[4];
      for (int i = 0; i < 4; ++i) waited[i] = groups[i]->counters().wait_s;
      reducer->begin_step(n_micro);
      const double loss_sum = executor->run(*model, source(*train_sampler, step), grad_scale, true);
      // Data parallel: buckets were reduced during the backward; the gradients are means over the
      // global batch once summed over dp.
      reducer->finish();
      // Context parallel: each cp rank's gradients come from its own positions; their sum over
      // cp is the gradient of the whole sequences (cp ranks then hold identical owned ranges).
      if (cp > 1) {
        if (reducer->compact_grads())
          mesh.group(Dim::cp).all_reduce(reducer->owned_grads(),
                                         static_cast<size_t>(reducer->owned_floats()));
        else
          for (const auto& range : reducer->owned())
            mesh.group(Dim::cp).all_reduce(reducer->owned_grads() + range.begin,
                                           static_cast<size_t>(range.size()));
      }
      // One all-reduce for the loss and the exact global gradient norm (each dp rank sums its
      // partition, so every element counts once; cp replicas count on cp rank 0 only).
      double sums[2] = {holds_loss ? loss_sum : 0.0,
                        cp_rank == 0 ? model->grad_sum_of_squares(reducer->partition(),
                                                                  reducer->owned_grads(),
                                                                  reducer->compact_grads())
                                     : 0.0};
      mesh.world().all_reduce(sums, 2);
      const double loss = sums[0] / tokens_per_step, norm = std::sqrt(sums[1]);
      StepRecord rec;
      rec.step = step + 1;
      rec.loss = loss;
      rec.grad_norm = norm;
      rec.lr = learning_rate(t, step);
      if (!std::isfinite(loss) || !std::isfinite(norm)) {
        // Every rank stops here; agree_on has rank 0 alone print the reason before any rank
        // exits (a rank exiting first could get mpirun to kill rank 0 mid-message).
        if (!t.dynamic_loss_scale)
          agree_on(mesh.world(), [&] { stop_non_finite(step + 1, loss, norm); });
        rec.skipped = true;
        spdlog::warn("step {}: non-finite loss or gradients; skipped (train.dynamic_loss_scale)",
                     step + 1);
      } else {
        parallel::trace::Span optimizer_span("optimizer", "compute");
        if (t.grad_clip > 0 && norm > t.grad_clip) {
          const float factor = static_cast<float>(t.grad_clip / norm);
          if (reducer->compact_grads())
            kernels::scale(reducer->owned_grads(), reducer->owned_floats(), factor);
          else
            for (const auto& range : reducer->owned())
              kernels::scale(reducer->owned_grads() + range.begin, range.size(), factor);
        }
        optimizer_step(rec.lr, step + 1);
      }
      const bool last = step + 1 == t.steps;
      if (val_sampler && t.val_every > 0 && ((step + 1) % t.val_every == 0 || last))
        rec.val_loss = validate();
      rec.step_s = seconds_since(t0);
      // Communication shares (mean over ranks) and the largest arena peak: one small all-reduce.
      double shares[4];
      for (int i = 0; i < 4; ++i)
        shares[i] = (groups[i]->counters().wait_s - waited[i]) / rec.step_s / mesh.world().size();
      mesh.world().all_reduce(shares, 4);
      rec.tp_share = shares[0], rec.dp_share = shares[1], rec.pp_share = shares[2];
      rec.cp_share = shares[3];
      rec.peak_mem_gib = arena->peak() / double(1 << 30);
      mesh.world().all_reduce(&rec.peak_mem_gib, 1, parallel::ReduceOp::max);
      rec.tokens_per_s = tokens_per_step / rec.step_s;
      rec.mfu = flops_per_token * rec.tokens_per_s / (hosts * peak_gflops * 1e9);
      summary.steps.push_back(rec);
      report(rec, seconds_since(run_start));
      snapshots->after_step(step + 1, last);
    }
    snapshots->finish();
    summary.peak_arena_bytes = arena->peak();
    // Every rank's own log: bytes it sent or contributed per group (tests check that bf16 and
    // sequence parallelism halve them).
    spdlog::info("communication bytes: tp {} dp {} pp {} cp {}", groups[0]->counters().bytes,
                 groups[1]->counters().bytes, groups[2]->counters().bytes,
                 groups[3]->counters().bytes);
    if (r.parallel.zero >= 2)
      spdlog::info("gradient bucket reductions: {} ({} early: ZeRO-2 staging buffers all busy)",
                   reducer->reductions(), reducer->early_reductions());
    if (r.parallel.zero == 3)
      spdlog::info("parameter bucket gathers: {}", reducer->gathers());
    return summary;
  }

  void report(const StepRecord& rec, double elapsed) {
    if (mesh.rank() != 0) return;
    const double peak_gib = rec.peak_mem_gib;
    metrics->write({{"step", double(rec.step)},
                    {"loss", rec.loss},
                    {"lr", rec.lr},
                    {"grad_norm", rec.grad_norm},
                    {"tokens_per_s", rec.tokens_per_s},
                    {"mfu", rec.mfu},
                    {"step_time_s", rec.step_s},
                    {"peak_mem_gib", peak_gib},
                    {"tp_comm_share", rec.tp_share},
                    {"dp_comm_share", rec.dp_share},
                    {"pp_wait_share", rec.pp_share},
                    {"cp_comm_share", rec.cp_share},
                    {"val_loss", rec.val_loss >= 0 ? rec.val_loss : NAN},
                    {"skipped", rec.skipped ? 1.0 : 0.0}});
    const int64_t steps = r.train.steps;
    if (rec.step % r.train.log_every != 0 && rec.step != steps && rec.val_loss < 0) return;
    const double eta = elapsed / (rec.step - first_step) * (steps - rec.step);
    std::string val = rec.val_loss >= 0 ? fmt::format(" | val {:.4f}", rec.val_loss) : "";
    spdlog::info("step {:>{}}/{} {:3.0f}% | loss {:.4f}{} | lr {:.2e} | gnorm {:.3f} | {:.0f} tok/s "
                 "| MFU {:.1f}% | comm tp {:.0f}% dp {:.0f}% pp {:.0f}%{} | mem {:.3f} GiB | eta {}",
                 rec.step, std::to_string(steps).size(), steps, 100.0 * rec.step / steps, rec.loss,
                 val, rec.lr, rec.grad_norm, rec.tokens_per_s, 100 * rec.mfu, 100 * rec.tp_share,
                 100 * rec.dp_share, 100 * rec.pp_share,
                 cp > 1 ? fmt::format(" cp {:.0f}%", 100 * rec.cp_share) : "", peak_gib,
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
