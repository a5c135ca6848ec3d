// metrics.jsonl: one JSON object per line, written by rank 0 into the run directory, flushed per
// line so a crashed run keeps what it logged. A line that cannot be written (a full disk) is a
// UserError naming the file: a run does not go on losing its metrics silently.
#pragma once

#include <cstdio>
#include <string>
#include <utility>
#include <vector>

namespace t3d::runtime {

class MetricsWriter {
 public:
  MetricsWriter() = default;
  // A resumed run appends to its run's file; a fresh one starts it anew. UserError if it cannot
  // be opened.
  MetricsWriter(const std::string& path, bool append);
  ~MetricsWriter();
  MetricsWriter(const MetricsWriter&) = delete;
  MetricsWriter& operator=(const MetricsWriter&) = delete;

  // Fields in the given order; numbers printed with full precision, non-finite as null. Flushed
  // and checked: UserError naming the file when the line did not reach it.
  void write(const std::vector<std::pair<std::string, double>>& fields);

 private:
  std::string path_;
  std::FILE* file_ = nullptr;
};

}  // namespace t3d::runtime
