// titan3d: the command line. Thin: parses arguments, calls into runtime/, maps failures to exit
// codes, as the one table of them says: docs/resilience.md#exit-codes.
#include <spdlog/spdlog.h>
#include <unistd.h>

#include <CLI/CLI.hpp>
#include <algorithm>
#include <charconv>
#include <chrono>
#include <cmath>
#include <cstdio>
#include <cstdlib>
#include <functional>
#include <string>
#include <vector>

#include "apps/io_verbs.h"
#include "apps/perf_report.h"
#include "checkpoint/paths.h"
#include "kernels/blas.h"
#include "kernels/check.h"
#include "kernels/device.h"
#include "parallel/trace.h"
#include "runtime/cost/planner.h"
#include "runtime/data/text_tokenizer.h"
#include "runtime/launch/job.h"
#include "runtime/launch/launch.h"
#include "runtime/launch/mpirun_watch.h"
#include "runtime/launch/stop_signal.h"
#include "runtime/machine/gemm_choice.h"
#include "runtime/plan/plan_verb.h"
#include "runtime/provenance/provenance.h"
#include "runtime/recipe/recipe.h"
#include "runtime/selfcheck/selfcheck.h"
#include "runtime/stage/stage.h"
#include "runtime/supervise/supervisor.h"
#include "runtime/train/trainer.h"
#include "runtime/use/eval.h"
#include "runtime/use/export.h"
#include "runtime/use/generate.h"
#include "runtime/use/tokenize.h"

