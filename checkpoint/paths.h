// Paths that come out of files (a snapshot index's shard and parent names, a safetensors index's
// weight map) are data, not trusted input: a file may name only files inside its own directory,
// and only regular files are read, so that a hostile name can neither read nor leak a file
// elsewhere, and a FIFO or device can neither block a read nor make it endless. Every check is
// made on the open descriptor that is then read (ReadOnlyFile), never on a name that is opened
// again afterwards, so replacing a file, or a directory on its path, between the check and the
// read changes nothing.
//
// Files titan3d writes for the user (exports, imports, token files, tokenizer models, JSON
// results) are written whole or not at all: see AtomicFile.
#pragma once

#include <cstddef>
#include <cstdint>
#include <memory>
#include <string>
#include <string_view>

namespace t3d::checkpoint {

// `dir`/`name` when `name` is a relative path of plain components (none empty, "." or "..", no
// NUL) whose target, symlinks resolved, lies inside `dir` (itself resolved). UserError naming
// `source` (the file or key that gave the name), the name and what is wrong otherwise.
std::string path_inside(const std::string& dir, const std::string& name, const std::string& source);

// A regular file open for reading, checked on its descriptor (fstat): what was checked is what is
// read. Opening never blocks (O_NONBLOCK until the descriptor is known to be a regular file), so a
// FIFO or device is refused, not waited on. Move-only; the descriptor closes with it.
class ReadOnlyFile {
 public:
  // `path` (symlinks followed); UserError naming `what` and `path` when it is missing, unreadable
  // or not a regular file (a directory, FIFO, device or socket).
  static ReadOnlyFile open(const std::string& path, const std::string& what);
  // `dir`/`name` under path_inside's rules, resolved by the kernel beneath `dir` (openat2 with
  // RESOLVE_BENEATH): a name that leads outside `dir` is refused before any file outside is
  // opened. Where the kernel lacks openat2, the names are checked (path_inside), the file is
  // opened, and the descriptor's own path is checked to lie inside `dir`.
  static ReadOnlyFile open_inside(const std::string& dir, const std::string& name,
                                  const std::string& source);
  // open_inside's way where the kernel lacks openat2 (public for its test).
  static ReadOnlyFile open_inside_without_openat2(const std::string& dir, const std::string& name,
                                                  const std::string& source);

  ReadOnlyFile(ReadOnlyFile&& other) noexcept;
  ReadOnlyFile& operator=(ReadOnlyFile&& other) noexcept;
  ReadOnlyFile(const ReadOnlyFile&) = delete;
  ReadOnlyFile& operator=(const ReadOnlyFile&) = delete;
  ~ReadOnlyFile();

  const std::string& path() const { return path_; }
  uint64_t size() const { return size_; }
  // `bytes` from `offset`; UserError naming the file when the file ends first or a read fails.
  void read_at(uint64_t offset, void* out, size_t bytes) const;
  std::string read_all() const;
  // The whole file mapped read-only (size() bytes, size() > 0): its pages come from the page
  // cache, shared by every process mapping the file, and stay mapped after this ReadOnlyFile
  // closes, as long as the pointer lives. A file truncated in place while mapped makes a read
  // past its new end fault (SIGBUS): replace such files by renaming (AtomicFile), never in place.
  std::shared_ptr<const std::byte> map() const;
  // A name that opens this very file (/proc/self/fd/N), for libraries that open by name (HDF5):
  // the file behind the descriptor, whatever now lies at path().
  std::string descriptor_path() const;
  // Whether the file has no name left (deleted, or another file renamed over it).
  bool deleted() const;

 private:
  ReadOnlyFile(int fd, std::string path, std::string what);
  int fd_ = -1;
  std::string path_, what_;
  uint64_t size_ = 0;
};

// The whole of regular file `path` (ReadOnlyFile::open); UserErrors name `what` and path.
std::string read_regular_file(const std::string& path, const std::string& what);

// A file written whole or not at all: bytes go to temp_path(path) (path + ".tmp"), every write
// and the close are checked, and commit() renames it to `path`. On any failure, and when the
// writer is destroyed uncommitted (an exception on the way), the temporary is removed, so a full
// disk leaves nothing partial behind. Errors are UserErrors naming the file, `what` (the option or
// key that chose it) and the system's reason ("No space left on device").
class AtomicFile {
 public:
  AtomicFile(std::string path, std::string what);
  ~AtomicFile();
  AtomicFile(const AtomicFile&) = delete;
  AtomicFile& operator=(const AtomicFile&) = delete;
  void write(const void* data, size_t bytes);
  void commit();

 private:
  [[noreturn]] void fail(const char* doing, int err);
  std::string path_, tmp_, what_;
  int fd_ = -1;
};

// AtomicFile of `text`.
void write_file_atomically(const std::string& path, std::string_view text, const std::string& what);

}  // namespace t3d::checkpoint
