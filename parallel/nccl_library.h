// NCCL, loaded at run time (dlopen), never linked: the library is too large to travel with the
// binary, and GPU machines carry their own (PyTorch's wheel brings one). Where it is looked for,
// in order: the file T3D_NCCL_LIBRARY names, else "libnccl.so.2" through the dynamic loader's
// search (LD_LIBRARY_PATH, the system's directories). The build takes NCCL's types from the CUDA
// toolkit's nccl.h (T3D_HAVE_NCCL); a build without it never loads NCCL.
#pragma once

#include <string>

namespace t3d::parallel {

struct NcclLibrary {
  bool loaded = false;
  std::string path;     // the file opened (T3D_NCCL_LIBRARY's, or "libnccl.so.2")
  int version = 0;      // ncclGetVersion's code, e.g. 22809
  std::string why_not;  // when not loaded: where it looked and what failed
  // "2.28.9" from the version code.
  std::string version_name() const;
};

// "2.28.9" from an ncclGetVersion code (22809; before 2.9, 2708 for 2.7.8).
std::string nccl_version_name(int code);

// The process's NCCL, loaded on the first call (thread-safe) and kept for the process's life.
const NcclLibrary& nccl_library();

// One load attempt from `env_path` (T3D_NCCL_LIBRARY's value; null or empty: "libnccl.so.2"),
// for the tests; it does not replace the process's library.
NcclLibrary load_nccl_library(const char* env_path);

}  // namespace t3d::parallel
