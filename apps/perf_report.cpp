#include "apps/perf_report.h"

#include <fmt/format.h>
#include <spdlog/spdlog.h>

#include <algorithm>
#include <cmath>
#include <fstream>
#include <iterator>

#include "checkpoint/paths.h"
#include "kernels/check.h"
#include "kernels/gemm.h"
#include "parallel/simulator.h"
#include "parallel/trace.h"
#include "runtime/cost/planner.h"

namespace t3d::runtime {

namespace {

// The bubble the schedule itself implies at the planner's per-stage costs (the measured pp share
// also holds transfer time, so it is an upper bound on the bubble).
double simulated_bubble(const Recipe& recipe) {
  try {
    const RecipePlan plan = plan_of_recipe(recipe);
    return parallel::simulate(plan.schedule, stage_costs(plan.problem, plan.layout))
        .bubble_fraction;
  } catch (const std::exception&) {
    return -1;
  }
}

std::string percent(double share) {
  return share < 0 ? "n/a" : fmt::format("{:.1f}%", 100 * share);
}

}  // namespace

PerfSummary summarize_performance(const Recipe& r, const JobPrecision& precision, int devices,
                                  const TrainSummary& summary) {
  PerfSummary p;
  p.device = summary.device;
  const auto& q = r.parallel;
  p.layout = fmt::format("pp{} dp{} tp{}{}{}, {}, {} micro-batch{}", q.pp, q.dp, q.tp,
                         q.cp > 1 ? fmt::format(" cp{}", q.cp) : "",
                         q.ep > 1 ? fmt::format(" ep{}", q.ep) : "", choice_name(q.schedule),
                         r.train.micro_batches, r.train.micro_batches > 1 ? "es" : "");
  p.devices = devices;
  // Step 1 pays for first touches of memory and connections: averaged over the rest when any.
  const auto& steps = summary.steps;
  const size_t first = steps.size() > 1 ? 1 : 0;
  double seconds = 0, tokens = 0, replay = 0;
  for (size_t i = first; i < steps.size(); ++i) {
    const auto& s = steps[i];
    seconds += s.step_time_s;
    tokens += s.tokens_per_s * s.step_time_s;
    p.tp_comm_share += s.tp_comm_share * s.step_time_s;
    p.dp_comm_share += s.dp_comm_share * s.step_time_s;
    p.pp_wait_share += s.pp_wait_share * s.step_time_s;
    p.cp_comm_share += s.cp_comm_share * s.step_time_s;
    p.ep_comm_share += s.ep_comm_share * s.step_time_s;
    p.mfu += s.mfu * s.step_time_s;
    p.mfu_gemm += s.mfu_gemm * s.step_time_s;
    replay += s.replay_s;
    p.peak_mem_gib = std::max(p.peak_mem_gib, s.peak_mem_gib);
    ++p.steps_measured;
  }
  if (seconds > 0) {
    p.tokens_per_s = tokens / seconds;
    p.tp_comm_share /= seconds, p.dp_comm_share /= seconds, p.pp_wait_share /= seconds,
        p.cp_comm_share /= seconds, p.ep_comm_share /= seconds;
    p.mfu /= seconds;
    p.mfu_gemm /= seconds;
    if (r.run.replay_every > 0) p.replay_share = replay / seconds;
  }
  p.replay_every = r.run.replay_every;
  p.gemm = fmt::format("{} (train.precision = {})", kernels::gemm_kind_name(precision.gemm),
                       choice_name(precision.train));
  p.tokens_per_s_per_device = p.tokens_per_s / std::max(1, devices);
  p.bubble = q.pp > 1 ? simulated_bubble(r) : 0.0;
  if (r.model.moe() && !steps.empty()) {
    p.imbalance_first = steps.front().expert_load.largest_imbalance;
    p.imbalance_last = steps.back().expert_load.largest_imbalance;
    for (const auto& s : steps)
      p.imbalance_max = std::max(p.imbalance_max, s.expert_load.largest_imbalance);
  }
  return p;
}

std::string format_performance(const PerfSummary& p) {
  std::string out = fmt::format("performance over {} step{} (the first left out):\n",
                                p.steps_measured, p.steps_measured == 1 ? "" : "s");
  const auto row = [&](const char* key, const std::string& value) {
    out += fmt::format("  {:<34}{}\n", key, value);
  };
  row("layout", p.layout);
  row("devices", std::to_string(p.devices) + " (rank 0's: " + p.device + ")");
  row("peak memory per device", fmt::format("{:.3f} GiB", p.peak_mem_gib));
  row("tokens/s per device", fmt::format("{:.0f}", p.tokens_per_s_per_device));
  row("tokens/s in all", fmt::format("{:.0f}", p.tokens_per_s));
  row("communication share TP", percent(p.tp_comm_share));
  row("communication share DP", percent(p.dp_comm_share));
  row("communication share PP", percent(p.pp_wait_share) + " (bubble + transfers, measured)");
  row("communication share CP", percent(p.cp_comm_share));
  row("communication share EP", percent(p.ep_comm_share) + " (the experts' all-to-alls)");
  row("pipeline bubble", percent(p.bubble) + " (the schedule, simulated)");
  row("GEMM", p.gemm);
  row("MFU", percent(p.mfu) + " (of the hardware peak)");
  row("MFU against the GEMM's own rate", percent(p.mfu_gemm));
  if (p.replay_share >= 0)
    row("replay (silent data corruption)",
        percent(p.replay_share) +
            fmt::format(" of step time (a check every {} step(s), run.replay_every)",
                        p.replay_every));
  if (p.imbalance_max >= 0)
    row("expert imbalance first/last/max",
        fmt::format("{:.2f} / {:.2f} / {:.2f} (busiest expert over the mean, worst MoE layer)",
                    p.imbalance_first, p.imbalance_last, p.imbalance_max));
  return out;
}

std::string performance_json(const PerfSummary& p) {
  const auto num = [](double x) { return std::isfinite(x) ? fmt::format("{:.6g}", x) : "null"; };
  return fmt::format(
      "{{\"layout\": \"{}\", \"devices\": {}, \"device\": {}, \"steps_measured\": {}, "
      "\"peak_mem_gib\": {}, "
      "\"tokens_per_s_per_device\": {}, \"tokens_per_s\": {}, \"tp_comm_share\": {}, "
      "\"dp_comm_share\": {}, \"pp_wait_share\": {}, \"cp_comm_share\": {}, \"ep_comm_share\": {}, "
      "\"bubble_simulated\": "
      "{}, \"mfu\": {}, "
      "\"mfu_gemm\": {}, \"gemm\": \"{}\"{}{}}}",
      p.layout, p.devices, parallel::trace::json_string(p.device), p.steps_measured,
      num(p.peak_mem_gib), num(p.tokens_per_s_per_device), num(p.tokens_per_s),
      num(p.tp_comm_share), num(p.dp_comm_share), num(p.pp_wait_share), num(p.cp_comm_share),
      num(p.ep_comm_share), p.bubble < 0 ? "null" : num(p.bubble), num(p.mfu), num(p.mfu_gemm),
      p.gemm,
      p.imbalance_max < 0
          ? ""
          : fmt::format(", \"expert_imbalance_first\": {}, \"expert_imbalance_last\": {}, "
                        "\"expert_imbalance_max\": {}",
                        num(p.imbalance_first), num(p.imbalance_last), num(p.imbalance_max)),
      p.replay_share < 0 ? "" : fmt::format(", \"replay_share\": {}", num(p.replay_share)));
}

std::string format_supervision(const SupervisedRun& run) {
  std::string out = "supervised run (self-launched; incidents.jsonl):\n";
  const auto row = [&](const char* key, const std::string& value) {
    out += fmt::format("  {:<34}{}\n", key, value);
  };
  row("restarts", std::to_string(run.restarts));
  row("time lost", fmt::format("{:.1f} s (steps done again, waiting to restart)", run.lost_s));
  row("goodput", fmt::format("{:.1f}% (step time that counts over {:.1f} s wall time)",
                             100 * run.goodput(), run.wall_s));
  for (const auto& c : run.layout_changes)
    row(c.regrow ? "elastic regrow" : "elastic shrink", c.change);
  return out;
}

void report_supervision(const SupervisedRun& run, const std::string& run_dir) {
  spdlog::info("{}", format_supervision(run));
  const std::string path = run_dir + "/summary.json";
  std::string text;
  {
    std::ifstream in(path);
    if (!in) return;
    text.assign(std::istreambuf_iterator<char>(in), std::istreambuf_iterator<char>());
  }
  const size_t close = text.find_last_of('}');
  if (close == std::string::npos) return;
  std::string changes;
  for (const auto& c : run.layout_changes)
    changes += fmt::format("{}{{\"kind\": \"{}\", \"change\": {}}}", changes.empty() ? "" : ", ",
                           c.regrow ? "regrow" : "shrink", parallel::trace::json_string(c.change));
  text.insert(close, fmt::format(", \"supervision\": {{\"restarts\": {}, \"lost_s\": {:.3f}, "
                                 "\"useful_s\": {:.3f}, \"wall_s\": {:.3f}, \"goodput\": "
                                 "{:.4f}, \"layout_changes\": [{}]}}",
                                 run.restarts, run.lost_s, run.useful_s, run.wall_s, run.goodput(),
                                 changes));
  try {
    checkpoint::write_file_atomically(path, text, "run.dir");
  } catch (const UserError& e) {
    spdlog::warn("{}", e.what());
  }
}

void report_performance(const Job& job, const TrainSummary& summary) {
  if (job.mesh->rank() != 0 || summary.steps.empty()) return;
  const PerfSummary p =
      summarize_performance(job.recipe, job.precision(), job.mesh->world().size(), summary);
  spdlog::info("{}", format_performance(p));
  const std::string path = job.run_dir + "/summary.json";
  try {
    checkpoint::write_file_atomically(
        path,
        "{\"performance\": " + performance_json(p) +
            fmt::format(", \"steps\": {}, \"final_loss\": {:.6g}, \"unigram_entropy_nats\": "
                        "{:.6g}}}\n",
                        summary.steps.back().step, summary.steps.back().loss,
                        summary.unigram_entropy_nats),
        "run.dir");
  } catch (const UserError& e) {
    spdlog::warn("{}", e.what());
  }
}

}  // namespace t3d::runtime
