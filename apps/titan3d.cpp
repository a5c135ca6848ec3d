// titan3d: the command line. Thin: parses arguments, calls into runtime/, maps failures to exit
// codes (0 ok, 1 internal error, 2 user error, 3 watchdog abort, 4 not implemented yet,
// 5 selfcheck found a fault).
#include <spdlog/spdlog.h>

#include <CLI/CLI.hpp>
#include <cstdio>
#include <string>
#include <vector>

#include "kernels/check.h"
#include "runtime/job.h"
#include "parallel/trace.h"
#include "runtime/launch.h"
#include "runtime/perf_report.h"
#include "runtime/planner.h"
#include "runtime/recipe.h"
#include "runtime/selfcheck.h"
#include "runtime/snapshots.h"
#include "runtime/trainer.h"

namespace {

using namespace t3d;

constexpr int kExitNotImplemented = 4;
constexpr int kExitSelfcheckFailed = 5;

struct Options {
  std::string recipe;
  std::vector<std::string> sets;
  std::string log_level;
  int np = 0;
  bool trace = false;  // --trace: same as run.trace = true
};

std::vector<runtime::Override> overrides(const Options& o) {
  std::vector<runtime::Override> out;
  for (const auto& s : o.sets) out.push_back(runtime::parse_override(s));
  if (o.trace) out.push_back(runtime::parse_override("run.trace=true"));
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
  runtime::spawn_if_needed(recipe, argv, o.np);  // returns only inside a launcher

  runtime::MpiRuntime mpi;
  runtime::Job job = runtime::join_world(std::move(recipe), o.log_level);
  runtime::report_mesh(job);
  const int groups = runtime::verify_mesh_groups(*job.mesh);
  spdlog::info("communicators verified: {} groups per rank (pp, dp, cp, tp), run directory {}",
               groups, job.run_dir);
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
    spdlog::info("done: {} steps, loss {:.4f} -> {:.4f}{} (unigram entropy {:.4f}); metrics in "
                 "{}/metrics.jsonl",
                 last.step, first.loss, last.loss,
                 last.val_loss >= 0 ? fmt::format(", validation {:.4f}", last.val_loss) : "",
                 summary.unigram_entropy_nats, job.run_dir);
  }
  return 0;
}

int train(const Options& o, const std::vector<std::string>& argv) {
  return run_training(runtime::load_recipe(o.recipe, overrides(o)), o, argv);
}

// The snapshot's own recipe, --set overrides applied, continued from the snapshot.
int resume(const std::string& snapshot, const Options& o, const std::vector<std::string>& argv) {
  return run_training(runtime::load_resume_recipe(snapshot, overrides(o)), o, argv);
}

// `selfcheck`: no recipe means the default model on a mesh of the whole world (dp = world).
int selfcheck(const Options& o, const runtime::SelfcheckOptions& options, const std::string& json,
              const std::vector<std::string>& argv) {
  runtime::Recipe recipe =
      o.recipe.empty()
          ? runtime::parse_recipe("[run]\nname = \"selfcheck\"\n[parallel]\ndp = -1\n",
                                  "(selfcheck default)", overrides(o))
          : runtime::load_recipe(o.recipe, overrides(o));
  runtime::spawn_if_needed(recipe, argv, o.np > 0 || !o.recipe.empty() ? o.np : 2);

  runtime::MpiRuntime mpi;
  runtime::Job job = runtime::join_world(std::move(recipe), o.log_level, /*needs_data=*/false);
  const runtime::SelfcheckReport report = runtime::run_selfcheck(job, options);
  if (job.mesh->rank() == 0) {
    std::fputs(report.table().c_str(), stdout);
    std::fflush(stdout);
    if (!json.empty()) {
      std::FILE* f = std::fopen(json.c_str(), "w");
      T3D_USER_CHECK(f, "cannot write `", json, "` (--json)");
      std::fputs(report.json().c_str(), f);
      std::fclose(f);
    }
  }
  return report.ok() ? 0 : kExitSelfcheckFailed;
}

int print_keys() {
  const auto cell = [](std::string s) {  // a '|' would end a Markdown table cell
    for (size_t i = 0; (i = s.find('|', i)) != std::string::npos; i += 2) s.insert(i, "\\");
    return s;
  };
  std::printf("| key | type | default | meaning |\n|---|---|---|---|\n");
  for (const auto& k : runtime::recipe_key_docs())
    std::printf("| `%s` | %s | `%s` | %s |\n", k.key.c_str(), k.type.c_str(),
                k.default_value.c_str(), cell(k.meaning).c_str());
  return 0;
}

}  // namespace

