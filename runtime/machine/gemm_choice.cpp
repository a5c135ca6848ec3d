#include "runtime/machine/gemm_choice.h"

#include <spdlog/spdlog.h>

#include <algorithm>
#include <cmath>
#include <cstdio>
#include <filesystem>
#include <fstream>
#include <sstream>
#include <thread>

#include "checkpoint/paths.h"
#include "checkpoint/snapshot.h"
#include "kernels/blas.h"
#include "kernels/check.h"
#include "kernels/device.h"
#include "kernels/peak.h"
#include "parallel/trace.h"
#include "runtime/machine/gpu_gemm_table.h"
#include "runtime/machine/machine.h"

namespace t3d::runtime {

namespace fs = std::filesystem;
using kernels::GemmKind;

namespace {

constexpr int kMeasureRounds = 4;
constexpr int64_t kMaxMeasuredRows = 4096;

fs::path cache_file() { return fs::path(cache_dir()) / "gemm_choice.txt"; }

// Cache files: one line per key, "key<TAB>value value ...", appended; the first line whose key
// and value count match answers. Keys have no blanks (they are replaced by '_').
std::string cache_key_text(std::string key) {
  std::replace(key.begin(), key.end(), ' ', '_');
  std::replace(key.begin(), key.end(), '\t', '_');
  return key;
}

std::vector<double> read_cached(const fs::path& file, const std::string& key, size_t count) {
  std::ifstream in(file);
  const std::string prefix = cache_key_text(key) + '\t';
  for (std::string line; std::getline(in, line);) {
    if (line.compare(0, prefix.size(), prefix) != 0) continue;
    std::istringstream text(line.substr(prefix.size()));
    std::vector<double> values;
    for (double v; text >> v;) values.push_back(v);
    if (values.size() == count) return values;
  }
  return {};
}

void write_cached(const fs::path& file, const std::string& key, const std::vector<double>& values) {
  std::error_code ec;
  fs::create_directories(file.parent_path(), ec);
  std::ofstream out(file, std::ios::app);
  out << cache_key_text(key) << '\t';
  for (double v : values) out << v << ' ';
  out << '\n';
}

// A number cached under `key` in `file`, measured the first time.
template <class Measure>
double cached_number(const fs::path& file, const std::string& key, Measure measure) {
  if (const auto v = read_cached(file, key, 1); !v.empty()) return v[0];
  const double v = measure();
  write_cached(file, key, {v});
  return v;
}

struct Shapes {
  int64_t rows = 0, dim = 0, ffn = 0, attn = 0;  // this rank's: ffn and attention dims over tp
  std::string text() const {
    std::ostringstream o;
    o << "rows" << rows << "_dim" << dim << "_ffn" << ffn << "_attn" << attn;
    return o.str();
  }
};

Shapes shapes_of(const Recipe& r) {
  const auto& p = r.parallel;
  Shapes s;
  // Rates settle by a few thousand rows; more would only lengthen the start of a large model.
  s.rows = std::clamp<int64_t>(r.micro_batch_rows() * r.model.seq_len / std::max<int64_t>(1, p.cp),
                               1, kMaxMeasuredRows);
  s.dim = r.model.dim;
  s.ffn = std::max<int64_t>(1, r.model.ffn_dim / std::max<int64_t>(1, p.tp));
  s.attn = std::max<int64_t>(1, r.model.n_heads * r.model.head_dim() / std::max<int64_t>(1, p.tp));
  return s;
}

// A measurement's cache key: what decides the rates besides the model (CPU, threads, libraries),
// the model's shapes, the candidates. Under the same machine and candidates, the rates cached at
// other shapes are this CPU's figures a new measurement is checked against (nearest_cached).
struct CacheKey {
  std::string machine, shapes, candidates;
  std::string text() const { return machine + shapes + candidates; }
};

CacheKey cache_key(const Shapes& s, int threads, int local_ranks,
                   const std::vector<GemmKind>& candidates) {
  std::ostringstream m, c;
  m << kernels::cpu_model_name() << "|cpus" << std::thread::hardware_concurrency() << "|local"
    << local_ranks << "|threads" << threads << "|" << kernels::openblas_corename() << "|"
    << kernels::onednn_version_string() << "|";
  c << "|";
  for (GemmKind k : candidates) c << kernels::gemm_kind_name(k) << ",";
  return {m.str(), s.text(), c.str()};
}

// The rates cached under `key`'s machine and candidates at the shapes nearest `key`'s (the least
// summed |log ratio| of rows, dim, ffn and attention width), `count` values; empty when none.
// `shapes_out`: those shapes.
std::vector<double> nearest_cached(const fs::path& file, const CacheKey& key, const Shapes& mine,
                                   size_t count, std::string* shapes_out) {
  const std::string head = cache_key_text(key.machine),
                    tail = cache_key_text(key.candidates) + '\t';
  std::ifstream in(file);
  std::vector<double> best;
  double best_distance = 0;
  for (std::string line; std::getline(in, line);) {
    const size_t end = line.find('\t');
    if (end == std::string::npos || end < head.size() + tail.size() - 1 ||
        line.compare(0, head.size(), head) != 0 ||
        line.compare(end + 1 - tail.size(), tail.size(), tail) != 0)
      continue;
    const std::string shapes = line.substr(head.size(), end + 1 - tail.size() - head.size());
    long rows = 0, dim = 0, ffn = 0, attn = 0;
    if (std::sscanf(shapes.c_str(), "rows%ld_dim%ld_ffn%ld_attn%ld", &rows, &dim, &ffn, &attn) !=
            4 ||
        std::min({rows, dim, ffn, attn}) <= 0)
      continue;
    std::istringstream text(line.substr(end + 1));
    std::vector<double> values;
    for (double v; text >> v;) values.push_back(v);
    if (values.size() != count) continue;
    const auto apart = [](double a, double b) { return std::abs(std::log(a / b)); };
    const double distance = apart(rows, mine.rows) + apart(dim, mine.dim) + apart(ffn, mine.ffn) +
                            apart(attn, mine.attn);
    if (best.empty() || distance < best_distance) {
      best = std::move(values), best_distance = distance;
      *shapes_out = shapes;
    }
  }
  return best;
}

// The (precision, gemm) recorded in the snapshot `snapshot.resume` names, if it can be read.
std::optional<std::pair<TrainPrecision, GemmLibrary>> recorded_in_snapshot(const Recipe& r,
                                                                           std::string* path_out) {
  std::string path = r.snapshot.resume;
  try {
    if (path == "latest") {
      std::vector<std::string> skipped;
      path = checkpoint::find_latest(r.snapshot.dir, &skipped);
    }
    if (path.empty()) return std::nullopt;
    const Recipe saved = parse_recipe(checkpoint::read_recipe(path), path + " (recipe)");
    *path_out = path;
    // Snapshots older than hardware.gemm trained on OpenBLAS.
    const bool has_gemm = saved.key_origins.count("hardware.gemm") > 0;
    return std::make_pair(saved.train.precision,
                          has_gemm ? saved.hardware.gemm : GemmLibrary::kOpenBlas);
  } catch (const std::exception&) {
    return std::nullopt;  // the restore itself reports an unreadable snapshot
  }
}

// Whether this CPU runs `kind` correctly (oneDNN's bf16 needs AVX-512; a broken library fails
// the reference check). A candidate that does not is left out, and the log says what the
// measurement chooses from instead: the recipe left the choice to it, so no advice is due.
bool runs_here(GemmKind kind, const std::vector<GemmKind>& candidates) {
  try {
    kernels::verify_gemm_kind(kind);
    return true;
  } catch (const GemmUnavailable& e) {
    std::string others;
    for (GemmKind c : candidates)
      if (c != kind)
        others += (others.empty() ? "" : ", ") + std::string(kernels::gemm_kind_name(c));
    spdlog::info("GEMM candidate {} left out: {}; choosing among {}", kernels::gemm_kind_name(kind),
                 e.reason(), others.empty() ? "none" : others);
    return false;
  }
}

// GFLOP/s per rank of the linear layers' GEMMs of one micro-batch (MLP and attention shapes).
double measure_gflops(GemmKind kind, const Shapes& s, int threads) {
  double seconds = 0, flops = 0;
  for (const int64_t out : {s.ffn, s.attn}) {
    const double f = 3 * 2.0 * s.rows * s.dim * out;
    seconds += f / (kernels::measure_gemm_gflops(kind, s.rows, s.dim, out, threads, 3) * 1e9);
    flops += f;
  }
  return flops / seconds * 1e-9;
}

// Resuming: the snapshot's choice fills what the recipe leaves to auto, so the continuation is
// bit-identical; a concrete value that differs from it is the user's call, said loudly.
// A recipe's auto value takes the snapshot's; a concrete one that differs is warned about.
template <typename E>
bool fill_one(E* mine, E theirs, E auto_value, const char* key, const std::string& path) {
  if (theirs == auto_value) return false;  // never trained (an import): nothing to continue
  if (*mine == auto_value) {
    *mine = theirs;
    return true;
  }
  if (*mine != theirs)
    spdlog::warn(
        "{} = {} here but {} in {}: the continuation will not be bit-identical to the "
        "run that wrote it (remove the key, or set it to {}, to continue exactly)",
        key, choice_name(*mine), choice_name(theirs), path, choice_name(theirs));
  return false;
}

// Returns the snapshot's index path ("" when it cannot be read).
std::string fill_from_snapshot(const Recipe& r, TrainPrecision* precision, GemmLibrary* library,
                               std::string* source) {
  std::string path;
  const auto saved = recorded_in_snapshot(r, &path);
  if (!saved) return {};
  const bool filled_precision =
      fill_one(precision, saved->first, TrainPrecision::kAuto, "train.precision", path);
  const bool filled_library =
      fill_one(library, saved->second, GemmLibrary::kAuto, "hardware.gemm", path);
  if (filled_precision || filled_library) *source = "recorded in " + path;
  return path;
}

// Rank 0: the decision with its numbers in the log and in <run dir>/gemm_choice.json.
void record(const GemmChoice& c, const std::string& run_dir) {
  std::string numbers;
  for (const auto& m : c.rates)
    numbers += fmt::format("{}{} {:.1f} (slowest round {:.1f})", numbers.empty() ? "" : ", ",
                           kernels::gemm_kind_name(m.kind), m.fastest, m.slowest);
  if (kernels::Device::is_gpu(c.device))
    spdlog::info(
        "GEMM: cuBLASLt with {} inputs and fp32 sums on {} (train.precision = {}; {}), "
        "algorithms {}; {} stands for it in snapshots, the GEMM a CPU resuming them runs",
        kernels::gemm_kind_is_bf16(c.kind) ? "bf16" : "fp32", c.device, choice_name(c.precision),
        c.source, c.gpu_gemm_table_source, kernels::gemm_kind_name(c.kind));
  else
    spdlog::info(
        "GEMM: {} (train.precision = {}, hardware.gemm = {}; {}{}{}), {} thread(s) per rank; "
        "{}; {}",
        kernels::gemm_kind_name(c.kind), choice_name(c.precision), choice_name(c.library), c.source,
        numbers.empty() ? "" : ": GFLOP/s per rank at the model's shapes ", numbers, c.threads,
        kernels::cpu_model_name(), kernels::onednn_version_string());
  std::ostringstream out;
  out << "{\"kind\": \"" << kernels::gemm_kind_name(c.kind) << "\", \"precision\": \""
      << choice_name(c.precision) << "\", \"library\": \"" << choice_name(c.library)
      << "\", \"device\": " << parallel::trace::json_string(c.device)
      << ", \"threads_per_rank\": " << c.threads << ", \"cpu\": \"" << kernels::cpu_model_name()
      << "\", \"gflops_per_rank\": {";
  for (size_t i = 0; i < c.rates.size(); ++i)
    out << (i ? ", " : "") << "\"" << kernels::gemm_kind_name(c.rates[i].kind)
        << "\": " << c.rates[i].fastest;
  out << "}, \"gflops_per_rank_slowest_round\": {";
  for (size_t i = 0; i < c.rates.size(); ++i)
    out << (i ? ", " : "") << "\"" << kernels::gemm_kind_name(c.rates[i].kind)
        << "\": " << c.rates[i].slowest;
  out << "}";
  if (!c.gpu_gemm_table_source.empty())
    out << ", \"gpu_gemm_algorithms\": " << parallel::trace::json_string(c.gpu_gemm_table_source)
        << ", \"gpu_gemm_table\": " << parallel::trace::json_string(c.gpu_gemm_table);
  out << "}\n";
  // A record for people (the snapshots carry the choice): a failure is a warning, never a half
  // file.
  try {
    checkpoint::write_file_atomically(run_dir + "/gemm_choice.json", out.str(), "run.dir");
  } catch (const UserError& e) {
    spdlog::warn("{}", e.what());
  }
}

GemmLibrary library_of(GemmKind kind) {
  return kind == GemmKind::kOpenBlasF32 ? GemmLibrary::kOpenBlas : GemmLibrary::kOneDnn;
}

}  // namespace

GemmKind gemm_kind_of(TrainPrecision precision, GemmLibrary library) {
  T3D_ASSERT(precision != TrainPrecision::kAuto && library != GemmLibrary::kAuto,
             "train.precision and hardware.gemm must be resolved first");
  if (library == GemmLibrary::kOpenBlas) return GemmKind::kOpenBlasF32;
  return precision == TrainPrecision::kBf16 ? GemmKind::kOneDnnBf16 : GemmKind::kOneDnnF32;
}

std::vector<GemmKind> gemm_candidates(TrainPrecision precision, GemmLibrary library) {
  std::vector<GemmKind> out;
  const bool bf16_allowed = precision != TrainPrecision::kFp32;
  if (library != GemmLibrary::kOneDnn) out.push_back(GemmKind::kOpenBlasF32);
  if (library != GemmLibrary::kOpenBlas) {
    // onednn forced with bf16: only bf16 inputs; otherwise fp32 oneDNN competes too.
    if (!(library == GemmLibrary::kOneDnn && precision == TrainPrecision::kBf16))
      out.push_back(GemmKind::kOneDnnF32);
    if (bf16_allowed) out.push_back(GemmKind::kOneDnnBf16);
  }
  return out;
}

size_t preferred_gemm(const std::vector<MeasuredGemm>& rates) {
  size_t winner = 0;
  for (size_t i = 1; i < rates.size(); ++i)
    if (rates[i].slowest > kGemmSwitchMargin * rates[winner].fastest) winner = i;
  return winner;
}

GemmDecision decide_gemm(const std::vector<MeasuredGemm>& measured,
                         const std::vector<MeasuredGemm>& cached) {
  bool comparable = cached.size() == measured.size();
  for (size_t i = 0; comparable && i < cached.size(); ++i)
    comparable = cached[i].kind == measured[i].kind;
  GemmDecision d;
  for (size_t i = 0; i < measured.size() && d.interference.empty(); ++i) {
    const MeasuredGemm& m = measured[i];
    if (m.fastest <= 0) continue;  // cannot run here
    const char* kind = kernels::gemm_kind_name(m.kind);
    if (m.slowest * kGemmRoundSpread < m.fastest)
      d.interference = fmt::format("{}'s rounds ranged from {:.1f} to {:.1f} GFLOP/s per rank",
                                   kind, m.slowest, m.fastest);
    else if (comparable && m.fastest * kGemmCachedDrop < cached[i].fastest)
      d.interference = fmt::format("{} reached {:.1f} GFLOP/s per rank, {:.1f} cached for this CPU",
                                   kind, m.fastest, cached[i].fastest);
  }
  if (d.interference.empty()) {
    d.winner = preferred_gemm(measured);
    return d;
  }
  if (comparable) {
    d.winner = preferred_gemm(cached);
    if (measured[d.winner].fastest > 0) return d;
  }
  d.winner = 0;
  while (d.winner + 1 < measured.size() && measured[d.winner].fastest <= 0) ++d.winner;
  return d;
}

namespace {

// Collective: the index of the winner among `candidates` (more than one), from the cache or a
// measurement of every rank at once; c.rates and c.source say which numbers decided.
int measured_winner(const Job& job, const std::vector<GemmKind>& candidates, GemmChoice& c) {
  const Recipe& r = job.recipe;
  const parallel::Comm& world = job.mesh->world();
  const bool root = world.rank() == 0;
  const int local = std::max(1, job.env.local_size);
  int winner = 0;
  const Shapes shapes = shapes_of(r);
  const CacheKey key = cache_key(shapes, c.threads, local, candidates);
  const size_t n = candidates.size();
  std::vector<double> rates(2 * n);
  int cached = 0;
  if (root) {
    rates = read_cached(cache_file(), key.text(), 2 * n);
    cached = !rates.empty();
  }
  world.broadcast(&cached, 1, 0);
  if (cached) {
    world.broadcast(rates.data(), rates.size(), 0);
    c.source = "cached in " + cache_file().string();
  } else {
    // Every rank at once, as they will train; the world's summed time per candidate decides.
    // Rounds outside, candidates inside, each candidate's best round kept: load from elsewhere
    // that comes and goes hits every candidate alike and lowers none for good.
    world.barrier();
    rates.assign(2 * candidates.size(), 0.0);  // fastest rounds, then slowest rounds
    std::vector<bool> runnable;
    for (GemmKind k : candidates)
      runnable.push_back(runs_here(k, candidates));  // rate 0: never chosen
    for (int round = 0; round < kMeasureRounds; ++round)
      for (size_t i = 0; i < n; ++i)
        if (runnable[i]) {
          const double rate = measure_gflops(candidates[i], shapes, c.threads);
          rates[i] = std::max(rates[i], rate);
          rates[n + i] = round == 0 ? rate : std::min(rates[n + i], rate);
        }
    world.all_reduce(rates.data(), rates.size());
    for (auto& v : rates) v /= world.size();  // mean rate per rank
    c.source = "measured";
  }
  for (size_t i = 0; i < n; ++i) c.rates.push_back({candidates[i], rates[i], rates[n + i]});
  if (root && cached) {
    winner = static_cast<int>(preferred_gemm(c.rates));
  } else if (root) {
    // A measurement disturbed by load from elsewhere neither decides nor is cached.
    std::string near;
    const std::vector<double> figures = nearest_cached(cache_file(), key, shapes, 2 * n, &near);
    std::vector<MeasuredGemm> reference;
    for (size_t i = 0; i < n && !figures.empty(); ++i)
      reference.push_back({candidates[i], figures[i], figures[n + i]});
    const GemmDecision d = decide_gemm(c.rates, reference);
    winner = static_cast<int>(d.winner);
    if (d.interference.empty()) {
      write_cached(cache_file(), key.text(), rates);
    } else {
      const std::string kept =
          reference.empty() ? "the first candidate in order of preference (nothing cached for "
                              "this CPU to compare with)"
                            : "the choice of the rates cached for this CPU at " + near;
      spdlog::warn(
          "GEMM measurement disturbed by load from elsewhere ({}): keeping {}, {}, rather than "
          "a choice the load made; not cached (a start on a quiet machine measures again)",
          d.interference, kernels::gemm_kind_name(candidates[d.winner]), kept);
      c.source = "measured under load from elsewhere; kept " + kept;
    }
  }
  world.broadcast(&winner, 1, 0);
  return winner;
}

}  // namespace

GemmChoice choose_gemm(const Job& job) {
  const Recipe& r = job.recipe;
  const parallel::Comm& world = job.mesh->world();
  const bool root = world.rank() == 0;
  GemmChoice c;
  c.threads = setup_rank_threads(r, job.env, /*report=*/false);

  TrainPrecision precision = r.train.precision;
  GemmLibrary library = r.hardware.gemm;
  c.source = "the recipe";
  std::string resumed;  // rank 0's: the snapshot's index path
  if (root && !r.snapshot.resume.empty())
    resumed = fill_from_snapshot(r, &precision, &library, &c.source);
  // Rank 0's partial resolution, then the candidates every rank measures if any auto is left.
  int resolved[2] = {static_cast<int>(precision), static_cast<int>(library)};
  world.broadcast(resolved, 2, 0);
  precision = static_cast<TrainPrecision>(resolved[0]);
  library = static_cast<GemmLibrary>(resolved[1]);
  const std::vector<GemmKind> candidates = gemm_candidates(precision, library);
  T3D_ASSERT(!candidates.empty(), "no GEMM candidate for ", choice_name(precision), "/",
             choice_name(library));

  // Rank 0's device decides for every rank. A GPU's GEMMs are cuBLAS in the precision's inputs:
  // no CPU kind to measure; the kind chosen below only names that precision (and what a CPU
  // resuming the snapshots runs).
  if (root) c.device = kernels::Device::describe(r.hardware.device, job.env.local_rank);
  world.broadcast(c.device, 0);
  const bool gpu = kernels::Device::is_gpu(c.device);
  int winner = 0;
  if (gpu) {
    // auto is fp32 on a GPU until bf16 there is measured against it (issue 41).
    if (precision == TrainPrecision::kAuto) precision = TrainPrecision::kFp32;
    for (size_t i = 0; i < candidates.size(); ++i)
      if (kernels::gemm_kind_is_bf16(candidates[i]) == (precision == TrainPrecision::kBf16)) {
        winner = static_cast<int>(i);
        break;
      }
    c.source = "on a GPU nothing is measured on the CPU";
  } else if (candidates.size() > 1) {
    winner = measured_winner(job, candidates, c);
  }
  c.kind = candidates[static_cast<size_t>(winner)];
  c.library = library_of(c.kind);
  // auto precision follows the winner: bf16 only where bf16 GEMMs are what makes it faster.
  if (precision == TrainPrecision::kAuto)
    precision = kernels::gemm_kind_is_bf16(c.kind) ? TrainPrecision::kBf16 : TrainPrecision::kFp32;
  c.precision = precision;
  kernels::verify_gemm_kind(c.kind);
  if (gpu) {
    const GpuGemmTable table = choose_gpu_gemm_table(job, c.kind, resumed);
    c.gpu_gemm_table = table.text;
    c.gpu_gemm_table_source = table.source;
  }

  if (root) record(c, job.run_dir);
  return c;
}

HostPeaks gpu_peaks(const kernels::Device& gpu, GemmKind kind, int local_ranks) {
  HostPeaks p;
  const kernels::GpuSpec* spec = gpu.spec();
  const bool bf16 = kernels::gemm_kind_is_bf16(kind);
  const int gpus = std::min(std::max(1, local_ranks), std::max(1, gpu.visible_gpus()));
  if (!spec) {
    spdlog::warn("MFU: {} is not in titan3d's GPU table (kernels/gpu_specs.h): no MFU (0)",
                 gpu.description());
    return p;
  }
  p.hardware_gflops = 1000 * (bf16 ? spec->bf16_tflops : spec->fp32_tflops) * gpus;
  spdlog::info(
      "MFU against {:.0f} GFLOP/s per host: {} GPU(s) × {} {} peak (its datasheet); no mfu_gemm "
      "on a GPU",
      p.hardware_gflops, gpus, spec->label, bf16 ? "dense bf16" : "fp32 (TF32 off)");
  return p;
}

HostPeaks host_peaks(GemmKind kind, int64_t rows, int64_t in, int64_t out, int cores) {
  HostPeaks p;
  const std::string cpu = kernels::cpu_model_name();
  // oneDNN runs bf16 GEMMs on AMX tiles where the CPU has them, else on the dot product.
  const bool amx = kernels::gemm_kind_is_bf16(kind) && kernels::cpu_runs_amx_bf16();
  const bool bf16 = kernels::gemm_kind_is_bf16(kind) && kernels::cpu_has_bf16_dot();
  p.hardware_what = amx ? "bf16 AMX tile" : bf16 ? "bf16 dot product" : "fp32 FMA";
  const fs::path dir = cache_dir();
  p.hardware_gflops =
      cores * cached_number(dir / "core_peak.txt", cpu + "|" + p.hardware_what, [&] {
        const auto peak = kernels::measure_core_peak();
        return amx ? peak.amx_bf16_gflops : bf16 ? peak.bf16_gflops : peak.fp32_gflops;
      });
  // The best of a few medians, so a burst of load from elsewhere does not lower it.
  std::ostringstream key;
  key << cpu << "|" << kernels::gemm_kind_name(kind) << "|" << kernels::openblas_corename() << "|"
      << kernels::onednn_version_string() << "|" << rows << "x" << in << "x" << out;
  p.gemm_gflops = cores * cached_number(dir / "gemm_peak.txt", key.str(), [&] {
                    double best = 0;
                    for (int i = 0; i < 3; ++i)
                      best =
                          std::max({best, kernels::measure_gemm_gflops(kind, rows, in, out, 1, 5),
                                    kernels::measure_gemm_gflops(kind, rows, in, in, 1, 5)});
                    return best;
                  });
  return p;
}

JobPrecision recorded_precision(const Recipe& recipe) {
  const TrainPrecision precision = recipe.train.precision == TrainPrecision::kAuto
                                       ? TrainPrecision::kFp32
                                       : recipe.train.precision;
  const GemmLibrary library =
      recipe.hardware.gemm == GemmLibrary::kAuto ? GemmLibrary::kOpenBlas : recipe.hardware.gemm;
  return {gemm_kind_of(precision, library), precision, {}};
}

Recipe recipe_as_run(const Job& job) {
  Recipe r = job.recipe;
  r.train.precision = job.precision().train;
  r.hardware.gemm = library_of(job.precision().gemm);
  return r;
}

}  // namespace t3d::runtime
