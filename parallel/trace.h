// Chrome trace-event spans (chrome://tracing, https://ui.perfetto.dev): what each rank did and
// when, one row per rank, so a pipeline bubble or a slow collective is seen at a glance.
//
// Off by default; a Span then costs one load and one branch, nothing is allocated or timed. When
// on, each span is a complete event ("ph": "X") with microsecond timestamps from a per-rank origin
// taken right after a barrier, so ranks line up. Gaps between spans are idle (or untraced) time.
//
//   trace::Span span("forward", "compute");
//   span.arg("mb", mb).arg("chunk", chunk);
#pragma once

#include <chrono>
#include <cstdint>
#include <string>
#include <string_view>

namespace t3d::parallel {
class Comm;
}

namespace t3d::parallel::trace {

namespace detail {
extern bool g_enabled;
void record(const char* name, const char* category, std::chrono::steady_clock::time_point start,
            std::chrono::steady_clock::time_point end, std::string args);
}  // namespace detail

inline bool enabled() { return detail::g_enabled; }

// Starts recording on this rank. Collective over `world` (a barrier aligns the ranks' origins).
// `label` names the rank's row, e.g. "[pp0 dp1 tp0]".
void enable(const Comm& world, const std::string& label);

class Span {
 public:
  // `name` and `category` must outlive the trace (string literals).
  Span(const char* name, const char* category) : name_(name), category_(category) {
    if (enabled()) start_ = std::chrono::steady_clock::now(), on_ = true;
  }
  ~Span() {
    if (on_) detail::record(name_, category_, start_, std::chrono::steady_clock::now(), args_);
  }
  Span(const Span&) = delete;
  Span& operator=(const Span&) = delete;

  Span& arg(const char* key, int64_t value);
  Span& arg(const char* key, const std::string& value);

 private:
  const char* name_;
  const char* category_;
  bool on_ = false;
  std::chrono::steady_clock::time_point start_;
  std::string args_;  // JSON members, `"key": value, ...`
};

// Writes this rank's events to `dir`/rank<R>.json, then rank 0 gathers every rank's events over
// `world` into `merged` (one Chrome trace file). Collective; does nothing when tracing is off.
// Returns the number of events in the merged file on rank 0 (0 elsewhere).
size_t write(const Comm& world, const std::string& dir, const std::string& merged);

// A JSON string literal of `s`: quoted, with quotes, backslashes and control characters escaped.
// Every JSON titan3d writes by hand (traces, selfcheck reports, incidents) quotes through it.
std::string json_string(std::string_view s);

}  // namespace t3d::parallel::trace
