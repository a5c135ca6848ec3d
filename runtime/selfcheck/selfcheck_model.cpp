// The selfcheck rows that need the model or the machine: replica consistency, memory plan, idle
// experts of a run, GEMM speed per rank, host map (see selfcheck.h).
#include <fmt/format.h>

#include <algorithm>
#include <cmath>
#include <cstring>
#include <fstream>
#include <thread>

#include "kernels/arena.h"
#include "kernels/blas.h"
#include "kernels/check.h"
#include "kernels/gemm.h"
#include "kernels/hash.h"
#include "parallel/pipeline_split.h"
#include "runtime/cost/planner.h"
#include "runtime/machine/machine.h"
#include "runtime/model/expert_idle.h"
#include "runtime/model/model.h"
#include "runtime/selfcheck/selfcheck_internal.h"
#include "runtime/stage/stage.h"

namespace t3d::runtime::selfcheck {

using parallel::Dim;
using parallel::ReduceOp;

namespace {

using kernels::splitmix64;

// Order-independent checksum of a (part of a) global tensor: a sum over its elements of a hash of
// (global index, bits). The tp shards' sums add up to the whole tensor's, so shards are compared
// with the single-rank tensor without moving any tensor.
struct Slice {
  int64_t rows, cols, row0, col0, global_cols;  // 1-D tensors: rows = 1, cols = numel
};
uint64_t checksum(const float* data, const Slice& s, int64_t data_ld, int64_t data_row0,
                  int64_t data_col0) {
  uint64_t sum = 0;
  for (int64_t r = 0; r < s.rows; ++r)
    for (int64_t c = 0; c < s.cols; ++c) {
      uint32_t bits;
      std::memcpy(&bits, &data[(s.row0 - data_row0 + r) * data_ld + (s.col0 - data_col0 + c)], 4);
      const uint64_t g = static_cast<uint64_t>((s.row0 + r) * s.global_cols + s.col0 + c);
      sum += splitmix64(g ^ splitmix64(bits + 0x51ull));
    }
  return sum;
}

// This rank's layer ranges, placed as training places them.
std::vector<parallel::LayerRange> stage_chunks(const Job& job) {
  const auto& r = job.recipe;
  const auto schedule = stage_schedule(r, job.mesh->shape().size(Dim::pp));
  return stage_layers(r.model, r.parallel.pipeline_split, schedule, job.mesh->coord().pp);
}

}  // namespace

void check_replicas(const Job& job, std::vector<CheckRow>& rows) {
  const auto& mesh = *job.mesh;
  const auto& world = mesh.world();
  const auto& r = job.recipe;
  const auto& tp = mesh.group(Dim::tp);
  // A one-rank "tp group" builds the unsharded stage: the reference the shards must match.
  const parallel::Comm self = world.split(world.rank(), 0, "self");
  Verdict v;
  std::vector<uint64_t> shard_sums, full_sums;  // per tensor
  std::vector<std::string> names;
  std::vector<int> split;
  try {
    // Not build_stage: the check needs two Models of this stage, the tp-sharded one and an
    // unsharded reference over a one-rank group; both take the stage's chunks and options.
    const auto chunks = stage_chunks(job);
    const ModelOptions options =
        model_options(r, job.precision(), StagePurpose::kForward, 1, nullptr, nullptr);
    const size_t capacity = static_cast<size_t>(r.hardware.hbm_gib * double(1ull << 30));
    kernels::Arena arena(capacity), ref_arena(capacity * static_cast<size_t>(tp.size()));
    Model model(r.model, chunks, tp, arena, options);
    Model ref(r.model, chunks, self, ref_arena, options);
    model.init(static_cast<uint64_t>(r.train.seed));
    ref.init(static_cast<uint64_t>(r.train.seed));
    std::vector<float> mine, full;  // host copies of the tensor being compared
    const auto to_host = [](Model& m, const std::string& name, std::vector<float>& out) {
      const auto& e = m.layout().at(name);
      out.resize(static_cast<size_t>(e.numel));
      kernels::copy_to_host(m.exec(), out.data(), m.state().params.data() + e.offset,
                            out.size() * sizeof(float));
      return out.data();
    };
    for (const auto& p : model.params()) {
      to_host(model, p.name, mine);
      to_host(ref, p.name, full);
      const bool matrix = p.global_shape.size() == 2;
      const int64_t grows = matrix ? p.global_shape[0] : 1;
      const int64_t gcols = matrix ? p.global_shape[1] : p.global_shape[0];
      const TensorBox box = tp_shard_box(p, tp.size(), tp.rank());
      Slice s{matrix ? box.shape[0] : 1, matrix ? box.shape[1] : box.shape[0],
              matrix ? box.offset[0] : 0, matrix ? box.offset[1] : box.offset[0], gcols};
      const uint64_t held = checksum(mine.data(), s, s.cols, s.row0, s.col0);
      if (held != checksum(full.data(), s, gcols, 0, 0))
        v.fail(fmt::format("its tp shard {} of `{}` differs from the single-rank tensor", tp.rank(),
                           p.name));
      names.push_back(p.name);
      split.push_back(p.split_dim);
      shard_sums.push_back(held);
      full_sums.push_back(checksum(full.data(), Slice{grows, gcols, 0, 0, gcols}, gcols, 0, 0));
    }
  } catch (const std::exception& e) {
    v.fail(std::string("cannot build the model: ") + e.what());
  }
  // Every rank of a stage holds the same tensors, so the vectors below line up across tp and dp
  // (a rank that failed to build sends zeros and is already reported).
  int64_t count = static_cast<int64_t>(names.size()), most = count;
  world.all_reduce(&most, 1, ReduceOp::max);
  shard_sums.resize(most), full_sums.resize(most), split.resize(most, -1);
  std::vector<uint64_t> gathered(most * tp.size());
  tp.all_gather(shard_sums.data(), gathered.data(), most);
  for (int64_t i = 0; i < count && v.ok; ++i) {
    uint64_t sum = 0;
    for (int t = 0; t < tp.size(); ++t) sum += gathered[t * most + i];
    if (split[i] >= 0 && sum != full_sums[i])
      v.fail(fmt::format("the tp shards of `{}` do not reassemble to the single-rank tensor",
                         names[i]));
  }
  const auto& dp = mesh.group(Dim::dp);
  uint64_t digest = 0;
  for (int64_t i = 0; i < most; ++i) digest = splitmix64(digest ^ shard_sums[i]);
  std::vector<uint64_t> replicas(dp.size());
  dp.all_gather(&digest, replicas.data(), 1);
  for (int d = 0; d < dp.size() && v.ok; ++d)
    if (replicas[d] != digest)
      v.fail(fmt::format("its parameters differ from the dp replica on world rank {}",
                         dp.world_ranks()[d]));
  int64_t tensors = count;
  world.all_reduce(&tensors, 1);
  rows.push_back(agree_row(world, "replica", "dp, tp", fmt::format("{} shards", tensors), v,
                           "dp replicas identical; tp shards reassemble to the 1-rank tensors"));
}

void check_memory(const Job& job, std::vector<CheckRow>& rows) {
  const auto& world = job.mesh->world();
  const auto& r = job.recipe;
  const double capacity = r.hardware.hbm_gib * double(1ull << 30);
  Verdict v;
  double planned = 0;
  try {
    const RecipePlan plan = plan_of_recipe(r);
    planned = stage_memory(plan.problem, plan.layout, plan.schedule, job.mesh->coord().pp).total();
    if (planned > capacity)
      v.fail(
          fmt::format("stage {} plans {:.3f} GiB, more than hardware.hbm_gib = {:g}: raise it, "
                      "or see `titan3d plan` for a layout that fits",
                      job.mesh->coord().pp, planned / (1ull << 30), r.hardware.hbm_gib));
  } catch (const std::exception& e) {
    v.fail(std::string("no memory plan: ") + e.what());
  }
  world.all_reduce(&planned, 1, ReduceOp::max);
  rows.push_back(agree_row(world, "memory", "world", "largest stage", v,
                           fmt::format("planned {:.3f} GiB of {:g} GiB arena (hardware.hbm_gib)",
                                       planned / (1ull << 30), r.hardware.hbm_gib)));
}

void check_idle_experts(const Job& job, std::vector<CheckRow>& rows) {
  const auto& world = job.mesh->world();
  const auto& m = job.recipe.model;
  if (!m.moe()) return;
  // Rank 0 reads the file and decides; the others take its row (a fixed-size message).
  struct Wire {
    int32_t present = 0, warn = 0;
    char scope[64] = {}, detail[960] = {};
  } w;
  const std::string path = job.run_dir + "/metrics.jsonl";
  if (world.rank() == 0) {
    std::ifstream in(path);
    if (in) {
      std::vector<int64_t> layers;
      for (int64_t l = 0; l < m.n_layers; ++l)
        if (m.moe_block(l)) layers.push_back(l);
      IdleExpertWatch watch;
      std::string line;
      int64_t steps = 0, last = 0;
      // A number after `"key": ` in a line, or `otherwise` (metrics.h writes flat objects).
      const auto number = [&](const std::string& key, double otherwise) {
        const std::string quoted = "\"" + key + "\": ";
        const size_t at = line.find(quoted);
        return at == std::string::npos ? otherwise : std::atof(line.c_str() + at + quoted.size());
      };
      while (std::getline(in, line)) {
        const double step = number("step", -1);
        if (step < 0) continue;
        last = static_cast<int64_t>(step);
        std::vector<double> idle(layers.size());
        for (size_t i = 0; i < layers.size(); ++i) idle[i] = number(idle_field(layers[i]), 0);
        watch.step(last, layers, idle);
        ++steps;
      }
      const auto flagged = watch.flagged();
      w.present = 1;
      w.warn = flagged.empty() ? 0 : 1;
      const std::string detail =
          flagged.empty()
              ? fmt::format("no MoE layer had idle experts in {} consecutive steps up to step {}",
                            kIdleExpertSteps, last)
              : IdleExpertWatch::describe(flagged);
      std::strncpy(w.scope, fmt::format("{} steps", steps).c_str(), sizeof(w.scope) - 1);
      std::strncpy(w.detail, detail.c_str(), sizeof(w.detail) - 1);
    }
  }
  world.broadcast(reinterpret_cast<char*>(&w), sizeof(w), 0);
  if (!w.present) return;
  rows.push_back(CheckRow{
      "experts", "run", w.scope, w.warn ? CheckStatus::warn : CheckStatus::ok, w.detail, {}});
}

void check_gemm(const Job& job, bool quick, std::vector<CheckRow>& rows) {
  const auto& mesh = *job.mesh;
  const auto& world = mesh.world();
  const auto& r = job.recipe;
  const int cores = static_cast<int>(std::max(1u, std::thread::hardware_concurrency()));
  const int local = std::max(1, job.env.local_size);
  const int threads = setup_rank_threads(r, job.env, /*report=*/false);
  Verdict v;
  try {
    kernels::verify_gemm_kind(kernels::GemmKind::kOpenBlasF32);  // OpenBLAS: a correct sgemm
  } catch (const std::exception& e) {
    v.fail(e.what());
  }
  rows.push_back(agree_row(world, "gemm_verify", "world", "every rank", v,
                           "odd shapes, all transposes, against a double-precision reference"));

  // The model's main GEMM: a micro-batch's tokens through the local slice of gate/up.
  const int64_t tp = mesh.shape().size(Dim::tp);
  const int64_t M = std::max<int64_t>(64, r.micro_batch_rows() * r.model.seq_len);
  const int64_t N = r.model.ffn_dim / tp, K = r.model.dim;
  // Ranks that share cores would measure each other: take turns then (all at once otherwise, as
  // in training, where a slow core or a throttled socket shows).
  const bool turns = local * threads > cores;
  double gflops = 0;
  for (int turn = 0; turn < (turns ? world.size() : 1); ++turn) {
    if (!turns || turn == world.rank())
      gflops = kernels::measure_sgemm_gflops(M, N, K, threads, quick ? 3 : 7);
    if (turns) world.barrier();
  }
  std::vector<double> all(world.size());
  world.all_gather(&gflops, all.data(), 1);
  const Spread spread = spread_of(all);
  const double median = spread.median, best = *std::max_element(all.begin(), all.end());
  const int best_rank = static_cast<int>(std::max_element(all.begin(), all.end()) - all.begin());
  // Megatron's gpu_sniff_test rule: slower than its peers by more than 10% and one deviation.
  CheckRow summary{"gemm",
                   "world",
                   fmt::format("{}x{}x{}", M, N, K),
                   CheckStatus::ok,
                   fmt::format("median {:.1f} GFLOP/s per rank, best {:.1f} (rank {}){}", median,
                               best, best_rank, turns ? "; measured in turns (shared cores)" : ""),
                   {}};
  for (int q = 0; q < world.size(); ++q) {
    const bool slow = spread.slow(all[q]);
    if (slow) summary.culprits.push_back(q);
    rows.push_back({"gemm", fmt::format("rank {}", q),
                    fmt::format("{} thread{}", threads, threads > 1 ? "s" : ""),
                    slow ? CheckStatus::warn : CheckStatus::info,
                    fmt::format("{:7.1f} GFLOP/s, {:3.0f}% of the best{}", all[q],
                                100 * all[q] / best, slow ? ": outlier" : ""),
                    slow ? std::vector<int>{q} : std::vector<int>{}});
  }
  if (!summary.culprits.empty()) summary.status = CheckStatus::warn;
  rows.insert(rows.end() - world.size(), summary);
}

void host_map(const Job& job, std::vector<CheckRow>& rows) {
  const auto& mesh = *job.mesh;
  constexpr size_t kLine = 256;
  char mine[kLine] = {};
  std::snprintf(mine, kLine, "%s|host %s, cpus %s, BLAS threads %d", mesh.label().c_str(),
                job.hostname.c_str(), format_cpu_set(cpu_set()).c_str(), kernels::blas_threads());
  std::vector<char> all(kLine * mesh.world().size());
  mesh.world().all_gather(mine, all.data(), kLine);
  for (int q = 0; q < mesh.world().size(); ++q) {
    const std::string line(all.data() + q * kLine);
    const size_t bar = line.find('|');
    rows.push_back({"host",
                    fmt::format("rank {}", q),
                    line.substr(0, bar),
                    CheckStatus::info,
                    line.substr(bar + 1),
                    {}});
  }
}

}  // namespace t3d::runtime::selfcheck
