#include "runtime/train/metrics.h"

#include <sys/stat.h>
#include <unistd.h>

#include <cerrno>
#include <cmath>
#include <cstring>

#include "kernels/check.h"

namespace t3d::runtime {

MetricsWriter::MetricsWriter(const std::string& path, bool append)
    : path_(path), file_(std::fopen(path.c_str(), append ? "a" : "w")) {
  T3D_USER_CHECK(file_, "cannot open metrics file `", path, "` for writing (run.dir)");
}

MetricsWriter::~MetricsWriter() {
  if (file_) std::fclose(file_);
}

void MetricsWriter::write(const std::vector<std::pair<std::string, double>>& fields) {
  if (!file_) return;
  struct stat st {};
  const off_t start = ::fstat(fileno(file_), &st) == 0 ? st.st_size : -1;
  std::fputc('{', file_);
  for (size_t i = 0; i < fields.size(); ++i) {
    const auto& [key, value] = fields[i];
    std::fprintf(file_, "%s\"%s\": ", i ? ", " : "", key.c_str());
    if (!std::isfinite(value))
      std::fputs("null", file_);
    else if (value == std::floor(value) && std::fabs(value) < 1e15)
      std::fprintf(file_, "%.0f", value);
    else
      std::fprintf(file_, "%.9g", value);
  }
  std::fputs("}\n", file_);
  const bool failed = std::fflush(file_) != 0 || std::ferror(file_);
  const int err = errno;
  if (failed) {  // no half line stays behind for a resumed run to append after
    std::fclose(file_);
    file_ = nullptr;
    [[maybe_unused]] const int cut = start >= 0 ? ::truncate(path_.c_str(), start) : 0;
  }
  T3D_USER_CHECK(!failed, "cannot write the metrics file `", path_, "`: ", std::strerror(err),
                 "; the run stops rather than lose its metrics. Free space in the run directory "
                 "(run.dir) and resume from the last snapshot.");
}

}  // namespace t3d::runtime
