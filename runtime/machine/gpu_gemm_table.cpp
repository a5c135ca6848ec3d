#include "runtime/machine/gpu_gemm_table.h"

#include <spdlog/spdlog.h>

#include <algorithm>
#include <cstdio>
#include <filesystem>
#include <fstream>
#include <sstream>

#include "checkpoint/paths.h"
#include "checkpoint/snapshot.h"
#include "kernels/hash.h"
#include "runtime/machine/machine.h"

namespace t3d::runtime {

namespace fs = std::filesystem;

namespace {

// The cache file of a GPU table: its key's hash names it, and its first line is the key, checked
// on reading (a hash collision or a file from another key answers nothing).
fs::path cache_file(const std::string& key) {
  char name[64];
  std::snprintf(name, sizeof name, "gpu-gemm-table-%016llx.txt",
                static_cast<unsigned long long>(kernels::hash64(key.data(), key.size())));
  return fs::path(cache_dir()) / name;
}

std::string read_cached_table(const std::string& key) {
  std::ifstream in(cache_file(key));
  std::string first;
  if (!std::getline(in, first) || first != key) return {};
  std::ostringstream rest;
  rest << in.rdbuf();
  return rest.str();
}

void write_cached_table(const std::string& key, const std::string& text) {
  std::error_code ec;
  fs::create_directories(cache_dir(), ec);
  try {
    checkpoint::write_file_atomically(cache_file(key).string(), key + "\n" + text,
                                      "the GPU GEMM table cache");
  } catch (const std::exception& e) {  // a cache that cannot be written costs a measurement
    spdlog::warn("GEMM algorithms: not cached ({})", e.what());
  }
}

// Rank 0: the table, and where it came from.
GpuGemmTable rank0_table(const Job& job, kernels::GemmKind kind, const std::string& snapshot) {
  if (!snapshot.empty()) {
    std::string recorded;
    try {
      recorded = checkpoint::read_gemm_table(snapshot);
    } catch (const std::exception&) {  // the restore itself reports an unreadable snapshot
    }
    if (!recorded.empty()) return {recorded, "recorded in " + snapshot};
  }
  const auto device = kernels::Device::open(job.recipe.hardware.device, job.env.local_rank);
  const std::vector<kernels::Device::LinearSize> sizes = linear_sizes(job.recipe);
  // The key: the GPU and cuBLASLt, the precision, the sizes.
  std::ostringstream key;
  key << device->gemm_library() << "|" << kernels::gemm_kind_name(kind);
  for (const auto& s : sizes) key << "|" << s.rows << "x" << s.in << "x" << s.out;
  if (std::string cached = read_cached_table(key.str()); !cached.empty()) return {cached, "cached"};
  const std::string measured = device->tune_linear_gemms(sizes, kind);
  write_cached_table(key.str(), measured);
  return {measured, "measured"};
}

}  // namespace

std::vector<kernels::Device::LinearSize> linear_sizes(const Recipe& r) {
  const ModelConfig& m = r.model;
  const int64_t tp = std::max<int64_t>(1, r.parallel.tp), cp = std::max<int64_t>(1, r.parallel.cp);
  const int64_t rows = std::max<int64_t>(1, r.micro_batch_rows() * m.seq_len / cp);
  const int64_t kv_heads = m.n_kv_heads > 0 ? m.n_kv_heads : m.n_heads;
  const int64_t qd = m.n_heads / tp * m.head_dim(),
                kvd = std::max<int64_t>(1, kv_heads / tp) * m.head_dim();
  const int64_t ffn = m.ffn_dim / tp, C = m.dim;
  std::vector<kernels::Device::LinearSize> sizes = {
      {rows, C, qd}, {rows, C, kvd}, {rows, qd, C}, {rows, C, m.vocab_size / tp}};
  if (!m.moe() || m.dense_layers > 0) {
    sizes.push_back({rows, C, ffn});
    sizes.push_back({rows, ffn, C});
  }
  // Distinct sizes once each, in a fixed order (the table's key lists them).
  std::sort(sizes.begin(), sizes.end(), [](const auto& a, const auto& b) {
    return std::tie(a.rows, a.in, a.out) < std::tie(b.rows, b.in, b.out);
  });
  sizes.erase(std::unique(sizes.begin(), sizes.end(),
                          [](const auto& a, const auto& b) {
                            return std::tie(a.rows, a.in, a.out) == std::tie(b.rows, b.in, b.out);
                          }),
              sizes.end());
  return sizes;
}

GpuGemmTable choose_gpu_gemm_table(const Job& job, kernels::GemmKind kind,
                                   const std::string& resumed_snapshot) {
  const parallel::Comm& world = job.mesh->world();
  GpuGemmTable t;
  if (world.rank() == 0) {
    try {
      t = rank0_table(job, kind, resumed_snapshot);
    } catch (const std::exception& e) {  // the stage's own start reports a GPU that fails
      t = {"", std::string("none: ") + e.what()};
    }
  }
  world.broadcast(t.text, 0);
  world.broadcast(t.source, 0);
  return t;
}

}  // namespace t3d::runtime
