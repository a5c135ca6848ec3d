// Rank-prefixed logging (spdlog): every rank writes its own file in the run directory; rank 0
// also speaks to the console (llm.c's printf0), so N ranks do not print N copies.
#pragma once

#include <chrono>
#include <string>

namespace t3d::runtime {

// label: "[pp0 dp1 tp0]"; log_file: empty for none.
void setup_logging(const std::string& label, const std::string& log_file, bool console,
                   const std::string& level);

// Seconds of steady clock since `start`.
inline double seconds_since(std::chrono::steady_clock::time_point start) {
  return std::chrono::duration<double>(std::chrono::steady_clock::now() - start).count();
}

// "1m23s" / "45s" for progress lines.
std::string format_duration(double seconds);

// Appends one line to <run_dir>/incidents.jsonl (docs/resilience.md), the one writer of that
// file: {"time": <now, UTC, ISO 8601>, <fields>}, `fields` being JSON members ("\"a\": 1, ...").
// Best effort: a line that cannot be written is lost, silently.
void append_incident(const std::string& run_dir, const std::string& fields);

}  // namespace t3d::runtime
