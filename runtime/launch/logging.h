// Rank-prefixed logging (spdlog): every rank writes its own file in the run directory; rank 0
// also speaks to the console (llm.c's printf0), so N ranks do not print N copies.
#pragma once

#include <string>

namespace t3d::runtime {

// label: "[pp0 dp1 tp0]"; log_file: empty for none.
void setup_logging(const std::string& label, const std::string& log_file, bool console,
                   const std::string& level);

}  // namespace t3d::runtime
