#include "checkpoint/paths.h"

#include <fcntl.h>
#include <linux/openat2.h>
#include <sys/mman.h>
#include <sys/stat.h>
#include <sys/syscall.h>
#include <unistd.h>

#include <algorithm>
#include <cerrno>
#include <cstring>
#include <filesystem>
#include <utility>

#include "checkpoint/snapshot.h"
#include "kernels/check.h"

namespace t3d::checkpoint {

namespace fs = std::filesystem;

namespace {

// UserError unless `name` is a relative path of plain components (none empty, "." or "..", no NUL).
void require_plain_name(const std::string& dir, const std::string& name,
                        const std::string& source) {
  const fs::path p(name);
  bool plain = !name.empty() && p.is_relative() && name.find('\0') == std::string::npos;
  for (const auto& part : p) plain = plain && !part.empty() && part != "." && part != "..";
  T3D_USER_CHECK(plain, source, " names the file `", name, "`, which is not a plain relative path ",
                 "inside `", dir, "` (empty, absolute, or with `.` or `..` components): only ",
                 "files inside that directory are read. Fix the name.");
}

// Whether `target` (resolved) lies strictly inside `root` (resolved).
bool lies_inside(const fs::path& root, const fs::path& target) {
  const auto [r, t] = std::mismatch(root.begin(), root.end(), target.begin(), target.end());
  // weakly_canonical keeps a trailing empty component for a directory given with a slash.
  return (r == root.end() || (std::next(r) == root.end() && r->empty())) && t != target.end();
}

[[noreturn]] void refuse_outside(const std::string& dir, const std::string& full,
                                 const std::string& target, const std::string& source) {
  throw UserError(detail::concat(source, " names `", full, "`, which leads outside `", dir,
                                 "` (to `", target, "`, through a symbolic link): only files ",
                                 "inside that directory are read. Copy the file into the ",
                                 "directory (cp -L)."));
}

std::string descriptor_name(int fd) { return "/proc/self/fd/" + std::to_string(fd); }

// UserError unless the open of `full` (named by `source`) gave a descriptor; `err` its errno.
void require_opened(int fd, int err, const std::string& full, const std::string& source) {
  T3D_USER_CHECK(fd >= 0 || err != ENOENT, "`", full, "` (named by ", source, ") does not exist");
  T3D_USER_CHECK(fd >= 0, "cannot open `", full, "` (named by ", source, "): ", std::strerror(err));
}

}  // namespace

std::string path_inside(const std::string& dir, const std::string& name,
                        const std::string& source) {
  require_plain_name(dir, name, source);
  const fs::path full = fs::path(dir) / name;
  std::error_code ec_root, ec_full;
  const fs::path root = fs::weakly_canonical(dir, ec_root);
  const fs::path target = fs::weakly_canonical(full, ec_full);
  T3D_USER_CHECK(!ec_root && !ec_full, "cannot resolve `", full.string(), "` (named by ", source,
                 "): ", (ec_root ? ec_root : ec_full).message());
  if (!lies_inside(root, target)) refuse_outside(dir, full.string(), target.string(), source);
  return full.string();
}

ReadOnlyFile::ReadOnlyFile(int fd, std::string path, std::string what)
    : fd_(fd), path_(std::move(path)), what_(std::move(what)) {
  struct stat st {};
  if (::fstat(fd_, &st) != 0) {
    const int err = errno;
    ::close(fd_);
    throw UserError(detail::concat("cannot open ", what_, " `", path_, "`: ", std::strerror(err)));
  }
  if (!S_ISREG(st.st_mode)) {
    ::close(fd_);
    throw UserError(detail::concat(what_, " `", path_, "` is not a regular file (",
                                   S_ISDIR(st.st_mode)    ? "a directory"
                                   : S_ISFIFO(st.st_mode) ? "a FIFO"
                                   : S_ISCHR(st.st_mode) || S_ISBLK(st.st_mode)
                                       ? "a device"
                                       : "a socket or other special file",
                                   "); give a regular file"));
  }
  size_ = static_cast<uint64_t>(st.st_size);
  // Reads of a regular file never block anyway; cleared so that nothing depends on it.
  ::fcntl(fd_, F_SETFL, ::fcntl(fd_, F_GETFL) & ~O_NONBLOCK);
}

ReadOnlyFile ReadOnlyFile::open(const std::string& path, const std::string& what) {
  const int fd = ::open(path.c_str(), O_RDONLY | O_NONBLOCK | O_CLOEXEC | O_NOCTTY);
  T3D_USER_CHECK(fd >= 0 || errno != ENOENT, what, " `", path, "` does not exist; check the path");
  T3D_USER_CHECK(fd >= 0, "cannot open ", what, " `", path, "`: ", std::strerror(errno));
  return ReadOnlyFile(fd, path, what);
}

ReadOnlyFile ReadOnlyFile::open_inside(const std::string& dir, const std::string& name,
                                       const std::string& source) {
  require_plain_name(dir, name, source);
  const std::string full = (fs::path(dir) / name).string();
  const int dir_fd = ::open(dir.c_str(), O_PATH | O_DIRECTORY | O_CLOEXEC);
  T3D_USER_CHECK(dir_fd >= 0, "cannot open the directory `", dir, "` (of ", source,
                 "): ", std::strerror(errno));
  open_how how{};
  how.flags = O_RDONLY | O_NONBLOCK | O_CLOEXEC | O_NOCTTY;
  how.resolve = RESOLVE_BENEATH | RESOLVE_NO_MAGICLINKS;
  int fd = static_cast<int>(::syscall(SYS_openat2, dir_fd, name.c_str(), &how, sizeof how));
  int err = fd < 0 ? errno : 0;
  ::close(dir_fd);
  if (fd < 0 && (err == ENOSYS || err == EPERM))
    return open_inside_without_openat2(dir, name, source);
  if (fd < 0 && (err == EXDEV || err == ELOOP)) {
    path_inside(dir, name, source);  // names the target when it still leads outside
    refuse_outside(dir, full, "a path outside it", source);
  }
  require_opened(fd, err, full, source);
  return ReadOnlyFile(fd, full, "file");
}

ReadOnlyFile ReadOnlyFile::open_inside_without_openat2(const std::string& dir,
                                                       const std::string& name,
                                                       const std::string& source) {
  // The names are checked, the file opened, then the opened file's own path checked: a rename
  // between the first check and the open cannot make the descriptor's path lie.
  const std::string full = path_inside(dir, name, source);
  const int fd = ::open(full.c_str(), O_RDONLY | O_NONBLOCK | O_CLOEXEC | O_NOCTTY);
  require_opened(fd, fd < 0 ? errno : 0, full, source);
  std::error_code ec_root, ec_fd;
  const fs::path root = fs::weakly_canonical(dir, ec_root);
  const fs::path opened = fs::read_symlink(descriptor_name(fd), ec_fd);
  if (ec_root || ec_fd || !lies_inside(root, opened)) {
    ::close(fd);
    refuse_outside(dir, full, opened.string(), source);
  }
  return ReadOnlyFile(fd, full, "file");
}

ReadOnlyFile::ReadOnlyFile(ReadOnlyFile&& other) noexcept
    : fd_(std::exchange(other.fd_, -1)),
      path_(std::move(other.path_)),
      what_(std::move(other.what_)),
      size_(other.size_) {}

ReadOnlyFile& ReadOnlyFile::operator=(ReadOnlyFile&& other) noexcept {
  if (this != &other) {
    if (fd_ >= 0) ::close(fd_);
    fd_ = std::exchange(other.fd_, -1);
    path_ = std::move(other.path_);
    what_ = std::move(other.what_);
    size_ = other.size_;
  }
  return *this;
}

ReadOnlyFile::~ReadOnlyFile() {
  if (fd_ >= 0) ::close(fd_);
}

void ReadOnlyFile::read_at(uint64_t offset, void* out, size_t bytes) const {
  char* p = static_cast<char*>(out);
  while (bytes > 0) {
    const ssize_t n = ::pread(fd_, p, bytes, static_cast<off_t>(offset));
    if (n < 0 && errno == EINTR) continue;
    T3D_USER_CHECK(n >= 0, "cannot read ", what_, " `", path_, "`: ", std::strerror(errno));
    T3D_USER_CHECK(n > 0, "short read from ", what_, " `", path_, "`: it ends at byte ", offset,
                   ", before the ", bytes, " more bytes needed (truncated?)");
    p += n;
    offset += static_cast<uint64_t>(n);
    bytes -= static_cast<size_t>(n);
  }
}

std::string ReadOnlyFile::read_all() const {
  std::string bytes(static_cast<size_t>(size_), '\0');
  read_at(0, bytes.data(), bytes.size());
  return bytes;
}

std::shared_ptr<const std::byte> ReadOnlyFile::map() const {
  T3D_ASSERT(size_ > 0, "mapping the empty ", what_, " `", path_, "`");
  void* p = ::mmap(nullptr, size_, PROT_READ, MAP_SHARED, fd_, 0);
  T3D_USER_CHECK(p != MAP_FAILED, "cannot map ", what_, " `", path_, "` (", size_,
                 " bytes) into memory: ", std::strerror(errno));
  const size_t bytes = size_;
  return {static_cast<const std::byte*>(p),
          [bytes](const std::byte* q) { ::munmap(const_cast<std::byte*>(q), bytes); }};
}

std::string ReadOnlyFile::descriptor_path() const { return descriptor_name(fd_); }

bool ReadOnlyFile::deleted() const {
  struct stat st {};
  return ::fstat(fd_, &st) != 0 || st.st_nlink == 0;
}

std::string read_regular_file(const std::string& path, const std::string& what) {
  return ReadOnlyFile::open(path, what).read_all();
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
