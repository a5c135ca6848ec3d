// `titan3d eval`: the mean cross-entropy of a snapshot's model over a token stream, on any layout.
//
// The data is read exactly as the trainer reads validation data: the sequential sampler, windows
// of seq_len + 1 tokens starting every seq_len tokens from the start of the stream, global_batch
// windows per batch, through PipelineExecutor's forward-only pass. So with the recipe's own
// validation data and train.val_batches batches, eval repeats the trainer's validate() and gives
// the val_loss it logged at the snapshot's step (bit for bit on the training layout, within fp32
// tolerance on any other). Without a batch count it covers every window of the stream once: the
// last batch's surplus rows have their targets ignored (kIgnoreIndex), so none counts twice.
#pragma once

#include <cstdint>
#include <string>
#include <vector>

#include "runtime/launch/job.h"
#include "runtime/recipe/recipe.h"

namespace t3d::runtime {

struct EvalOptions {
  std::string data;     // text (byte tokenizer) or token file; "": the recipe's validation data
  int64_t batches = 0;  // > 0: that many batches (wrapping like the sampler); 0: see below
  std::string json;     // write the result as JSON here ("" no)
};

struct EvalResult {
  double loss = 0;        // nats per token
  double perplexity = 0;  // exp(loss)
  int64_t windows = 0;    // sequences scored
  int64_t tokens = 0;     // targets scored: windows · seq_len
  int64_t batches = 0;
  int64_t step = 0;  // the snapshot's
  std::string data;  // what was read, for messages
};

// The eval's recipe: the snapshot's, on one rank (pp = dp = tp = 1, no ZeRO or virtual stages)
// unless `overrides` say otherwise, no snapshots, logs in <run.dir>/eval unless run.dir is set.
Recipe load_eval_recipe(const std::string& snapshot, const std::vector<Override>& overrides);

// Checks, before any rank starts, that the data to read exists (UserError otherwise).
void check_eval_inputs(const Recipe& recipe, const EvalOptions& options);

// Collective over the job's world, in job.precision() (the snapshot's record: recorded_precision
// of the recipe load_eval_recipe read). With batches = 0: the recipe's validation data gets
// train.val_batches batches (what the trainer logs); a --data file gets every window once.
EvalResult run_eval(const Job& job, const std::string& snapshot, const EvalOptions& options);

// The result as one JSON object (full double precision).
std::string eval_json(const EvalResult& result);

}  // namespace t3d::runtime