int main(int argc, char** argv) {
  CLI::App app{
      "titan3d: 3D-parallel (data × tensor × pipeline) training of LLaMA-style transformers over "
      "MPI"};
  app.require_subcommand(1);
  Options o;
  app.add_option("--log-level", o.log_level, "trace | debug | info | warn | error")
      ->check(CLI::IsMember({"trace", "debug", "info", "warn", "error"}));

  auto add_sets = [&](CLI::App* cmd) {
    cmd->add_option("--set", o.sets, "Override a recipe key: --set parallel.tp=2 (repeatable)")
        ->type_name("KEY=VALUE");
  };
  auto* train_cmd = app.add_subcommand("train", "Train the model a recipe describes");
  train_cmd->add_option("recipe", o.recipe, "Recipe TOML file")->required();
  add_sets(train_cmd);
  train_cmd->add_option("--np", o.np,
                        "Ranks to spawn when titan3d launches itself and parallel.dp = -1");
  train_cmd->add_flag("--trace", o.trace,
                      "Write a Chrome trace (trace.json in the run directory; run.trace = true)");

  std::string snapshot;
  auto* resume_cmd = app.add_subcommand("resume", "Continue a run from an HDF5 snapshot");
  resume_cmd->add_option("snapshot", snapshot, "Snapshot file (.h5)")->required();
  add_sets(resume_cmd);

  std::string json;
  runtime::SelfcheckOptions check;
  auto* selfcheck_cmd = app.add_subcommand(
      "selfcheck", "Diagnose ranks and groups: collectives, P2P, replicas, bandwidth, GEMM speed");
  selfcheck_cmd->add_option("recipe", o.recipe,
                            "Recipe TOML file (its mesh and model are checked); default: the "
                            "default model on dp = all ranks");
  add_sets(selfcheck_cmd);
  selfcheck_cmd->add_option("--json", json, "Also write the report as JSON to this file");
  selfcheck_cmd->add_flag("--quick", check.quick, "Fewer message sizes and iterations");
  selfcheck_cmd->add_option("--np", o.np,
                            "Ranks to spawn when titan3d launches itself and parallel.dp = -1 "
                            "(default 2 without a recipe)");

  // `plan` (issue 7): options go straight into runtime::PlanOptions; see docs/planner.md.
  runtime::PlanOptions plan;
  auto* plan_cmd = app.add_subcommand("plan", "Choose DP×TP×PP for a model and a cluster");
  plan_cmd->add_option("recipe", o.recipe, "Recipe TOML file (model and training shape)")
      ->required();
  add_sets(plan_cmd);
  plan_cmd->add_option("--cluster", plan.cluster,
                       "Cluster TOML file (recipes/clusters/); default: this machine");
  plan_cmd->add_option("--top", plan.top, "Rows of the ranked table")->capture_default_str();
  plan_cmd->add_option("--explain", plan.explain,
                       "Show the arithmetic of table row N (0: the recipe's own layout)");
  plan_cmd->add_option("--write-recipe", plan.write_recipe, "Write the best layout as a recipe");
  plan_cmd->add_flag("--schedule", plan.schedule,
                     "Simulate the recipe's own layout: timeline and summary");
  plan_cmd->add_option("--svg", plan.svg, "With --schedule: also draw the timeline as SVG");
  plan_cmd->add_flag("--calibrate", plan.calibrate, "Measure GEMM speed on this machine");
  plan_cmd->add_option("--zero", plan.zero, "ZeRO stages to try, e.g. --zero 0,1 (default: 0,1,2; 3 is priced only on request)")
      ->delimiter(',');

  auto* keys_cmd = app.add_subcommand("keys", "Print every recipe key: type, default, meaning");

  try {
    app.parse(argc, argv);
  } catch (const CLI::ParseError& e) {
    return app.exit(e) == 0 ? 0 : 2;
  }

  const std::vector<std::string> args(argv, argv + argc);
  try {
    if (train_cmd->parsed()) return train(o, args);
    if (keys_cmd->parsed()) return print_keys();
    if (resume_cmd->parsed()) return resume(snapshot, o, args);
    if (selfcheck_cmd->parsed()) return selfcheck(o, check, json, args);
    if (plan_cmd->parsed()) {
      plan.recipe = o.recipe;
      plan.overrides = overrides(o);
      return runtime::run_plan(plan);
    }
  } catch (const runtime::AgreedFailure& f) {
    return f.exit_code;  // already reported once, by the lowest failing rank
  } catch (const UserError& e) {
    if (speaks_before_mpi()) std::fprintf(stderr, "titan3d: %s\n", e.what());
    return 2;
  } catch (const std::exception& e) {
    std::fprintf(stderr, "titan3d: internal error: %s\n", e.what());
    return 1;
  }
  return 1;
}
