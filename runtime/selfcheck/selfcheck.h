// `titan3d selfcheck`: is this world fit to train the recipe? Per group of the recipe's mesh (tp,
// dp, pp, cp, world) it checks the collectives and the pipeline's point-to-point traffic on inputs
// each rank can verify by itself, that the model built from the seed is identical on every dp
// replica and that its tp shards reassemble to the single-rank tensors, and it measures what makes
// a rank or a group slow: bandwidth per group and message size (algbw / busbw as nccl-tests
// defines them, docs/selfcheck.md), GEMM speed per rank at the model's shapes, and the planned
// memory against the arena; each rank's device opens, and a GPU's GEMM and copy rates are
// measured against its datasheet; on GPUs each tensor group's device communicator, the one
// training chooses (NCCL or staged), is named and its bandwidth measured on device memory. A host
// map says where each rank runs. For a mixture of experts
// whose run directory has metrics, it also flags layers whose experts went idle.
//
// Every rank takes part; every row is agreed over the world, so all ranks know the verdict and
// exit alike. A failing row names the ranks to blame where the check can tell them apart.
#pragma once

#include <string>
#include <vector>

#include "runtime/launch/job.h"

namespace t3d::runtime {

struct SelfcheckOptions {
  bool quick = false;  // fewer message sizes and iterations (tests)
};

enum class CheckStatus { ok, warn, failed, info };
const char* status_name(CheckStatus s);

struct CheckRow {
  std::string check;  // all_reduce, all_gather, reduce_scatter, broadcast, p2p, replica,
                      // bandwidth, gemm, device, device_comm, memory, experts, host
  std::string group;  // tp, dp, pp, cp, world, run (the run directory's metrics), or "rank N" /
                      // "stage N" for per-rank rows
  std::string scope;  // which groups or which message size, e.g. "4 groups × 2"
  CheckStatus status = CheckStatus::ok;
  std::string detail;
  std::vector<int> culprits;  // world ranks to blame (failed and warn rows)
};

struct SelfcheckReport {
  int world = 0;
  std::string mesh;  // "pp=2 dp=2 cp=1 tp=2"
  std::vector<CheckRow> rows;

  bool ok() const;  // no failed row
  int warnings() const;
  std::string table() const;  // the table and its OK / FAILED footer
  std::string json() const;   // the same as one JSON object
};

// Collective over the job's world. The report is complete on every rank.
SelfcheckReport run_selfcheck(const Job& job, const SelfcheckOptions& options);

}  // namespace t3d::runtime
