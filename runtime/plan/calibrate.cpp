#include "runtime/plan/calibrate.h"

#include <spdlog/fmt/fmt.h>
#include <unistd.h>

#include <algorithm>
#include <chrono>
#include <cstdlib>
#include <filesystem>
#include <fstream>
#include <functional>
#include <sstream>
#include <thread>
#include <vector>

#include "kernels/arena.h"
#include "kernels/blas.h"
#include "kernels/check.h"
#include "kernels/device.h"
#include "kernels/gemm.h"
#include "parallel/comm.h"
#include "runtime/cost/planner.h"
#include "runtime/cost/planner_cost.h"
#include "runtime/launch/job.h"
#include "runtime/machine/machine.h"
#include "runtime/model/model.h"
#include "runtime/stage/stage.h"

namespace t3d::runtime {
namespace {

namespace fs = std::filesystem;
using Clock = std::chrono::steady_clock;
using parallel::Comm;
using parallel::Dim;
using parallel::ReduceOp;

// Seconds per call of `fn` on the slowest rank (a step waits for its slowest rank), the median of
// `windows` timed windows of about `window_s` each: the machine is shared, and one window caught
// by another process's burst must not become the calibration. The first call is a warm-up
// (first-touch page faults, MPI connections, OpenBLAS buffers) whose time, agreed over ranks, sets
// the calls per window, so the windows themselves need no synchronisation per call (which would
// add a collective's latency to every tiny all-reduce timed).
double time_per_call(const Comm& world, const std::function<void()>& fn, double window_s,
                     int windows = 5) {
  world.barrier();
  auto t0 = Clock::now();
  fn();
  double warm = std::chrono::duration<double>(Clock::now() - t0).count();
  world.all_reduce(&warm, 1, ReduceOp::max);
  const int iters = static_cast<int>(std::clamp(window_s / std::max(warm, 1e-7), 1.0, 1e4));
  std::vector<double> per_call;
  for (int w = 0; w < windows; ++w) {
    world.barrier();
    t0 = Clock::now();
    for (int i = 0; i < iters; ++i) fn();
    double s = std::chrono::duration<double>(Clock::now() - t0).count() / iters;
    world.all_reduce(&s, 1, ReduceOp::max);
    per_call.push_back(s);
  }
  std::nth_element(per_call.begin(), per_call.begin() + windows / 2, per_call.end());
  return per_call[static_cast<size_t>(windows / 2)];
}

struct Measured {
  int group_size = 1;
  std::string group;
  double small_s = 0, large_s = 0, large_bytes = 0;  // all-reduce times
  double latency_s = 0, bytes_per_s = 0;             // fitted ring parameters
  double block_s = 0, tp_allreduce_s = 0;            // one block fwd+bwd; its TP all-reduce
  double block_flops = 0, tflops = 0;
  int a2a_size = 1;                                              // ranks in the measured all-to-all
  double a2a_small_s = 0, a2a_large_s = 0, a2a_large_bytes = 0;  // per peer: bytes of a block
  double a2a_latency_s = 0, a2a_bytes_per_s = 0;                 // fitted per peer, per rank
};

// Ring all-reduce (planner_cost.cpp): 2(n−1)·α + 2(n−1)/n · bytes / bw. Two sizes give α (the
// tiny message is all latency) and bw (from the difference, so latency does not count twice).
void measure_links(const Comm& world, const Comm& group, const std::string& name, Measured& m) {
  const int n = group.size();
  m.group_size = n;
  m.group = name;
  if (n < 2) return;
  std::vector<float> small(8, 0.0f), large((1 << 20) / sizeof(float), 0.0f);
  m.large_bytes = static_cast<double>(large.size() * sizeof(float));
  m.small_s = time_per_call(
      world, [&] { group.all_reduce(small.data(), small.size()); }, 0.04);
  m.large_s = time_per_call(
      world, [&] { group.all_reduce(large.data(), large.size()); }, 0.06);
  const double hops = 2.0 * (n - 1);
  m.latency_s = m.small_s / hops;
  m.bytes_per_s = hops / n * m.large_bytes / std::max(m.large_s - m.small_s, 1e-9);
}

// Expert parallelism's exchange as the planner prices it (planner_cost.cpp): a rank sends
// (n−1) blocks, t = (n−1)·α + (n−1)·block / bw. Two block sizes give α and bw as for the ring.
void measure_all_to_all(const Comm& world, const Comm& group, Measured& m) {
  const int n = group.size();
  m.a2a_size = n;
  if (n < 2) return;
  const size_t small_block = 8, large_block = (256 << 10) / sizeof(float);
  std::vector<float> send(large_block * n, 0.0f), recv(large_block * n, 0.0f);
  m.a2a_large_bytes = static_cast<double>(large_block * sizeof(float));
  m.a2a_small_s = time_per_call(
      world, [&] { group.all_to_all(send.data(), recv.data(), small_block); }, 0.04);
  m.a2a_large_s = time_per_call(
      world, [&] { group.all_to_all(send.data(), recv.data(), large_block); }, 0.06);
  const double peers = n - 1.0;
  m.a2a_latency_s = m.a2a_small_s / peers;
  m.a2a_bytes_per_s = peers * (m.a2a_large_bytes - small_block * sizeof(float)) /
                      std::max(m.a2a_large_s - m.a2a_small_s, 1e-9);
}

// One transformer block, forward then backward (input and weight gradients), as the middle chunk
// of a three-layer model: no embedding, no head, nothing but the block the planner prices per
// layer. The rank's real tp group gives it the sharded GEMM shapes training runs, and with them
// the block's two forward and two backward all-reduces, which the planner prices apart: they are
// measured on their own at the same size and taken off.
void measure_block(const Job& job, Measured& m) {
  const Recipe& r = job.recipe;
  const Comm& world = job.mesh->world();
  const Comm& tp = job.mesh->group(Dim::tp);
  setup_rank_threads(r, job.env, /*report=*/false);
  // Not build_stage: the probe is one middle block of a 3-layer model, not this rank's stage; its
  // options are the stage's (model_options).
  ModelConfig cfg = r.model;
  cfg.n_layers = 3;
  parallel::LayerRange middle;
  middle.begin = 1, middle.end = 2;
  const ModelOptions opt = model_options(r, job.precision(), StagePurpose::kForward,
                                         r.micro_batch_rows(), nullptr, nullptr);
  kernels::Arena arena(static_cast<size_t>(r.hardware.hbm_gib * double(1ull << 30)));
  Model model(cfg, {middle}, tp, arena, opt);
  model.init(static_cast<uint64_t>(r.train.seed));
  const int64_t n = model.io_floats();
  std::vector<float> dout(static_cast<size_t>(n));
  for (int64_t i = 0; i < n; ++i) dout[i] = 1e-3f * static_cast<float>((i * 7919) % 201 - 100);
  // The probe's input and output gradient: the same values, in the model's memory.
  kernels::Buffer grad;
  grad.reserve(model.exec(), dout.size() * sizeof(float), "calibration output gradient");
  kernels::copy_from_host(model.exec(), grad.as<float>(), dout.data(), dout.size() * sizeof(float));
  kernels::copy_from_host(model.exec(), model.input(0, 0), dout.data(),
                          dout.size() * sizeof(float));
  m.block_s = time_per_call(
      world,
      [&] {
        model.forward(0, 0, nullptr, nullptr, 1.0f, true);
        model.backward(0, 0, grad.as<float>());
      },
      0.3);
  if (tp.size() > 1) {
    std::vector<float> act(static_cast<size_t>(model.rows() * cfg.dim), 0.0f);
    m.tp_allreduce_s = time_per_call(
        world, [&] { tp.all_reduce(act.data(), act.size()); }, 0.04);
  }
  // The planner's count for this block (the model spec's, as cost_of_stage): f + b + w FLOPs
  // per row.
  Cluster unit;
  unit.devices_per_node = std::max<int64_t>(1, r.world_size());
  const PlanProblem p = make_problem(r, unit);
  m.block_flops =
      block_flops_per_token(p.model, r.parallel.tp).train() * static_cast<double>(model.rows());
  // Never let the subtraction claim more than half the block: under heavy oversubscription the
  // all-reduce measured alone and the one inside the block overlap other ranks' work differently.
  const double compute_s = std::max(m.block_s - 4 * m.tp_allreduce_s, 0.5 * m.block_s);
  m.tflops = m.block_flops / compute_s / 1e12;
}

std::string cluster_toml(const Recipe& r, const Measured& m, const std::string& host) {
  const int64_t world = r.world_size();
  // Without a measured group (one rank) nothing crosses MPI: keep the old guesses.
  const double gbps = m.bytes_per_s > 0 ? m.bytes_per_s / 1e9 : 5.0;
  const double lat_us = m.latency_s > 0 ? m.latency_s * 1e6 : 2.0;
  std::ostringstream os;
  os << "# Written by `titan3d plan --calibrate` on " << host << " for " << world
     << " rank(s), micro-batch " << r.micro_batch_rows() << " × " << r.model.seq_len
     << " tokens, tp " << r.parallel.tp << ", precision " << choice_name(r.train.precision) << ".\n"
     << fmt::format(
            "# block fwd+bwd {:.4g} ms (of which tp all-reduces 4 × {:.4g} ms), {:.4g} "
            "MFLOP -> {:.4g} GFLOP/s per rank, all ranks at once\n",
            m.block_s * 1e3, m.tp_allreduce_s * 1e3, m.block_flops / 1e6, m.tflops * 1e3)
     << fmt::format("# all-reduce over {} ({} ranks): 32 B {:.4g} us, {:.4g} B {:.4g} us\n",
                    m.group, m.group_size, m.small_s * 1e6, m.large_bytes, m.large_s * 1e6)
     << "[cluster]\n"
     << "name = \"this machine, calibrated\"\n"
     << "nodes = 1\n"
     << "devices_per_node = " << world << "\n"
     << "[device]\n"
     << fmt::format("hbm_gib = {}\n", r.hardware.hbm_gib)
     << fmt::format("peak_tflops = {:.6g}\n", m.tflops)
     << "compute_efficiency = 1.0  # measured: the rate the block reaches\n"
     << "[network]\n"
     << fmt::format("intra_node_gbps = {:.6g}\n", gbps)
     << fmt::format("intra_node_latency_us = {:.6g}\n", lat_us)
     << fmt::format("inter_node_gbps = {:.6g}\n", gbps)
     << fmt::format("inter_node_latency_us = {:.6g}\n", lat_us);
  if (m.a2a_bytes_per_s > 0)
    os << fmt::format("# all-to-all over {} ranks: 32 B {:.4g} us, {:.4g} B per peer {:.4g} us\n",
                      m.a2a_size, m.a2a_small_s * 1e6, m.a2a_large_bytes, m.a2a_large_s * 1e6)
       << fmt::format("all_to_all_gbps = {:.6g}\n", m.a2a_bytes_per_s / 1e9)
       << fmt::format("all_to_all_latency_us = {:.6g}\n", std::max(m.a2a_latency_s * 1e6, 1e-3));
  return os.str();
}

}  // namespace

Cluster calibrate_local(const Recipe& recipe, const std::vector<std::string>& argv) {
  // The probe times a block on this machine's CPU and MPI over host memory: what a GPU run would
  // do is another machine, whose figures come from a cluster file.
  const kernels::DeviceChoice choice = recipe.hardware.device;
  const std::string device = choice == kernels::DeviceChoice::kCuda
                                 ? "cuda"
                                 : kernels::Device::describe(choice, 0);  // "cpu" without a GPU
  T3D_USER_CHECK(device == "cpu",
                 "plan --calibrate measures this machine's CPU and MPI, but "
                 "the recipe trains on ",
                 device,
                 " (hardware.device): give the GPUs' cluster with "
                 "--cluster (their peaks, HBM and links, as recipes/clusters/h100_64.toml), or set "
                 "hardware.device = \"cpu\" to calibrate the CPU");
  const std::string path = calibration_cache_path(recipe);
  fs::create_directories(fs::path(path).parent_path());
  const std::string tmp = path + ".tmp" + std::to_string(getpid());
  std::vector<std::string> probe_argv = argv;
  probe_argv.insert(probe_argv.end(), {"--calibrate-probe", tmp});
  SpawnPlan plan = make_spawn_plan(recipe, probe_argv, 0);
  const int rc = run_spawned(plan).code;
  T3D_USER_CHECK(rc == 0 && fs::is_regular_file(tmp), "plan --calibrate: the probe on ", plan.ranks,
                 " rank(s) failed (exit ", rc, "); logs in ", plan.log_dir);
  fs::rename(tmp, path);  // atomic: a concurrent plan reads the old file or the new one
  return load_cluster(path);
}

void run_calibration_probe(const Job& job, const std::string& out) {
  const auto& mesh = *job.mesh;
  Measured m;
  // The tp group carries a step's most frequent collectives (four per block per micro-batch);
  // without tp, the world: the dp all-reduce or the pipeline's transfers run over it.
  if (mesh.shape().size(Dim::tp) > 1)
    measure_links(mesh.world(), mesh.group(Dim::tp), "tp", m);
  else
    measure_links(mesh.world(), mesh.world(), "world", m);
  // A mixture of experts: the all-to-all of the EP group the recipe has, else of the whole world
  // (plan searches every ep; on one machine the groups share its memory system).
  if (job.recipe.model.moe())
    measure_all_to_all(mesh.world(), mesh.ep().size() > 1 ? mesh.ep() : mesh.world(), m);
  measure_block(job, m);
  if (mesh.rank() != 0) return;
  std::ofstream f(out);
  f << cluster_toml(job.recipe, m, job.hostname);
  T3D_USER_CHECK(f.good(), "plan --calibrate: cannot write ", out);
}

}  // namespace t3d::runtime
