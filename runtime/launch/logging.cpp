#include "runtime/launch/logging.h"

#include <spdlog/sinks/basic_file_sink.h>
#include <spdlog/sinks/stdout_color_sinks.h>
#include <spdlog/spdlog.h>

#include <algorithm>
#include <cmath>
#include <cstdio>
#include <ctime>
#include <filesystem>

#include "parallel/trace.h"

namespace t3d::runtime {

void setup_logging(const std::string& label, const std::string& log_file, bool console,
                   const std::string& level) {
  std::vector<spdlog::sink_ptr> sinks;
  if (console) sinks.push_back(std::make_shared<spdlog::sinks::stdout_color_sink_mt>());
  if (!log_file.empty()) {
    std::filesystem::create_directories(std::filesystem::path(log_file).parent_path());
    sinks.push_back(std::make_shared<spdlog::sinks::basic_file_sink_mt>(log_file, true));
  }
  auto logger = std::make_shared<spdlog::logger>("titan3d", sinks.begin(), sinks.end());
  logger->set_pattern("%H:%M:%S.%e %^%L%$ " + label + " %v");
  logger->set_level(spdlog::level::from_str(level));
  logger->flush_on(spdlog::level::info);
  spdlog::set_default_logger(logger);
}

void append_incident(const std::string& run_dir, const std::string& fields) {
  const std::time_t now = std::time(nullptr);
  char stamp[32];
  std::strftime(stamp, sizeof(stamp), "%Y-%m-%dT%H:%M:%SZ", std::gmtime(&now));
  const std::string line =
      "{\"time\": " + parallel::trace::json_string(stamp) + ", " + fields + "}\n";
  std::FILE* f = std::fopen((run_dir + "/incidents.jsonl").c_str(), "a");
  if (!f) return;
  std::fwrite(line.data(), 1, line.size(), f);
  std::fclose(f);
}

std::string format_duration(double seconds) {
  const long s = std::lround(std::max(0.0, seconds));
  if (s >= 3600) return std::to_string(s / 3600) + "h" + std::to_string(s / 60 % 60) + "m";
  if (s >= 60) return std::to_string(s / 60) + "m" + std::to_string(s % 60) + "s";
  return std::to_string(s) + "s";
}

}  // namespace t3d::runtime