namespace {

using namespace t3d;

constexpr int kExitSelfcheckFailed = 5;

struct Options {
  std::string recipe;
  std::vector<std::string> sets;
  std::string log_level;
  int np = 0;
  bool trace = false;     // --trace: same as run.trace = true
  bool dry_run = false;   // --dry-run: validate the recipe and its inputs, start no rank
  int max_restarts = -1;  // --max-restarts: run.max_restarts; -1: the recipe's
};

std::vector<runtime::Override> overrides(const Options& o) {
  std::vector<runtime::Override> out;
  for (const auto& s : o.sets) out.push_back(runtime::parse_override(s));
  if (o.trace) out.push_back(runtime::parse_override("run.trace=true"));
  if (o.max_restarts >= 0)
    out.push_back(runtime::parse_override("run.max_restarts=" + std::to_string(o.max_restarts)));
  return out;
}

// Before MPI exists, only the process that will be rank 0 (or the lone launcher) speaks.
bool speaks_before_mpi() {
  const auto env = runtime::detect_launch_env();
  return env.launcher == runtime::Launcher::none || env.rank <= 0;
}

// `train` and `resume` differ only in where the recipe comes from.
int run_training(runtime::Recipe recipe, const Options& o, const std::vector<std::string>& argv) {
  runtime::check_inputs(recipe);
  if (recipe.data.tokenizer != runtime::kByteTokenizerName) runtime::check_tokenizer(recipe);
  // Not inside a launcher: become the job's parent (mpirun, restarts after failures).
  if (runtime::detect_launch_env().launcher == runtime::Launcher::none) {
    // An elastic shrink is priced by the cost model, which the supervisor cannot link.
    const runtime::SupervisedRun run =
        runtime::supervise_training(recipe, runtime::make_spawn_plan(recipe, argv, o.np),
                                    o.log_level, runtime::planned_rank_bytes);
    if (run.code == 0)
      runtime::report_supervision(
          run, runtime::job_run_dir(recipe.run.dir, runtime::detect_launch_env()));
    return run.code;
  }

  // A preemption signal from the first moment on (the launcher may forward one while MPI
  // starts) asks for a stop instead of killing the rank.
  runtime::install_stop_signals();
  runtime::MpiRuntime mpi;
  // One live training job per run directory: the lock is taken before any log is opened.
  runtime::Job job = runtime::join_world(std::move(recipe), o.log_level, /*needs_data=*/true,
                                         /*lock_run_dir=*/true);
  runtime::report_mesh(job);
  const int groups = runtime::verify_mesh_groups(*job.mesh);
  spdlog::info("communicators verified: {} groups per rank (pp, dp, cp, tp), run directory {}",
               groups, job.run_dir);
  // The job's precision, measured once before anything computes (the recipe stays the user's).
  runtime::agree_on(job.mesh->world(),
                    [&] { job.set_precision(runtime::choose_gemm(job).job_precision()); });
  if (job.recipe.run.trace) parallel::trace::enable(job.mesh->world(), job.mesh->label());
  runtime::Trainer trainer(job);
  const runtime::TrainSummary summary = trainer.run();
  if (job.recipe.run.trace) {
    const std::string merged = job.run_dir + "/trace.json";
    const size_t events = parallel::trace::write(job.mesh->world(), job.run_dir + "/trace", merged);
    if (job.mesh->rank() == 0)
      spdlog::info("trace: {} spans of {} ranks in {} (open in https://ui.perfetto.dev)", events,
                   job.mesh->world().size(), merged);
  }
  runtime::report_performance(job, summary);
  if (job.mesh->rank() == 0 && !summary.steps.empty()) {
    const auto& first = summary.steps.front();
    const auto& last = summary.steps.back();
    spdlog::info(
        "done: {} steps, loss {:.4f} -> {:.4f}{} (unigram entropy {:.4f}); metrics in "
        "{}/metrics.jsonl",
        last.step, first.loss, last.loss,
        last.val_loss >= 0 ? fmt::format(", validation {:.4f}", last.val_loss) : "",
        summary.unigram_entropy_nats, job.run_dir);
  }
  return 0;
}

int train(const Options& o, const std::vector<std::string>& argv) {
  runtime::Recipe recipe = runtime::load_recipe(o.recipe, overrides(o));
  if (!o.dry_run) return run_training(std::move(recipe), o, argv);
  // Everything that is checked before a rank starts, and nothing else (docs/recipe.md).
  runtime::check_inputs(recipe);
  if (recipe.data.tokenizer != runtime::kByteTokenizerName) runtime::check_tokenizer(recipe);
  if (o.np > 0) recipe.resolve_world(o.np);
  std::printf(
      "recipe ok: %s: pp·dp·cp·tp = %lld·%lld·%lld·%lld = %lld ranks, %lld steps\n",
      o.recipe.c_str(), static_cast<long long>(recipe.parallel.pp),
      static_cast<long long>(recipe.parallel.dp), static_cast<long long>(recipe.parallel.cp),
      static_cast<long long>(recipe.parallel.tp), static_cast<long long>(recipe.world_size()),
      static_cast<long long>(recipe.train.steps));
  // Where the run would write (inside a SLURM job, its job's directory): scripts/slurm/train.sbatch
  // reads incidents.jsonl there.
  std::printf("run directory: %s\n",
              runtime::job_run_dir(recipe.run.dir, runtime::detect_launch_env()).c_str());
  return 0;
}

// CLI11 says only "A subcommand is required" for a misspelt verb: name it and list the verbs.
// Returns the unknown verb, or "" when the first word is a verb (or there is none).
std::string unknown_verb(const CLI::App& app, int argc, char** argv) {
  for (int i = 1; i < argc; ++i) {
    const std::string a = argv[i];
    if (a == "--log-level") {
      ++i;
      continue;
    }
    if (!a.empty() && a[0] == '-') continue;
    for (const CLI::App* sub : app.get_subcommands([](const CLI::App*) { return true; }))
      if (sub->get_name() == a) return "";
    return a;
  }
  return "";
}

// The snapshot's own recipe, --set overrides applied, continued from the snapshot.
int resume(const std::string& snapshot, const Options& o, const std::vector<std::string>& argv) {
  return run_training(runtime::load_resume_recipe(snapshot, overrides(o)), o, argv);
}

// `selfcheck`: no recipe means the default model on a mesh of the whole world (dp = world).
int selfcheck(const Options& o, const runtime::SelfcheckOptions& options, const std::string& json,
              const std::vector<std::string>& argv) {
  runtime::Recipe recipe =
      o.recipe.empty() ? runtime::parse_recipe("[run]\nname = \"selfcheck\"\n[parallel]\ndp = -1\n",
                                               "(selfcheck default)", overrides(o))
                       : runtime::load_recipe(o.recipe, overrides(o));
  runtime::spawn_if_needed(recipe, argv, o.np > 0 || !o.recipe.empty() ? o.np : 2);

  runtime::MpiRuntime mpi;
  runtime::Job job = runtime::join_world(std::move(recipe), o.log_level, /*needs_data=*/false);
  job.set_precision(runtime::recorded_precision(job.recipe));  // no measurement: auto is fp32
  const runtime::SelfcheckReport report = runtime::run_selfcheck(job, options);
  if (job.mesh->rank() == 0) {
    std::fputs(report.table().c_str(), stdout);
    std::fflush(stdout);
    if (!json.empty()) checkpoint::write_file_atomically(json, report.json(), "--json");
  }
  return report.ok() ? 0 : kExitSelfcheckFailed;
}

// `eval`: the snapshot's recipe on one rank unless --set parallel.* says otherwise.
int eval(const std::string& snapshot, const runtime::EvalOptions& options, const Options& o,
         const std::vector<std::string>& argv) {
  runtime::Recipe recipe = runtime::load_eval_recipe(snapshot, overrides(o));
  runtime::check_eval_inputs(recipe, options);  // before any rank starts
  runtime::spawn_if_needed(recipe, argv, 0);

  runtime::MpiRuntime mpi;
  runtime::Job job = runtime::join_world(std::move(recipe), o.log_level, /*needs_data=*/false);
  job.set_precision(runtime::recorded_precision(job.recipe));  // the GEMM the snapshot trained with
  const runtime::EvalResult res = runtime::run_eval(job, snapshot, options);
  if (job.mesh->rank() != 0) return 0;
  const auto& p = job.recipe.parallel;
  std::printf(
      "eval %s (step %lld) on %s: loss %.6f nats/token, perplexity %.4f over %lld "
      "windows of %lld tokens (%lld batches; pp=%lld dp=%lld tp=%lld)\n",
      snapshot.c_str(), static_cast<long long>(res.step), res.data.c_str(), res.loss,
      res.perplexity, static_cast<long long>(res.windows),
      static_cast<long long>(job.recipe.model.seq_len), static_cast<long long>(res.batches),
      static_cast<long long>(p.pp), static_cast<long long>(p.dp), static_cast<long long>(p.tp));
  std::fflush(stdout);
  if (!options.json.empty())
    checkpoint::write_file_atomically(options.json, runtime::eval_json(res), "--json");
  return 0;
}

// What a verb printed reached standard output, or UserError: output lost to a full disk or a
// closed pipe is a failure, not a success.
void check_stdout() {
  const bool failed = std::fflush(stdout) != 0 || std::ferror(stdout);
  const int err = errno;
  T3D_USER_CHECK(!failed, runtime::standard_output_lost(err));
}

// OpenBLAS chooses its kernels when it loads, from OPENBLAS_CORETYPE; Debian's falls back to slow
// generic ones on some CPUs (docs/cluster.md). The launcher sets it for ranks; a verb that
// runs without ranks re-executes itself once with it set (2.4x faster decoding, measured).
void reexec_with_openblas_coretype(const std::vector<std::string>& argv) {
  if (std::getenv("OPENBLAS_CORETYPE")) return;
  const std::string coretype = kernels::recommended_openblas_coretype();
  if (coretype.empty()) return;
  setenv("OPENBLAS_CORETYPE", coretype.c_str(), 1);
  std::vector<char*> args;
  for (const auto& a : argv) args.push_back(const_cast<char*>(a.c_str()));
  args.push_back(nullptr);
  execv("/proc/self/exe", args.data());  // returns only on failure: go on with what loaded
}

// `generate`: one process, no MPI; the completion streams to stdout after the prompt.
int generate(const std::string& snapshot, const std::string& prompt, int64_t max_tokens,
             const runtime::SamplingOptions& sampling, const std::string& device_name) {
  T3D_USER_CHECK(max_tokens >= 0 && max_tokens <= runtime::kMaxGenerateTokens, "--max-tokens is ",
                 max_tokens, "; give 0 to ", runtime::kMaxGenerateTokens);
  T3D_USER_CHECK(sampling.top_k >= 0, "--top-k is ", sampling.top_k, "; it must be >= 0");
  T3D_USER_CHECK(sampling.temperature >= 0 && std::isfinite(sampling.temperature),
                 "--temperature is ", sampling.temperature,
                 "; it must be a finite number >= 0 (0: greedy)");
  kernels::set_blas_threads(1);  // one row at a time: GEMVs too small to share among threads
  const runtime::SnapshotWeights weights = runtime::load_snapshot_weights(snapshot);
  // One row at a time in exact fp32, whatever kind trained the snapshot: a bf16 GEMM would round
  // every weight matrix again for each token's matrix-vector product (on a GPU: cuBLAS in fp32).
  kernels::DeviceChoice choice = kernels::DeviceChoice::kCpu;
  for (const auto& [value, name] : runtime::Choices<kernels::DeviceChoice>::kAll)
    if (name == device_name) choice = value;
  const auto device = kernels::Device::open(choice, 0, "--device");
  runtime::Decoder decoder(weights, device->exec(kernels::GemmKind::kOpenBlasF32));
  // The snapshot's tokenizer (data.tokenizer, its content hash checked by the load above).
  const auto tokenizer = runtime::TextTokenizer::open(weights.recipe.data.tokenizer,
                                                      "data.tokenizer", weights.recipe.data.bos);
  const auto encoded = tokenizer.encode_document(prompt);
  const std::vector<int32_t> ids(encoded.begin(), encoded.end());
  const int64_t vocab = weights.recipe.model.vocab_size;
  T3D_USER_CHECK(sampling.top_k <= vocab, "--top-k is ", sampling.top_k, " but the model has ",
                 vocab, " token ids (model.vocab_size); give at most ", vocab, " (0: all)");
  for (const int32_t id : ids)
    T3D_USER_CHECK(id < vocab, "the prompt encodes to id ", id, " (", tokenizer.describe(),
                   ") but the model's vocabulary is ", vocab,
                   " tokens (model.vocab_size); it was not trained on text read this way");
  std::fwrite(prompt.data(), 1, prompt.size(), stdout);
  check_stdout();  // before generating: text that cannot be shown is not worth computing
  const auto t0 = std::chrono::steady_clock::now();
  runtime::CompletionPrinter printer(tokenizer, ids);
  const auto out =
      runtime::generate(decoder, ids, max_tokens, std::min<int64_t>(vocab, tokenizer.vocab_size()),
                        sampling, [&](int32_t t) { printer.add(t); });
  printer.finish();
  const double s = std::chrono::duration<double>(std::chrono::steady_clock::now() - t0).count();
  std::printf("\n");
  std::fprintf(stderr,
               "generate: %zu tokens in %.2f s (%.0f tokens/s) from %s (step %lld) on %s, "
               "prompt %zu tokens%s, %s\n",
               out.size(), s, out.size() / std::max(s, 1e-9), snapshot.c_str(),
               static_cast<long long>(weights.step), device->description().c_str(), ids.size(),
               tokenizer.adds_bos() ? " (BOS first, data.bos)" : "",
               sampling.temperature > 0
                   ? fmt::format("temperature {} top-k {} seed {}", sampling.temperature,
                                 sampling.top_k, sampling.seed)
                         .c_str()
                   : "greedy");
  return 0;
}

// `export`: Hugging Face files, no MPI.
int export_model(const std::string& snapshot, const std::string& out_dir,
                 const runtime::ExportOptions& options) {
  const runtime::ExportSummary s = runtime::export_snapshot(snapshot, out_dir, options);
  const std::string shards = s.shards > 1 ? fmt::format(" in {} shards", s.shards) : "";
  std::printf("export %s (step %lld): %lld tensors, %.2f M parameters -> %s (%.1f MiB%s), %s\n",
              snapshot.c_str(), static_cast<long long>(s.step), static_cast<long long>(s.tensors),
              s.parameters / 1e6, s.safetensors.c_str(), s.bytes / 1048576.0, shards.c_str(),
              s.config.c_str());
  if (!s.tokenizer.empty()) std::printf("export: tokenizer -> %s\n", s.tokenizer.c_str());
  return 0;
}

int print_keys() {
  std::fputs(runtime::recipe_keys_table().c_str(), stdout);
  return 0;
}

// Every option's value, filled by CLI11; a verb's run reads its own.
struct CommandLine {
  Options o;
  std::vector<std::string> argv;  // the whole command line (self-launch repeats it)
  std::string snapshot, json, prompt, seed, out_dir, hf_dir, device = "cpu";
  int64_t max_tokens = 200;
  runtime::SelfcheckOptions check;
  runtime::PlanOptions plan;
  runtime::EvalOptions eval;
  runtime::SamplingOptions sampling;
  runtime::ExportOptions export_opts;
  runtime::TokenizeOptions tok;
};

// One verb: its subcommand, with its options, and what runs when it is the one given.
struct Verb {
  CLI::App* cmd;
  std::function<int()> run;
};

void add_sets(CLI::App* cmd, Options& o) {
  cmd->add_option("--set", o.sets, "Override a recipe key: --set parallel.tp=2 (repeatable)")
      ->type_name("KEY=VALUE");
}

void add_restarts(CLI::App* cmd, Options& o) {
  cmd->add_option("--max-restarts", o.max_restarts,
                  "Relaunch a self-launched job from its newest snapshot after a rank died or "
                  "hung, at most N times (run.max_restarts; 0: never)")
      ->check(CLI::Range(0, 1000));
}

Verb train_verb(CLI::App& app, CommandLine& c) {
  auto* cmd = app.add_subcommand("train", "Train the model a recipe describes");
  cmd->add_option("recipe", c.o.recipe, "Recipe TOML file")->required();
  add_sets(cmd, c.o);
  cmd->add_option("--np", c.o.np,
                  "Ranks to spawn when titan3d launches itself and parallel.dp = -1")
      ->check(CLI::Range(1, 1 << 20));
  cmd->add_flag("--dry-run", c.o.dry_run,
                "Validate the recipe, overrides and input files as a run would before "
                "starting any rank; start none (exit 0: fine, 2: a problem)");
  cmd->add_flag("--trace", c.o.trace,
                "Write a Chrome trace (trace.json in the run directory; run.trace = true)");
  add_restarts(cmd, c.o);
  return {cmd, [&c] { return train(c.o, c.argv); }};
}

Verb resume_verb(CLI::App& app, CommandLine& c) {
  auto* cmd = app.add_subcommand("resume", "Continue a run from an HDF5 snapshot");
  cmd->add_option("snapshot", c.snapshot, "Snapshot file (.h5)")->required();
  add_sets(cmd, c.o);
  add_restarts(cmd, c.o);
  return {cmd, [&c] { return resume(c.snapshot, c.o, c.argv); }};
}

Verb selfcheck_verb(CLI::App& app, CommandLine& c) {
  auto* cmd = app.add_subcommand(
      "selfcheck", "Diagnose ranks and groups: collectives, P2P, replicas, bandwidth, GEMM speed");
  cmd->add_option("recipe", c.o.recipe,
                  "Recipe TOML file (its mesh and model are checked); default: the "
                  "default model on dp = all ranks");
  add_sets(cmd, c.o);
  cmd->add_option("--json", c.json, "Also write the report as JSON to this file");
  cmd->add_flag("--quick", c.check.quick, "Fewer message sizes and iterations");
  cmd->add_option("--np", c.o.np,
                  "Ranks to spawn when titan3d launches itself and parallel.dp = -1 "
                  "(default 2 without a recipe)")
      ->check(CLI::Range(1, 1 << 20));
  return {cmd, [&c] { return selfcheck(c.o, c.check, c.json, c.argv); }};
}

// `plan`: options go straight into runtime::PlanOptions; see docs/planner.md.
Verb plan_verb(CLI::App& app, CommandLine& c) {
  runtime::PlanOptions& plan = c.plan;
  auto* cmd = app.add_subcommand("plan", "Choose DP×TP×PP for a model and a cluster");
  cmd->add_option("recipe", c.o.recipe, "Recipe TOML file (model and training shape)")->required();
  add_sets(cmd, c.o);
  cmd->add_option("--cluster", plan.cluster,
                  "Cluster TOML file (recipes/clusters/); default: this machine");
  cmd->add_option("--top", plan.top, "Rows of the ranked table")
      ->capture_default_str()
      ->check(CLI::Range(int64_t{1}, int64_t{1} << 30));
  cmd->add_option("--explain", plan.explain,
                  "Show the arithmetic of table row N (0: the recipe's own layout)");
  cmd->add_option("--write-recipe", plan.write_recipe, "Write the best layout as a recipe");
  cmd->add_flag("--schedule", plan.schedule,
                "Simulate the recipe's own layout: timeline and summary");
  cmd->add_option("--svg", plan.svg, "With --schedule: also draw the timeline as SVG");
  cmd->add_flag("--calibrate", plan.calibrate,
                "Measure compute and MPI speeds here, with the recipe's ranks");
  cmd->add_option("--calibrate-probe", plan.calibrate_probe)->group("");  // internal
  cmd->add_option(
         "--zero", plan.zero,
         "ZeRO stages to try, e.g. --zero 0,1 (default: 0,1,2; 3 is priced only on request)")
      ->delimiter(',');
  return {cmd, [&c] {
            c.plan.recipe = c.o.recipe;
            c.plan.overrides = overrides(c.o);
            c.plan.argv = c.argv;
            return runtime::run_plan(c.plan);
          }};
}

Verb keys_verb(CLI::App& app) {
  return {app.add_subcommand("keys", "Print every recipe key: type, default, meaning"), print_keys};
}

// Using a trained model (docs/eval-generate-export.md): eval, generate, export.
Verb eval_verb(CLI::App& app, CommandLine& c) {
  auto* cmd = app.add_subcommand(
      "eval", "Mean cross-entropy and perplexity of a snapshot's model over a data file");
  cmd->add_option("snapshot", c.snapshot, "Snapshot file (.h5)")->required();
  cmd->add_option("--data", c.eval.data,
                  "Text (read through the snapshot's data.tokenizer), a token file, or a pattern "
                  "of token files (as data.path); "
                  "default: the recipe's validation data, as the trainer reads it");
  cmd->add_option("--batches", c.eval.batches,
                  "Batches of train.global_batch windows, 1 or more (default: every window of "
                  "--data once; train.val_batches for the recipe's validation data)")
      ->check(CLI::Range(int64_t{1}, int64_t{1} << 40));
  cmd->add_option("--json", c.eval.json, "Also write the result as JSON to this file");
  add_sets(cmd, c.o);
  return {cmd, [&c] { return eval(c.snapshot, c.eval, c.o, c.argv); }};
}

Verb generate_verb(CLI::App& app, CommandLine& c) {
  auto* cmd = app.add_subcommand("generate", "Sample text from a snapshot's model (one process)");
  cmd->add_option("snapshot", c.snapshot, "Snapshot file (.h5)")->required();
  cmd->add_option("--prompt", c.prompt, "Text to continue")->required();
  cmd->add_option("--max-tokens", c.max_tokens,
                  "Tokens to generate, at most " + std::to_string(runtime::kMaxGenerateTokens))
      ->capture_default_str();
  cmd->add_option("--temperature", c.sampling.temperature, "Softmax temperature; 0: greedy")
      ->capture_default_str();
  cmd->add_option("--top-k", c.sampling.top_k, "Sample among the k most likely; 0: all")
      ->capture_default_str();
  // Parsed here: CLI11 wraps "-1" into an unsigned integer and saturates 2^64.
  c.seed = std::to_string(c.sampling.seed);
  cmd->add_option("--seed", c.seed, "Random seed, 0 to 2^64 - 1 (same seed, same text)")
      ->capture_default_str();
  cmd->add_option("--device", c.device,
                  "Where to decode: cpu, cuda (GPU 0 of those visible) or auto (cuda where a GPU "
                  "is visible)")
      ->check(CLI::IsMember({"cpu", "cuda", "auto"}))
      ->capture_default_str();
  return {cmd, [&c] {
            reexec_with_openblas_coretype(c.argv);
            const std::string& seed = c.seed;
            const auto [end, ec] =
                std::from_chars(seed.data(), seed.data() + seed.size(), c.sampling.seed);
            T3D_USER_CHECK(ec == std::errc() && end == seed.data() + seed.size() && !seed.empty(),
                           "--seed is `", seed, "`; give an integer from 0 to 2^64 - 1");
            return generate(c.snapshot, c.prompt, c.max_tokens, c.sampling, c.device);
          }};
}

Verb export_verb(CLI::App& app, CommandLine& c) {
  auto* cmd = app.add_subcommand(
      "export",
      "Write model.safetensors + config.json (Hugging Face LlamaForCausalLM; a mixture "
      "of experts as MixtralForCausalLM or Qwen2MoeForCausalLM)");
  cmd->add_option("snapshot", c.snapshot, "Snapshot file (.h5)")->required();
  cmd->add_option("--out", c.out_dir, "Output directory")->required();
  cmd->add_option("--dtype", c.export_opts.dtype, "fp32 | bf16: the tensors' type")
      ->capture_default_str();
  cmd->add_option("--max-shard-mb", c.export_opts.max_shard_mb,
                  "Shards of at most this many MiB of tensors and model.safetensors.index.json; "
                  "0: one model.safetensors")
      ->capture_default_str();
  return {cmd, [&c] { return export_model(c.snapshot, c.out_dir, c.export_opts); }};
}

Verb import_verb(CLI::App& app, CommandLine& c) {
  auto* cmd = app.add_subcommand(
      "import",
      "Read a Hugging Face LLaMA, Mixtral or Qwen2-MoE directory into a snapshot at step 0 "
      "(to fine-tune)");
  cmd->add_option("hf_dir", c.hf_dir, "Directory: config.json + safetensors weights")->required();
  cmd->add_option("--out", c.out_dir, "Snapshot directory DIR to create, or DIR/step_00000000.h5")
      ->required();
  return {cmd, [&c] { return app::import_model(c.hf_dir, c.out_dir); }};
}

Verb tokenize_verb(CLI::App& app, CommandLine& c) {
  runtime::TokenizeOptions& tok = c.tok;
  auto* cmd = app.add_subcommand(
      "tokenize", "Train a SentencePiece tokenizer and encode text into token files (or decode)");
  cmd->add_option("input", tok.input, "Text file (with --decode: a token file)")->required();
  cmd->add_option("--tokenizer", tok.tokenizer,
                  "SentencePiece model file: written with --vocab, read otherwise "
                  "(\"bytes\": the byte tokenizer)")
      ->required();
  cmd->add_option("--vocab", tok.vocab,
                  "Train a tokenizer of N ids on the input first (byte fallback on)")
      ->check(CLI::Range(int64_t{1}, int64_t{1} << 31));
  cmd->add_option("--type", tok.type, "bpe | unigram (with --vocab)")->capture_default_str();
  cmd->add_option("--out", tok.out,
                  "Token file to write (llm.c layout; uint32 version 2 past 65,535); "
                  "with --decode the text (default stdout)");
  cmd->add_flag("--decode", tok.decode, "Decode the token file INPUT back into text");
  cmd->add_flag("--bos", tok.bos,
                "Start the token file with the BOS id <s>, as data.bos = true reads the "
                "text (for a model imported with data.bos)");
  return {cmd, [&c] { return app::tokenize(c.tok); }};
}

}  // namespace

