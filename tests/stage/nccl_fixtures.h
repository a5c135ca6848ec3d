// NCCL as the device-communicator choice sees it, for the tests of that choice (host logic): a
// loaded library and a missing one.
#pragma once

#include "parallel/nccl_library.h"

namespace t3d::runtime::testing {

inline parallel::NcclLibrary loaded_nccl() {
  parallel::NcclLibrary lib;
  lib.loaded = true;
  lib.path = "libnccl.so.2";
  lib.version = 22809;
  return lib;
}

inline parallel::NcclLibrary missing_nccl() {
  parallel::NcclLibrary lib;
  lib.why_not = "looked for T3D_NCCL_LIBRARY=/nowhere/libnccl.so.2: no such file";
  return lib;
}

}  // namespace t3d::runtime::testing
