// Shared by the selfcheck sources: how one rank's verdict on a check becomes one agreed row.
#pragma once

#include <string>

#include "parallel/comm.h"
#include "runtime/selfcheck/selfcheck.h"

namespace t3d::runtime::selfcheck {

// One rank's finding. `blame` is the world rank at fault when this rank can tell (-1: itself or
// nobody in particular); `what` says what was wrong.
struct Verdict {
  bool ok = true;
  int blame = -1;
  std::string what;
  void fail(std::string why, int culprit = -1) {
    if (!ok) return;  // the first finding is the one reported
    ok = false, what = std::move(why), blame = culprit;
  }
};

// Gathers every rank's verdict over `world` into one row: OK with `ok_detail`, or FAILED (or
// `on_failure`) with the distinct findings and the ranks to blame. Collective.
CheckRow agree_row(const parallel::Comm& world, std::string check, std::string group,
                   std::string scope, const Verdict& mine, const std::string& ok_detail,
                   CheckStatus on_failure = CheckStatus::failed);

// The model-level checks (selfcheck_model.cpp): rows appended to `rows`.
void check_replicas(const Job& job, std::vector<CheckRow>& rows);
void check_gemm(const Job& job, bool quick, std::vector<CheckRow>& rows);
void check_memory(const Job& job, std::vector<CheckRow>& rows);
// A mixture of experts whose run directory holds a metrics.jsonl (a run trained or under way):
// WARN for each MoE layer the idle-expert rule (runtime/model/expert_idle.h) flags at its last
// step. No row without such a file.
void check_idle_experts(const Job& job, std::vector<CheckRow>& rows);
void host_map(const Job& job, std::vector<CheckRow>& rows);

std::string bytes_label(double bytes);  // "64 MiB"

}  // namespace t3d::runtime::selfcheck