int main(int argc, char** argv) {
  CLI::App app{
      "titan3d: 3D-parallel (data × tensor × pipeline) training of LLaMA-style transformers over "
      "MPI"};
  app.require_subcommand(1);
  CommandLine c;
  app.add_option("--log-level", c.o.log_level, "trace | debug | info | warn | error")
      ->check(CLI::IsMember({"trace", "debug", "info", "warn", "error"}));
  // In the order `titan3d --help` lists them.
  const std::vector<Verb> verbs = {
      train_verb(app, c),  resume_verb(app, c),  selfcheck_verb(app, c), plan_verb(app, c),
      keys_verb(app),      eval_verb(app, c),    generate_verb(app, c),  export_verb(app, c),
      import_verb(app, c), tokenize_verb(app, c)};

  if (const std::string verb = unknown_verb(app, argc, argv); !verb.empty()) {
    std::string names;
    for (const CLI::App* sub : app.get_subcommands([](const CLI::App*) { return true; }))
      names += (names.empty() ? "" : ", ") + sub->get_name();
    std::fprintf(stderr, "titan3d: unknown verb `%s`; the verbs are %s (titan3d --help)\n",
                 verb.c_str(), names.c_str());
    return 2;
  }
  try {
    app.parse(argc, argv);
  } catch (const CLI::ParseError& e) {
    return app.exit(e) == 0 ? 0 : 2;
  }

  c.argv.assign(argv, argv + argc);
  try {
    int code = 1;
    for (const Verb& verb : verbs)
      if (verb.cmd->parsed()) code = verb.run();
    if (code == 0) check_stdout();
    return code;
  } catch (const runtime::AgreedFailure& f) {
    return f.exit_code;  // already reported once, by the lowest failing rank
  } catch (const UserError& e) {
    if (speaks_before_mpi()) std::fprintf(stderr, "titan3d: %s\n", e.what());
    return 2;
  } catch (const std::exception& e) {
    std::fprintf(stderr, "titan3d: internal error: %s\n", e.what());
    return 1;
  }
}
