// The GEMM algorithms of a GPU job (kernels/cuda/gemm_table.h): which cuBLASLt algorithm each
// linear layer's GEMM shape runs. Two algorithms sum in different orders, so the table decides a
// run's last bits as the GEMM kind does on a CPU, and it is handled the same way: measured once
// (rank 0, at the model's shapes on this layout), cached on the machine, given to every rank,
// recorded in gemm_choice.json and in every snapshot, and taken from the snapshot a run resumes.
// So every rank runs the same algorithm for a shape, and a resumed run the ones it ran before.
#pragma once

#include <string>
#include <vector>

#include "kernels/device.h"
#include "kernels/gemm.h"
#include "runtime/launch/job.h"

namespace t3d::runtime {

// The linear layers of this rank's stage on the recipe's layout, as GEMM sizes: rows of a
// micro-batch (over cp; sequence parallelism gathers them back), the attention projections, the
// SwiGLU MLP and the vocab-parallel head, each over tp. A mixture of experts' expert GEMMs (whose
// rows change every step) are left to cuBLASLt's heuristic.
std::vector<kernels::Device::LinearSize> linear_sizes(const Recipe& r);

struct GpuGemmTable {
  std::string text;    // kernels/cuda/gemm_table.h's form; "" where none is to be installed
  std::string source;  // "recorded in <snapshot>", "cached", "measured", or why none
};

// Collective over the job's world; only where rank 0's device is a GPU. Rank 0 takes the table
// recorded in `resumed_snapshot` (an index path, "" when not resuming), else the one cached for
// its GPU, cuBLASLt and the model's sizes, else measures one (and caches it), and broadcasts it.
GpuGemmTable choose_gpu_gemm_table(const Job& job, kernels::GemmKind kind,
                                   const std::string& resumed_snapshot);

}  // namespace t3d::runtime
