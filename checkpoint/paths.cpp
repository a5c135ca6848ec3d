#include "checkpoint/paths.h"

#include <fcntl.h>
#include <sys/stat.h>
#include <unistd.h>

#include <algorithm>
#include <cerrno>
#include <cstring>
#include <filesystem>
#include <fstream>

#include "checkpoint/snapshot.h"
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

std::string read_regular_file(const std::string& path, const std::string& what) {
  std::error_code ec;
  T3D_USER_CHECK(std::filesystem::exists(path, ec), what, " `", path,
                 "` does not exist; check the path");
  require_regular_file(path, what);
  std::ifstream in(path, std::ios::binary);
  T3D_USER_CHECK(in.good(), "cannot open ", what, " `", path, "`; check permissions");
  const auto size = static_cast<std::streamsize>(std::filesystem::file_size(path));
  std::string bytes(static_cast<size_t>(size), '\0');
  in.read(bytes.data(), size);
  T3D_USER_CHECK(in.gcount() == size, "short read from ", what, " `", path, "` (got ", in.gcount(),
                 " of ", size, " bytes)");
  return bytes;
}

AtomicFile::AtomicFile(std::string path, std::string what)
    : path_(std::move(path)), tmp_(temp_path(path_)), what_(std::move(what)) {
  fd_ = ::open(tmp_.c_str(), O_WRONLY | O_CREAT | O_TRUNC | O_CLOEXEC, 0644);
  if (fd_ < 0) fail("create", errno);
}

AtomicFile::~AtomicFile() {
  if (fd_ >= 0) ::close(fd_);
  if (!tmp_.empty()) ::unlink(tmp_.c_str());
}

void AtomicFile::fail(const char* doing, int err) {
  if (fd_ >= 0) ::close(fd_);
  fd_ = -1;
  ::unlink(tmp_.c_str());
  tmp_.clear();
  throw UserError(detail::concat(
      "cannot ", doing, " `", path_, "` (", what_, "): ", std::strerror(err),
      err == ENOSPC || err == EDQUOT ? "; nothing was written. Free space there or choose "
                                       "another path."
                                     : "; nothing was written."));
}

void AtomicFile::write(const void* data, size_t bytes) {
  const char* p = static_cast<const char*>(data);
  while (bytes > 0) {
    const ssize_t n = ::write(fd_, p, bytes);
    if (n < 0 && errno == EINTR) continue;
    if (n <= 0) fail("write", n < 0 ? errno : EIO);
    p += n;
    bytes -= static_cast<size_t>(n);
  }
}

void AtomicFile::commit() {
  const int fd = fd_;
  fd_ = -1;
  if (::close(fd) != 0) fail("write", errno);
  if (::rename(tmp_.c_str(), path_.c_str()) != 0) fail("rename into", errno);
  tmp_.clear();
}

void write_file_atomically(const std::string& path, std::string_view text,
                           const std::string& what) {
  AtomicFile f(path, what);
  f.write(text.data(), text.size());
  f.commit();
}

}  // namespace t3d::checkpoint
