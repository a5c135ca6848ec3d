#include "runtime/use/eval.h"

#include <spdlog/spdlog.h>

#include <cmath>
#include <filesystem>
#include <optional>

#include "checkpoint/io_thread.h"
#include "checkpoint/snapshot.h"
#include "kernels/arena.h"
#include "kernels/check.h"
#include "kernels/gemm.h"
#include "kernels/ops.h"
#include "runtime/data/data.h"
#include "runtime/data/data_sampler.h"
#include "runtime/data/text_tokenizer.h"
#include "runtime/model/model.h"
#include "runtime/provenance/provenance.h"
#include "runtime/stage/executor.h"
#include "runtime/stage/stage.h"

namespace t3d::runtime {

namespace fs = std::filesystem;
using parallel::Dim;

namespace {

// The trainer's validation stream: data.val_path, or the held-out tail of data.path.
TokenStream recipe_validation(const Recipe& r) {
  T3D_USER_CHECK(!r.data.val_path.empty() || r.data.val_fraction > 0,
                 "the snapshot's recipe has no validation data ",
                 "(data.val_path is empty and data.val_fraction = 0); pass --data FILE");
  return std::move(load_stage_data(r).val);
}

}  // namespace

Recipe load_eval_recipe(const std::string& snapshot, const std::vector<Override>& overrides) {
  const std::string text = checkpoint::read_recipe(snapshot);
  // One rank unless asked: eval is a forward pass, and the same number on any layout.
  std::vector<Override> all = {{"parallel.pp", "1"},
                               {"parallel.dp", "1"},
                               {"parallel.cp", "1"},
                               {"parallel.tp", "1"},
                               {"parallel.ep", "1"},
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
    for (const std::string& file : data_files(options.data, "--data"))  // or a pattern of shards
      T3D_USER_CHECK(fs::is_regular_file(file), "--data `", file,
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
  const int dp = mesh.shape().size(Dim::dp);
  const int n_micro = static_cast<int>(r.train.micro_batches);
  EvalResult res;

  TokenStream stream;
  std::optional<Sampler> sampler;
  Stage stage;
  agree_on(mesh.world(), [&] {
    // The trainer's stage, forward passes only, in the job's precision: the snapshot's record.
    stage = build_stage(job, StagePurpose::kForward);
    kernels::verify_gemm_kind(job.precision().gemm);
    const TextTokenizer tokenizer =
        TextTokenizer::open(r.data.tokenizer, "data.tokenizer", r.data.bos);
    stream = options.data.empty()
                 ? recipe_validation(r)
                 : load_stream(options.data, r.data.format, static_cast<int>(r.model.vocab_size),
                               &tokenizer, "--data");
    res.data = options.data.empty() ? stream.source : options.data;
    sampler.emplace(
        stream.tokens, res.data,
        SamplerConfig{SampleMode::kSequential, static_cast<uint64_t>(r.train.seed), B, T});
    // Scored rows: every window once, or `batches` whole batches as the trainer's validation.
    const int64_t batches = options.batches > 0    ? options.batches
                            : options.data.empty() ? r.train.val_batches
                                                   : 0;
    res.windows = batches > 0 ? batches * B : sampler->num_windows();
    res.batches = (res.windows + B - 1) / B;
    res.tokens = res.windows * T;
    Model* model = stage.model.get();

    // This rank's slices of the snapshot's global tensors: resharding is a read with our boxes.
    checkpoint::IoThread io;  // HDF5 is not thread-safe: one thread per process calls it
    io.run([&] {
      checkpoint::SnapshotReader reader(snapshot);
      res.step = reader.info().step;
      check_same_tokenizer(reader.info().counters, r, snapshot, "evaluate");
      if (mesh.rank() == 0)
        for (const auto& change : changed_model_function(reader.info().recipe, r, snapshot))
          spdlog::warn("evaluating {} as another model: {}", snapshot, change);
      float* params = model->state().params.data();
      for (const auto& p : model->params()) {
        const TensorBox box = tp_shard_box(p, model->tp_size(), model->tp_rank());
        reader.read({"model/" + p.name, p.global_shape, box.offset, box.shape,
                     params + model->layout().at(p.name).offset},
                    model->exec());
      }
    });
  });

  const int64_t rows = stage.micro_rows;
  // Context parallel: this rank's positions of every row, as the trainer.
  MicroBatchFeed feed(rows, T, mesh.shape().size(Dim::cp), mesh.coord().cp, /*slots=*/1);
  double sum = 0;
  for (int64_t b = 0; b < res.batches; ++b) {
    // Rows past the last scored window (a partial final batch) are scored as nothing.
    const auto unscored = [&](const Batch& whole) {
      for (int64_t i = 0; i < rows; ++i)
        if (b * B + whole.first_global_row + i >= res.windows)
          std::fill_n(whole.targets.begin() + i * T, T, kernels::kIgnoreIndex);
    };
    const MicroBatchSource source =
        feed.source(*sampler, b, mesh.coord().dp, dp, n_micro, unscored);
    sum += stage.executor->run(*stage.model, source, 0.0f, /*training=*/false);
  }
  // As Trainer::validate: the last stage's tp rank 0 of every dp replica and cp rank holds the
  // sum over its rows' positions.
  double contribution = stage.holds_loss ? sum : 0.0;
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
