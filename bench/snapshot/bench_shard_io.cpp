// One rank's snapshot shard write, alone (no training beside it), against the file system's
// sequential rate measured with the same bytes, the same directory and the same fsync:
//   bench_shard_io DIR [GiB=2] [changed=0.88] [rounds=3]
// Prints, per round: sequential write() + fsync (the better of the page cache and O_DIRECT), a full
// shard, and an incremental shard against it in which a `changed` share of the chunks differ.
// Medians over the rounds last.
#include <fcntl.h>
#include <unistd.h>

#include <algorithm>
#include <chrono>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <filesystem>
#include <string>
#include <vector>

#include "checkpoint/snapshot.h"

namespace ck = t3d::checkpoint;
using Clock = std::chrono::steady_clock;

namespace {

double since(Clock::time_point t0) {
  return std::chrono::duration<double>(Clock::now() - t0).count();
}

// Seconds to write `data` to `path` and fsync it: through the page cache in 64 MiB writes, or with
// O_DIRECT in 8 MiB writes from an aligned buffer (-1 where the file system refuses O_DIRECT).
double sequential_write(const std::string& path, const std::vector<float>& data, bool direct) {
  constexpr size_t kPiece = size_t(8) << 20;
  const auto t0 = Clock::now();
  const int fd = ::open(path.c_str(), O_WRONLY | O_CREAT | O_TRUNC | (direct ? O_DIRECT : 0), 0644);
  if (fd < 0 && direct) return -1;
  if (fd < 0) std::perror("open"), std::exit(1);
  const char* p = reinterpret_cast<const char*>(data.data());
  const size_t bytes = data.size() * sizeof(float);
  void* aligned = nullptr;
  if (direct && ::posix_memalign(&aligned, 4096, kPiece) != 0)
    std::perror("memalign"), std::exit(1);
  for (size_t done = 0; done < bytes;) {
    size_t n = std::min(bytes - done, direct ? kPiece : size_t(1) << 26);
    const char* from = p + done;
    if (direct) {
      std::memcpy(aligned, from, n);
      n = (n + 4095) / 4096 * 4096;  // the last piece rounded up to whole blocks
      from = static_cast<const char*>(aligned);
    }
    const ssize_t w = ::write(fd, from, n);
    if (w <= 0) std::perror("write"), std::exit(1);
    done += static_cast<size_t>(w);
  }
  std::free(aligned);
  if (::fsync(fd) != 0 || ::close(fd) != 0) std::perror("fsync"), std::exit(1);
  const double s = since(t0);
  ::unlink(path.c_str());
  return s;
}

double median(std::vector<double> v) {
  std::sort(v.begin(), v.end());
  return v.size() % 2 ? v[v.size() / 2] : 0.5 * (v[v.size() / 2 - 1] + v[v.size() / 2]);
}

}  // namespace

