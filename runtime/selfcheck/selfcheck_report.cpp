// The selfcheck report as a table (one row per check, an OK / FAILED footer naming what failed)
// and as JSON with the same content.
#include <fmt/format.h>

#include <algorithm>

#include "parallel/trace.h"
#include "runtime/selfcheck/selfcheck.h"

namespace t3d::runtime {

namespace {

std::string ranks_label(const std::vector<int>& ranks) {
  return fmt::format("world rank{} {}", ranks.size() > 1 ? "s" : "", fmt::join(ranks, ","));
}

}  // namespace

bool SelfcheckReport::ok() const {
  return std::none_of(rows.begin(), rows.end(),
                      [](const CheckRow& r) { return r.status == CheckStatus::failed; });
}

int SelfcheckReport::warnings() const {
  return static_cast<int>(std::count_if(
      rows.begin(), rows.end(), [](const CheckRow& r) { return r.status == CheckStatus::warn; }));
}

std::string SelfcheckReport::table() const {
  std::string out =
      fmt::format("titan3d selfcheck: {} rank{}, mesh {}\n\n", world, world > 1 ? "s" : "", mesh);
  out +=
      fmt::format("{:<14} {:<7} {:<17} {:<7} {}\n", "check", "group", "scope", "result", "detail");
  std::string last;
  int checks = 0;
  std::vector<std::string> failures;
  for (const auto& r : rows) {
    // One block per group for the collectives, one per kind of check otherwise. Columns as
    // wide as before, a value that fills one still followed by a space.
    const bool collective = r.check == "all_reduce" || r.check == "all_gather" ||
                            r.check == "reduce_scatter" || r.check == "broadcast";
    const std::string block = collective ? "collectives " + r.group : r.check;
    if (!last.empty() && block != last) out += "\n";
    last = block;
    checks += r.status != CheckStatus::info;
    out += fmt::format("{:<14} {:<7} {:<17} {:<7} {}\n", r.check, r.group, r.scope,
                       status_name(r.status), r.detail);
    if (r.status == CheckStatus::failed)
      failures.push_back(
          fmt::format("{} on {}{}", r.check, r.group,
                      r.culprits.empty() ? "" : " (" + ranks_label(r.culprits) + ")"));
  }
  out += std::string(72, '-') + "\n";
  const int warned = warnings();
  const std::string warn_note =
      warned ? fmt::format(" ({} warning{}: see WARN rows)", warned, warned > 1 ? "s" : "") : "";
  if (failures.empty())
    out += fmt::format("OK: {} checks passed{}\n", checks, warn_note);
  else
    out += fmt::format("FAILED: {} of {} checks: {}{}\n", failures.size(), checks,
                       fmt::join(failures, "; "), warn_note);
  return out;
}

std::string SelfcheckReport::json() const {
  std::string out = fmt::format(
      "{{\"world\": {}, \"mesh\": {}, \"ok\": {}, \"warnings\": {}, "
      "\"rows\": [",
      world, parallel::trace::json_string(mesh), ok() ? "true" : "false", warnings());
  for (size_t i = 0; i < rows.size(); ++i) {
    const auto& r = rows[i];
    out += fmt::format(
        "{}\n  {{\"check\": {}, \"group\": {}, \"scope\": {}, \"status\": {}, "
        "\"detail\": {}, \"culprits\": [{}]}}",
        i ? "," : "", parallel::trace::json_string(r.check), parallel::trace::json_string(r.group),
        parallel::trace::json_string(r.scope), parallel::trace::json_string(status_name(r.status)),
        parallel::trace::json_string(r.detail), fmt::join(r.culprits, ", "));
  }
  return out + "\n]}\n";
}

}  // namespace t3d::runtime
