#include "runtime/use/eval.h"

#include <spdlog/spdlog.h>

#include <algorithm>
#include <cmath>
#include <filesystem>
#include <optional>
#include <thread>

#include "checkpoint/io_thread.h"
#include "checkpoint/snapshot.h"
#include "kernels/arena.h"
#include "kernels/blas.h"
#include "kernels/gemm.h"
#include "kernels/check.h"
#include "kernels/ops.h"
#include "parallel/pipeline_split.h"
#include "parallel/schedule.h"
#include "runtime/data/data.h"
#include "runtime/data/data_sampler.h"
#include "runtime/stage/executor.h"
#include "runtime/stage/gemm_choice.h"
#include "runtime/model/model.h"
#include "runtime/train/snapshots.h"

namespace t3d::runtime {

namespace fs = std::filesystem;
using parallel::Dim;

namespace {

// The same choice as the trainer's (data.format): text, token file, or by extension.
TokenStream load_stream(const std::string& path, const std::string& format, int vocab) {
  if (format == "text") return read_text_file(path);
  if (format == "bin") return read_token_file(path, vocab);
  return load_corpus(path, vocab);
}

// The trainer's validation stream: data.val_path, or the held-out tail of data.path.
TokenStream recipe_validation(const Recipe& r) {
  const int vocab = static_cast<int>(r.model.vocab_size);
  if (!r.data.val_path.empty()) return load_stream(r.data.val_path, r.data.format, vocab);
  T3D_USER_CHECK(r.data.val_fraction > 0, "the snapshot's recipe has no validation data ",
                 "(data.val_path is empty and data.val_fraction = 0); pass --data FILE");
  auto split = split_train_val(load_stream(r.data.path, r.data.format, vocab), r.data.val_fraction,
                               r.model.seq_len + 1);
  return std::move(split.val);
}

}  // namespace

Recipe load_eval_recipe(const std::string& snapshot, const std::vector<Override>& overrides) {
  const std::string text = checkpoint::read_recipe(snapshot);
  // One rank unless asked: eval is a forward pass, and the same number on any layout.
  std::vector<Override> all = {{"parallel.pp", "1"},
                               {"parallel.dp", "1"},
                               {"parallel.cp", "1"},
                               {"parallel.tp", "1"},
                               {"parallel.zero", "0"},
                               {"parallel.virtual_stages", "1"},
                               {"parallel.pipeline_split", "[]"},
                               {"parallel.schedule", "'1f1b'"},
                               {"snapshot.every", "0"},
                               {"snapshot.resume", "''"}};
  bool own_dir = false;
  for (const auto& o : overrides) {
    all.push_back(o);
    own_dir |= o.key == "run.dir";
  }
  Recipe r = parse_recipe(text, snapshot + " (recipe)", all);
  check_same_model(text, r, snapshot, "evaluate");  // --set model.n_layers=2 would score a part
  // Rank logs go beside the training run's, not over them.
  if (!own_dir) r.run.dir += "/eval";
  return r;
}

void check_eval_inputs(const Recipe& recipe, const EvalOptions& options) {
  T3D_USER_CHECK(options.batches >= 0, "--batches is ", options.batches,
                 "; give a positive count, or leave it out for the whole file");
  if (!options.data.empty()) {
    T3D_USER_CHECK(fs::is_regular_file(options.data), "--data `", options.data,
                   "` does not exist or is not a file (relative paths start at ",
                   fs::current_path().string(), ")");
    return;
  }
  check_inputs(recipe);  // the recipe's data.path / data.val_path
}

EvalResult run_eval(const Job& job, const std::string& snapshot, const EvalOptions& options) {
  const Recipe& r = job.recipe;
  const parallel::Mesh& mesh = *job.mesh;
  const int64_t T = r.model.seq_len, B = r.train.global_batch;
  const int dp = mesh.shape().size(Dim::dp), pp = mesh.shape().size(Dim::pp);
  const int n_micro = static_cast<int>(r.train.micro_batches);
  EvalResult res;

  TokenStream stream;
  std::optional<Sampler> sampler;
  std::unique_ptr<PipelineExecutor> executor;
  std::unique_ptr<kernels::Arena> arena;
  std::unique_ptr<Model> model;
  int64_t rows = 0;
  bool holds_loss = false;
  agree_on(mesh.world(), [&] {
    const int cores = static_cast<int>(std::max(1u, std::thread::hardware_concurrency()));
    kernels::set_rank_threads(threads_per_rank(static_cast<int>(r.hardware.threads_per_rank), cores,
                                               std::max(1, job.env.local_size)));
    kernels::verify_gemm_kind(kernels::GemmKind::kOpenBlasF32);  // attention's GEMMs
    kernels::verify_gemm_kind(apply_recorded_gemm(r));  // the GEMM the snapshot trained with
    stream = options.data.empty()
                 ? recipe_validation(r)
                 : load_stream(options.data, r.data.format, static_cast<int>(r.model.vocab_size));
    res.data = options.data.empty() ? stream.source : options.data;
    sampler.emplace(
        stream.tokens, res.data,
        SamplerConfig{SampleMode::kSequential, static_cast<uint64_t>(r.train.seed), B, T});
    rows = sampler->rows_per_micro(dp, n_micro);
    // Scored rows: every window once, or `batches` whole batches as the trainer's validation.
    const int64_t batches = options.batches > 0    ? options.batches
                            : options.data.empty() ? r.train.val_batches
                                                   : 0;
    res.windows = batches > 0 ? batches * B : sampler->num_windows();
    res.batches = (res.windows + B - 1) / B;
    res.tokens = res.windows * T;

    // The trainer's pipeline placement; forward-only passes need one activation slot per chunk.
    const int v = static_cast<int>(r.parallel.virtual_stages);
    const auto all_chunks = parallel::split_layers(
        r.model.n_layers, pp * v,
        parallel::head_cost_in_layers(r.model.vocab_size, r.model.dim, r.model.ffn_dim),
        r.parallel.pipeline_split);
    auto schedule =
        parallel::make_schedule(parallel::parse_schedule_kind(r.parallel.schedule), pp, n_micro, v);
    std::vector<parallel::LayerRange> mine;
    for (int k = 0; k < schedule.num_chunks(); ++k)  // the schedule's placement (ZB-V: a V)
      if (schedule.chunk_stage[k] == mesh.coord().pp) mine.push_back(all_chunks[k]);
    executor = std::make_unique<PipelineExecutor>(
        std::move(schedule), mesh.group(Dim::pp),
        r.train.precision == "bf16" ? WirePrecision::kBf16 : WirePrecision::kFp32);
    arena = std::make_unique<kernels::Arena>(
        static_cast<size_t>(r.hardware.hbm_gib * 1024.0 * 1024.0 * 1024.0));
    ModelOptions mo;
    mo.micro_rows = rows;
    mo.slots = 1;
    mo.with_optimizer = false;
    // As the trainer builds it: bf16 rounds the TP and PP traffic, sequence parallelism changes
    // where the norms run, so both can change the last bits of the loss.
    mo.bf16 = r.train.precision == "bf16";
    mo.sequence_parallel = r.parallel.sequence_parallel;
    mo.cp = &mesh.group(Dim::cp);
    model = std::make_unique<Model>(r.model, mine, mesh.group(Dim::tp), *arena, mo);
    holds_loss = mine.back().last && mesh.coord().tp == 0;

    // This rank's slices of the snapshot's global tensors: resharding is a read with our boxes.
    checkpoint::IoThread io;  // HDF5 is not thread-safe: one thread per process calls it
    io.run([&] {
      checkpoint::SnapshotReader reader(snapshot);
      res.step = reader.info().step;
      float* params = model->state().params.data();
      for (const auto& p : model->params()) {
        const auto& e = model->layout().at(p.name);
        std::vector<int64_t> offset(p.global_shape.size(), 0);
        if (p.split_dim >= 0) offset[p.split_dim] = model->tp_rank() * e.spec.shape[p.split_dim];
        reader.read({"model/" + p.name, p.global_shape, offset, e.spec.shape, params + e.offset});
      }
    });
  });

  std::vector<int32_t> tokens(static_cast<size_t>(rows * T)), targets(tokens.size());
  // Context parallel: this rank's positions of every row, as the trainer.
  const int cp = mesh.shape().size(Dim::cp), cp_rank = mesh.coord().cp;
  const int64_t Tc = T / cp;
  std::vector<int32_t> my_tokens(static_cast<size_t>(rows * Tc)), my_targets(my_tokens.size());
  double sum = 0;
  for (int64_t b = 0; b < res.batches; ++b) {
    const MicroBatchSource source = [&](int mb, const int32_t** tok, const int32_t** tgt) {
      const Batch batch = sampler->sample(b, mesh.coord().dp, dp, mb, n_micro, tokens, targets);
      // Rows past the last scored window (a partial final batch) are scored as nothing.
      for (int64_t i = 0; i < rows; ++i)
        if (b * B + batch.first_global_row + i >= res.windows)
          std::fill_n(targets.begin() + i * T, T, kernels::kIgnoreIndex);
      cp_local_positions(tokens.data(), my_tokens.data(), rows, T, cp, cp_rank);
      cp_local_positions(targets.data(), my_targets.data(), rows, T, cp, cp_rank);
      *tok = my_tokens.data();
      *tgt = my_targets.data();
    };
    sum += executor->run(*model, source, 0.0f, /*training=*/false);
  }
  // As Trainer::validate: the last stage's tp rank 0 of every dp replica and cp rank holds the
  // sum over its rows' positions.
  double contribution = holds_loss ? sum : 0.0;
  mesh.world().all_reduce(&contribution, 1);
  res.loss = contribution / static_cast<double>(res.tokens);
  res.perplexity = std::exp(res.loss);
  return res;
}

std::string eval_json(const EvalResult& r) {
  return fmt::format(
      "{{\"loss\": {:.17g}, \"perplexity\": {:.17g}, \"windows\": {}, \"tokens\": {}, "
      "\"batches\": {}, \"step\": {}}}\n",
      r.loss, r.perplexity, r.windows, r.tokens, r.batches, r.step);
}

}  // namespace t3d::runtime
