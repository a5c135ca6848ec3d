// The pipeline schedules titan3d runs and their names (the recipe's parallel.schedule, `plan
// --schedule`). Header-only and free of MPI, so that the recipe parses into this type directly.
#pragma once

#include <array>
#include <string_view>
#include <utility>

namespace t3d::parallel {

enum class ScheduleKind { kGPipe, k1F1B, kInterleaved1F1B, kZBH1, kZBV };

inline constexpr std::array<std::pair<ScheduleKind, std::string_view>, 5> kScheduleKindNames = {{
    {ScheduleKind::kGPipe, "gpipe"},
    {ScheduleKind::k1F1B, "1f1b"},
    {ScheduleKind::kInterleaved1F1B, "interleaved_1f1b"},
    {ScheduleKind::kZBH1, "zb_h1"},
    {ScheduleKind::kZBV, "zb_v"},
}};

constexpr std::string_view to_string(ScheduleKind kind) {
  for (const auto& [k, name] : kScheduleKindNames)
    if (k == kind) return name;
  return "?";
}

}  // namespace t3d::parallel
