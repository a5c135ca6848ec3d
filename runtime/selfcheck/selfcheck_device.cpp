// The selfcheck `device` rows (see selfcheck.h): each rank's device, and on a GPU its measured
// GEMM and host <-> device rates against its datasheet.
#include <fmt/format.h>

#include <algorithm>
#include <cmath>
#include <cstdio>
#include <memory>

#include "kernels/check.h"
#include "kernels/device.h"
#include "parallel/mesh.h"
#include "runtime/selfcheck/selfcheck_internal.h"

namespace t3d::runtime::selfcheck {

namespace {

// "NN% of its datasheet" or "" when the GPU is not in kernels/gpu_specs.h.
std::string of_peak(double tflops, double peak) {
  return peak > 0 ? fmt::format(" ({:.0f}% of {:.0f})", 100 * tflops / peak, peak) : "";
}

}  // namespace

void check_device(const Job& job, bool quick, std::vector<CheckRow>& rows) {
  const auto& mesh = *job.mesh;
  const auto& world = mesh.world();
  const auto& r = job.recipe;
  std::unique_ptr<kernels::Device> device;
  Verdict opened;
  try {
    device = kernels::Device::open(r.hardware.device, job.env.local_rank);
  } catch (const std::exception& e) {
    opened.fail(e.what(), world.rank());
  }
  int gpu = device && device->on_gpu() ? 1 : 0;
  world.all_reduce(&gpu, 1, parallel::ReduceOp::max);
  const std::string key = fmt::format("hardware.device = {}", choice_name(r.hardware.device));
  if (!gpu) {  // the CPU everywhere (or a device that did not open): one row
    rows.push_back(agree_row(world, "device", "world", "every rank", opened,
                             key + ": every rank computes on its host's CPU"));
    return;
  }
  // Each rank's device and its rates; ranks sharing a GPU take turns.
  double rates[4] = {0, 0, 0, 0};
  {
    const int64_t tp = mesh.shape().size(parallel::Dim::tp);
    const int64_t M = std::max<int64_t>(256, r.micro_batch_rows() * r.model.seq_len);
    const int64_t N = std::max<int64_t>(256, r.model.ffn_dim / tp), K = r.model.dim;
    const size_t bytes = size_t{quick ? 64 : 256} << 20;
    const bool turns =
        device && device->on_gpu() && std::max(1, job.env.local_size) > device->visible_gpus();
    for (int turn = 0; turn < (turns ? world.size() : 1); ++turn) {
      if ((!turns || turn == world.rank()) && device && device->on_gpu()) {
        try {
          const auto m = device->measure_rates(M, N, K, bytes, quick ? 3 : 7);
          rates[0] = m.gemm_fp32_tflops, rates[1] = m.gemm_bf16_tflops;
          rates[2] = m.h2d_gbps, rates[3] = m.d2h_gbps;
        } catch (const std::exception& e) {
          opened.fail(fmt::format("measuring {}: {}", device->description(), e.what()),
                      world.rank());
        }
      }
      if (turns) world.barrier();
    }
    rows.push_back(agree_row(world, "device", "world", "every rank", opened,
                             fmt::format("{}: {}x{}x{} GEMMs and {} copies measured", key, M, N, K,
                                         bytes_label(static_cast<double>(bytes)))));
  }
  constexpr size_t kLine = 256;
  char mine[kLine] = {};
  std::snprintf(mine, kLine, "%s", device ? device->description().c_str() : "(not opened)");
  std::vector<char> names(kLine * static_cast<size_t>(world.size()));
  world.all_gather(mine, names.data(), kLine);
  std::vector<double> all(4 * static_cast<size_t>(world.size()));
  world.all_gather(rates, all.data(), 4);
  std::vector<double> bf16(static_cast<size_t>(world.size()));
  for (int q = 0; q < world.size(); ++q) bf16[static_cast<size_t>(q)] = all[4 * q + 1];
  const Spread s = spread_of(bf16);
  const kernels::GpuSpec* spec = device ? device->spec() : nullptr;
  for (int q = 0; q < world.size(); ++q) {
    const std::string name(names.data() + q * kLine);
    const double* m = &all[4 * static_cast<size_t>(q)];
    if (!kernels::Device::is_gpu(name)) {
      rows.push_back({"device", fmt::format("rank {}", q), "", CheckStatus::info, name, {}});
      continue;
    }
    const bool slow = s.slow(m[1]);
    rows.push_back(
        {"device", fmt::format("rank {}", q), name.substr(0, name.find(',')),
         slow ? CheckStatus::warn : CheckStatus::info,
         fmt::format("GEMM {:.1f} TFLOP/s fp32{}, {:.1f} bf16{}; host->device {:.1f} GB/s, "
                     "device->host {:.1f}{}",
                     m[0], of_peak(m[0], spec ? spec->fp32_tflops : 0), m[1],
                     of_peak(m[1], spec ? spec->bf16_tflops : 0), m[2], m[3],
                     slow ? ": slower than its peers" : ""),
         slow ? std::vector<int>{q} : std::vector<int>{}});
  }
}

}  // namespace t3d::runtime::selfcheck
