// Paths that come out of files (a snapshot index's shard and parent names, a safetensors index's
// weight map) are data, not trusted input: a file may name only files inside its own directory,
// and only regular files are read, so that a hostile name can neither read nor leak a file
// elsewhere, and a FIFO or device can neither block a read nor make it endless.
#pragma once

#include <string>

namespace t3d::checkpoint {

// `dir`/`name` when `name` is a relative path of plain components (none empty, "." or "..", no
// NUL) whose target, symlinks resolved, lies inside `dir` (itself resolved). UserError naming
// `source` (the file or key that gave the name), the name and what is wrong otherwise.
std::string path_inside(const std::string& dir, const std::string& name, const std::string& source);

// UserError naming `what` and `path` unless `path` is a regular file (symlinks followed): a
// directory, FIFO, device or socket is refused before anything opens it. Uses stat only, which
// never blocks.
void require_regular_file(const std::string& path, const std::string& what);

}  // namespace t3d::checkpoint
