#include "checkpoint/paths.h"

#include <sys/stat.h>

#include <algorithm>
#include <cerrno>
#include <cstring>
#include <filesystem>

#include "kernels/check.h"

namespace t3d::checkpoint {

namespace fs = std::filesystem;

std::string path_inside(const std::string& dir, const std::string& name,
                        const std::string& source) {
  const fs::path p(name);
  bool plain = !name.empty() && p.is_relative() && name.find('\0') == std::string::npos;
  for (const auto& part : p) plain = plain && !part.empty() && part != "." && part != "..";
  T3D_USER_CHECK(plain, source, " names the file `", name, "`, which is not a plain relative path ",
                 "inside `", dir, "` (empty, absolute, or with `.` or `..` components): only ",
                 "files inside that directory are read. Fix the name.");
  const fs::path full = fs::path(dir) / p;
  std::error_code ec_root, ec_full;
  const fs::path root = fs::weakly_canonical(dir, ec_root);
  const fs::path target = fs::weakly_canonical(full, ec_full);
  T3D_USER_CHECK(!ec_root && !ec_full, "cannot resolve `", full.string(), "` (named by ", source,
                 "): ", (ec_root ? ec_root : ec_full).message());
  const auto [r, t] = std::mismatch(root.begin(), root.end(), target.begin(), target.end());
  // weakly_canonical keeps a trailing empty component for a directory given with a slash.
  const bool inside =
      (r == root.end() || (std::next(r) == root.end() && r->empty())) && t != target.end();
  T3D_USER_CHECK(inside, source, " names `", full.string(), "`, which leads outside `", dir,
                 "` (to `", target.string(), "`, through a symbolic link): only files inside ",
                 "that directory are read. Copy the file into the directory (cp -L).");
  return full.string();
}

void require_regular_file(const std::string& path, const std::string& what) {
  struct stat st {};
  T3D_USER_CHECK(::stat(path.c_str(), &st) == 0, "cannot open ", what, " `", path,
                 "`: ", std::strerror(errno));
  T3D_USER_CHECK(S_ISREG(st.st_mode), what, " `", path, "` is not a regular file (",
                 S_ISDIR(st.st_mode)                          ? "a directory"
                 : S_ISFIFO(st.st_mode)                       ? "a FIFO"
                 : S_ISCHR(st.st_mode) || S_ISBLK(st.st_mode) ? "a device"
                                                              : "a socket or other special file",
                 "); give a regular file");
}

}  // namespace t3d::checkpoint
