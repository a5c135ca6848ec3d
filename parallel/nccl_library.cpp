#include "parallel/nccl_library.h"

#include <dlfcn.h>

#include <cstdlib>
#include <string>

#include "kernels/check.h"
#ifdef T3D_HAVE_NCCL
#include "parallel/nccl_api.h"
#endif

namespace t3d::parallel {

namespace {

constexpr const char* kSoname = "libnccl.so.2";

#ifdef T3D_HAVE_NCCL
// Resolves every function of NcclApi from `handle`; the name of the first missing one, else "".
std::string resolve(void* handle, NcclApi& api) {
  std::string missing;
  const auto get = [&](auto& fn, const char* name) {
    fn = reinterpret_cast<std::remove_reference_t<decltype(fn)>>(dlsym(handle, name));
    if (!fn && missing.empty()) missing = name;
  };
  get(api.get_version, "ncclGetVersion");
  get(api.error_string, "ncclGetErrorString");
  get(api.get_unique_id, "ncclGetUniqueId");
  get(api.comm_init_rank, "ncclCommInitRank");
  get(api.comm_destroy, "ncclCommDestroy");
  get(api.comm_abort, "ncclCommAbort");
  get(api.comm_get_async_error, "ncclCommGetAsyncError");
  get(api.all_reduce, "ncclAllReduce");
  get(api.all_gather, "ncclAllGather");
  get(api.reduce_scatter, "ncclReduceScatter");
  get(api.reduce, "ncclReduce");
  get(api.broadcast, "ncclBroadcast");
  get(api.send, "ncclSend");
  get(api.recv, "ncclRecv");
  get(api.group_start, "ncclGroupStart");
  get(api.group_end, "ncclGroupEnd");
  return missing;
}

// Loads and resolves; the handle stays open for the process's life (NCCL's threads use it).
NcclLibrary load(const char* env_path, NcclApi& api) {
  NcclLibrary lib;
  const bool from_env = env_path && *env_path;
  lib.path = from_env ? env_path : kSoname;
  const std::string where =
      from_env ? "T3D_NCCL_LIBRARY=" + lib.path
               : std::string(kSoname) +
                     " on the loader's path (LD_LIBRARY_PATH; T3D_NCCL_LIBRARY unset)";
  void* handle = dlopen(lib.path.c_str(), RTLD_NOW | RTLD_LOCAL);
  if (!handle) {
    const char* err = dlerror();
    lib.why_not = "looked for " + where + ": " + (err ? err : "not found");
    return lib;
  }
  const std::string missing = resolve(handle, api);
  if (!missing.empty()) {
    lib.why_not = where + " lacks " + missing;
    return lib;
  }
  if (api.get_version(&lib.version) != ncclSuccess) {
    lib.why_not = where + ": ncclGetVersion failed";
    return lib;
  }
  // bf16 reductions (ncclBfloat16) came with NCCL 2.10; every other function titan3d calls is
  // older.
  if (lib.version < 21000) {
    lib.why_not = where + " is NCCL " + lib.version_name() + ", older than 2.10 (bf16)";
    return lib;
  }
  lib.loaded = true;
  return lib;
}

NcclApi g_api;
#endif

}  // namespace

std::string NcclLibrary::version_name() const { return nccl_version_name(version); }

std::string nccl_version_name(int v) {
  // NCCL_VERSION(X, Y, Z) = X·10000 + Y·100 + Z since 2.9 (before: X·1000 + Y·100 + Z).
  if (v >= 20900)
    return std::to_string(v / 10000) + "." + std::to_string(v / 100 % 100) + "." +
           std::to_string(v % 100);
  return std::to_string(v / 1000) + "." + std::to_string(v / 100 % 10) + "." +
         std::to_string(v % 100);
}

NcclLibrary load_nccl_library(const char* env_path) {
#ifdef T3D_HAVE_NCCL
  NcclApi api;
  return load(env_path, api);
#else
  (void)env_path;
  NcclLibrary lib;
  lib.why_not =
      "this titan3d was built without NCCL's header (no CUDA toolkit with nccl.h at "
      "configure time)";
  return lib;
#endif
}

const NcclLibrary& nccl_library() {
#ifdef T3D_HAVE_NCCL
  static const NcclLibrary lib = load(std::getenv("T3D_NCCL_LIBRARY"), g_api);
#else
  static const NcclLibrary lib = load_nccl_library(nullptr);
#endif
  return lib;
}

#ifdef T3D_HAVE_NCCL
const NcclApi& nccl_api() {
  T3D_ASSERT(nccl_library().loaded, "NCCL used where it did not load: ", nccl_library().why_not);
  return g_api;
}
#endif

}  // namespace t3d::parallel
