// Paths that come out of files (a snapshot index's shard and parent names, a safetensors index's
// weight map) are data, not trusted input: a file may name only files inside its own directory,
// and only regular files are read, so that a hostile name can neither read nor leak a file
// elsewhere, and a FIFO or device can neither block a read nor make it endless.
//
// Files titan3d writes for the user (exports, imports, token files, tokenizer models, JSON
// results) are written whole or not at all: see AtomicFile.
#pragma once

#include <cstddef>
#include <string>
#include <string_view>

namespace t3d::checkpoint {

// `dir`/`name` when `name` is a relative path of plain components (none empty, "." or "..", no
// NUL) whose target, symlinks resolved, lies inside `dir` (itself resolved). UserError naming
// `source` (the file or key that gave the name), the name and what is wrong otherwise.
std::string path_inside(const std::string& dir, const std::string& name, const std::string& source);

// UserError naming `what` and `path` unless `path` is a regular file (symlinks followed): a
// directory, FIFO, device or socket is refused before anything opens it. Uses stat only, which
// never blocks.
void require_regular_file(const std::string& path, const std::string& what);
// The whole of regular file `path` (require_regular_file first); UserErrors name `what` and path.
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