int main(int argc, char** argv) {
  if (argc < 2) {
    std::fprintf(stderr, "usage: %s DIR [GiB=2] [changed=0.88] [rounds=3]\n", argv[0]);
    return 2;
  }
  const std::string dir = argv[1];
  const double gib = argc > 2 ? std::atof(argv[2]) : 2.0;
  const double changed = argc > 3 ? std::atof(argv[3]) : 0.88;
  const int rounds = argc > 4 ? std::atoi(argv[4]) : 3;
  std::filesystem::create_directories(dir);

  // Tensors of 1024 columns, 4096 rows each (16 MiB), like a dim-1024 model's matrices.
  constexpr int64_t kCols = 1024, kRows = 4096;
  const auto tensors = std::max<int64_t>(
      1, static_cast<int64_t>(gib * (1 << 30)) / (kRows * kCols * int64_t(sizeof(float))));
  std::vector<float> state(static_cast<size_t>(tensors * kRows * kCols));
  for (size_t i = 0; i < state.size(); ++i) state[i] = static_cast<float>(i % 9973) * 1e-3f;
  std::vector<float> parent_state = state;
  auto slices_of = [&](std::vector<float>& buf) {
    std::vector<ck::Slice> s;
    for (int64_t t = 0; t < tensors; ++t)
      s.push_back({"model/t" + std::to_string(t),
                   {kRows, kCols},
                   {0, 0},
                   {kRows, kCols},
                   buf.data() + t * kRows * kCols});
    return s;
  };
  const auto slices = slices_of(state);
  const auto parent = slices_of(parent_state);
  const double bytes = static_cast<double>(state.size() * sizeof(float));
  std::printf("bench_shard_io: %.2f GiB in %lld tensors, %.0f%% of chunks changed, dir %s\n",
              bytes / (1 << 30), static_cast<long long>(tensors), 100 * changed, dir.c_str());
  // incr MB/s: the state's bytes over the incremental write's time; incr w MB/s: the bytes it
  // stored over that time (per byte written, against a full one's).
  std::printf("%-6s %10s %10s %10s %12s %8s %8s %10s\n", "round", "seq MB/s", "full MB/s",
              "incr MB/s", "incr w MB/s", "full/seq", "incr/full", "w/full");
  std::vector<double> seq_v, full_v, incr_v, incr_w_v;
  for (int r = 0; r < rounds; ++r) {
    // The file system's rate: the better of the page cache and O_DIRECT (which wins swings with
    // the CPU load, since the page cache's copy needs a core).
    const double seq_buffered = sequential_write(dir + "/seq.bin", state, false);
    const double seq_direct = sequential_write(dir + "/seq.bin", state, true);
    const double seq = seq_direct > 0 ? std::min(seq_buffered, seq_direct) : seq_buffered;
    const std::string full_path = ck::shard_path(dir, 1, 0);
    auto t0 = Clock::now();
    const auto full = ck::write_shard(full_path, 0, parent);
    const double full_s = since(t0);
    // Change a `changed` share of every tensor's chunks (whole chunks, spread evenly).
    const int64_t chunk = ck::chunk_elems({kRows, kCols});
    const int64_t per = kRows * kCols / chunk;
    for (int64_t t = 0; t < tensors; ++t)
      for (int64_t c = 0; c < per; ++c)
        if (static_cast<double>((c * 7919 + t) % per) < changed * static_cast<double>(per))
          for (int64_t i = 0; i < chunk; ++i) state[t * kRows * kCols + c * chunk + i] += 1e-3f;
    ck::WriteOptions opt;
    opt.previous_hashes = &full.hashes, opt.skip_unchanged = true;
    t0 = Clock::now();
    const auto incr = ck::write_shard(ck::shard_path(dir, 2, 0), 0, slices, opt);
    const double incr_s = since(t0);
    std::filesystem::remove_all(dir + "/" + ck::snapshot_name(1));
    std::filesystem::remove_all(dir + "/" + ck::snapshot_name(2));
    state = parent_state;
    seq_v.push_back(bytes / seq / 1e6), full_v.push_back(bytes / full_s / 1e6);
    incr_v.push_back(bytes / incr_s / 1e6);
    const double written = static_cast<double>(incr.chunks_written) / incr.chunks;
    incr_w_v.push_back(written * bytes / incr_s / 1e6);
    std::printf(
        "%-6d %10.0f %10.0f %10.0f %12.0f %8.2f %8.2f %10.2f   (seq: page cache %.0f, O_DIRECT "
        "%.0f MB/s; incremental: %lld of %lld "
        "chunks; O_DIRECT full %.0f%%, incr %.0f%%; read back for the digest %.1f / %.1f MiB)\n",
        r + 1, seq_v.back(), full_v.back(), incr_v.back(), incr_w_v.back(), seq / full_s,
        full_s / incr_s, incr_w_v.back() / full_v.back(), bytes / seq_buffered / 1e6,
        seq_direct > 0 ? bytes / seq_direct / 1e6 : 0.0,
        static_cast<long long>(incr.chunks_written), static_cast<long long>(incr.chunks),
        100.0 * full.direct_bytes / bytes, 100.0 * incr.direct_bytes / (written * bytes),
        full.read_back_bytes / 1048576.0, incr.read_back_bytes / 1048576.0);
  }
  std::printf("%-6s %10.0f %10.0f %10.0f %12.0f %8.2f %8.2f %10.2f\n", "median", median(seq_v),
              median(full_v), median(incr_v), median(incr_w_v), median(full_v) / median(seq_v),
              median(incr_v) / median(full_v), median(incr_w_v) / median(full_v));
  return 0;
}
