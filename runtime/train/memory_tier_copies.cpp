// The memory tier's buddy copies, commit and restore inventory (memory_tier_copies.h).
#include "runtime/train/memory_tier_copies.h"

#include <fcntl.h>
#include <spdlog/spdlog.h>
#include <sys/mman.h>
#include <unistd.h>

#include <algorithm>
#include <cerrno>
#include <chrono>
#include <cstdlib>
#include <cstring>
#include <filesystem>
#include <map>
#include <memory>
#include <optional>
#include <sstream>

#include "checkpoint/memory_tier_files.h"
#include "kernels/arena.h"
#include "kernels/check.h"
#include "runtime/launch/logging.h"

namespace t3d::runtime {

namespace fs = std::filesystem;
namespace ck = checkpoint;

namespace {

constexpr int kMoveTag = 30571;
constexpr size_t kPiece = size_t(1) << 28;  // bytes per message: far below MPI's int count

// Pieces as text, one per line: file, dataset, then global shape, offset and shape (each a
// comma-separated list), tab-separated; and back.
std::string pieces_text(const std::vector<ck::ShardPiece>& pieces) {
  const auto ints = [](const std::vector<int64_t>& v) {
    return fmt::format("{}", fmt::join(v, ","));
  };
  std::string out;
  for (const auto& p : pieces)
    out += fmt::format("{}\t{}\t{}\t{}\t{}\n", p.file, p.path, ints(p.global_shape), ints(p.offset),
                       ints(p.shape));
  return out;
}
std::vector<ck::ShardPiece> parse_pieces(const std::string& text) {
  const auto ints = [](const std::string& s) {
    std::vector<int64_t> v;
    std::istringstream in(s);
    for (std::string x; std::getline(in, x, ',');) v.push_back(std::stoll(x));
    return v;
  };
  std::vector<ck::ShardPiece> pieces;
  std::istringstream lines(text);
  for (std::string line; std::getline(lines, line);) {
    std::istringstream in(line);
    std::string f[5];
    for (auto& x : f) std::getline(in, x, '\t');
    pieces.push_back({f[0], f[1], ints(f[2]), ints(f[3]), ints(f[4])});
  }
  return pieces;
}

// A file mapped into memory (read, or created at a size and written), unmapped and closed at the
// end; errors name the file.
class Mapped {
 public:
  Mapped(const std::string& path, uint64_t create_bytes, bool create) : path_(path) {
    fd_ = create ? ::open(path.c_str(), O_RDWR | O_CREAT | O_TRUNC | O_CLOEXEC, 0600)
                 : ::open(path.c_str(), O_RDONLY | O_CLOEXEC);
    T3D_USER_CHECK(fd_ >= 0, "cannot open `", path, "`: ", std::strerror(errno));
    if (create) {
      T3D_USER_CHECK(::ftruncate(fd_, static_cast<off_t>(create_bytes)) == 0, "cannot size `", path,
                     "`: ", std::strerror(errno));
      bytes_ = create_bytes;
    } else {
      bytes_ = static_cast<uint64_t>(::lseek(fd_, 0, SEEK_END));
    }
    if (bytes_ == 0) return;
    void* p =
        ::mmap(nullptr, bytes_, create ? PROT_READ | PROT_WRITE : PROT_READ, MAP_SHARED, fd_, 0);
    T3D_USER_CHECK(p != MAP_FAILED, "cannot map `", path, "`: ", std::strerror(errno));
    data_ = static_cast<char*>(p);
  }
  ~Mapped() {
    if (data_) ::munmap(data_, bytes_);
    if (fd_ >= 0) ::close(fd_);
  }
  Mapped(const Mapped&) = delete;
  Mapped& operator=(const Mapped&) = delete;
  char* data() const { return data_; }
  uint64_t bytes() const { return bytes_; }

 private:
  std::string path_;
  int fd_ = -1;
  char* data_ = nullptr;
  uint64_t bytes_ = 0;
};

// Bytes of the files under `dir` (0 when it does not exist).
uint64_t bytes_under(const std::string& dir) {
  uint64_t n = 0;
  std::error_code ec;
  for (const auto& e : fs::recursive_directory_iterator(dir, ec))
    if (e.is_regular_file(ec)) n += e.file_size(ec);
  return n;
}

// Files moving between ranks without blocking: both sides know each file's size and cut it into
// the same pieces of at most kPiece bytes, sent straight from the file mapped on one side and
// received straight into a temporary mapped on the other (no staging copy). A file that cannot be
// read (or has another size) is sent as empty pieces (a receive may take less than it asked for)
// and one whose temporary cannot be made is received into a sink, so that no peer waits for
// ever; the error is kept for the agreement. Pieces of one pair of ranks match by order, so both
// sides post a pair's files in the same order.
class FileTransfer {
 public:
  explicit FileTransfer(const parallel::Comm& world) : world_(world) {}
  // Sends `path`, which must hold `bytes`, to rank `dst`.
  void send(const std::string& path, uint64_t bytes, int dst) {
    static const char nothing = 0;
    const char* data = &nothing;
    try {
      files_.push_back(std::make_unique<Mapped>(path, 0, false));
      T3D_USER_CHECK(files_.back()->bytes() == bytes, "`", path, "` holds ", files_.back()->bytes(),
                     " bytes, not ", bytes);
      data = files_.back()->data();
    } catch (const std::exception& e) {
      if (error_.empty()) error_ = e.what();
    }
    for (uint64_t at = 0; at < bytes; at += kPiece) {
      const size_t n = data == &nothing ? 0 : std::min<uint64_t>(kPiece, bytes - at);
      requests_.emplace_back(world_.isend(data == &nothing ? data : data + at, n, dst, kMoveTag),
                             dst);
    }
  }
  // Receives `bytes` from rank `src` into a temporary of `path`, renamed by complete().
  void receive(const std::string& path, uint64_t bytes, int src) {
    char* into = nullptr;
    const std::string tmp = ck::temp_path(path);
    try {
      std::error_code ec;
      fs::create_directories(fs::path(path).parent_path(), ec);
      files_.push_back(std::make_unique<Mapped>(tmp, bytes, true));
      into = files_.back()->data();
      received_.emplace_back(tmp, path);
    } catch (const std::exception& e) {
      if (error_.empty()) error_ = e.what();
      sinks_.emplace_back(bytes);
      into = sinks_.back().data();
    }
    for (uint64_t at = 0; at < bytes; at += kPiece)
      requests_.emplace_back(
          world_.irecv(into + at, std::min<uint64_t>(kPiece, bytes - at), src, kMoveTag), src);
  }
  // Whether every piece left and arrived (never blocks; not collective).
  bool arrived() {
    bool done = true;
    for (auto& [request, peer] : requests_) done = world_.test(request) && done;
    return done;
  }
  // Whether MPI may still read or write a buffer (then they must stay mapped).
  bool in_flight() const {
    return std::any_of(requests_.begin(), requests_.end(),
                       [](const auto& r) { return r.first.pending; });
  }
  // Waits for every piece (watchdog), unmaps the files and, unless this rank failed, renames
  // what it received into place. Returns this rank's first error ("" none).
  std::string complete() {
    for (auto& [request, peer] : requests_) world_.wait(request, "memory tier copy", peer);
    files_.clear();  // unmapped and closed: what arrived is in the files
    for (const auto& [tmp, path] : received_) {
      std::error_code ec;
      if (error_.empty()) fs::rename(tmp, path, ec);
      if (ec && error_.empty()) error_ = "cannot rename `" + tmp + "`: " + ec.message();
    }
    return error_;
  }
  // Removes the temporaries received (after a failure agreed on; renamed ones stay).
  void discard() {
    for (const auto& [tmp, path] : received_) {
      std::error_code ec;
      fs::remove(tmp, ec);
    }
  }

 private:
  const parallel::Comm& world_;
  std::vector<std::unique_ptr<Mapped>> files_;
  std::vector<std::vector<char>> sinks_;  // where a receive goes whose file cannot be made
  std::vector<std::pair<parallel::Request, int>>
      requests_;  // with the peer, for the watchdog's message
  std::vector<std::pair<std::string, std::string>> received_;  // temporary, final path
  std::string error_;
};

// The first world rank whose host holds shard i of n (`held`: rank-major), or -1.
int first_holder(const std::vector<char>& held, size_t n, size_t i) {
  for (size_t k = 0; k * n < held.size(); ++k)
    if (held[k * n + i]) return static_cast<int>(k);
  return -1;
}
}  // namespace

std::vector<char> shards_read(const std::vector<ck::ShardEntry>& shards,
                              const std::vector<ck::ShardPiece>& pieces,
                              const std::vector<ck::Slice>& boxes) {
  const auto overlaps = [](const ck::ShardPiece& p, const ck::Slice& s) {
    if (p.path.substr(0, p.path.find(ck::kBoxSuffix)) != s.path ||
        p.offset.size() != s.offset.size() || p.shape.size() != s.shape.size())
      return false;
    for (size_t d = 0; d < s.offset.size(); ++d)
      if (p.offset[d] >= s.offset[d] + s.shape[d] || s.offset[d] >= p.offset[d] + p.shape[d])
        return false;
    return true;
  };
  std::vector<char> read(shards.size(), 0);
  for (size_t i = 0; i < shards.size(); ++i)
    for (const auto& p : pieces)
      if (p.file == shards[i].file)
        for (const auto& box : boxes) read[i] = read[i] || overlaps(p, box);
  return read;
}

std::vector<FileMove> restore_moves(const HostRing& ring, const std::vector<ck::ShardEntry>& shards,
                                    const std::vector<char>& held, const std::vector<char>& read) {
  const size_t n = shards.size();
  std::vector<FileMove> moves;
  for (size_t h = 0; h < ring.leader.size(); ++h) {
    const int to = ring.leader[h];
    for (size_t i = 0; i < n; ++i) {
      bool wanted = false;
      for (size_t k = 0; k < ring.host_of.size(); ++k)
        wanted = wanted || (ring.host_of[k] == static_cast<int>(h) && read[k * n + i]);
      const int from = first_holder(held, n, i);
      if (wanted && !held[static_cast<size_t>(to) * n + i] && from >= 0)
        moves.push_back({from, to, shards[i].file, shards[i].bytes});
    }
  }
  return moves;
}

HostRing host_ring(const std::vector<std::string>& host_of_rank) {
  HostRing ring;
  for (size_t r = 0; r < host_of_rank.size(); ++r) {
    const auto it = std::find(ring.names.begin(), ring.names.end(), host_of_rank[r]);
    if (it == ring.names.end()) {
      ring.host_of.push_back(static_cast<int>(ring.names.size()));
      ring.names.push_back(host_of_rank[r]);
      ring.leader.push_back(static_cast<int>(r));
    } else {
      ring.host_of.push_back(static_cast<int>(it - ring.names.begin()));
    }
  }
  return ring;
}

MemoryTier::MemoryTier(const Job& job, ck::IoThread& io) : job_(job), io_(io) {
  if (job.recipe.snapshot.memory_every <= 0) return;
  if (const char* id = std::getenv("T3D_MEMORY_TIER_JOB")) job_id_ = id;
  if (job_id_.empty()) return;
  const char* again = std::getenv("T3D_MEMORY_TIER_RESTORE");
  restoring_ = again && std::string(again) == "1" && job.recipe.snapshot.resume == "latest";
  dir_ = ck::memory_tier_dir(job_id_, job.hostname);
  ring_ = host_ring(job.hosts);
}

bool MemoryTier::leader() const {
  return ring_.leader[ring_.host_of[job_.mesh->rank()]] == job_.mesh->rank();
}

void MemoryTier::start(uint64_t mine_bytes) {
  const auto& world = job_.mesh->world();
  const std::string run_key = job_id_.substr(0, job_id_.find('-'));
  std::vector<std::string> removed;
  if (leader())
    removed =
        ck::remove_memory_tiers(run_key + "-", job_.hostname, restoring_ ? job_id_ + "-" : "");
  for (const auto& path : removed)
    spdlog::warn(
        "memory tier: removed {}, left in /dev/shm by a job of this run directory that no "
        "longer runs",
        path);
  // Per rank: host index, shard bytes; a host keeps two snapshots of its ranks' shards and of
  // the buddy copies it receives.
  const uint64_t mine[2] = {static_cast<uint64_t>(ring_.host_of[world.rank()]), mine_bytes};
  std::vector<uint64_t> all(2 * static_cast<size_t>(world.size()));
  world.all_gather(mine, all.data(), 2);
  const int host = ring_.host_of[world.rank()];
  uint64_t own = 0, buddies = 0;
  for (int k = 0; k < world.size(); ++k) {
    const auto b = all[2 * static_cast<size_t>(k) + 1];
    if (ring_.host_of[k] == host) own += b;
    if (ring_.copies() && ring_.host_of[ring_.buddy(k)] == host && ring_.host_of[k] != host)
      buddies += b;
  }
  const uint64_t need = 2 * (own + buddies);
  agree_on(world, [&] {
    if (!leader()) return;
    std::error_code ec;
    fs::create_directories(dir_, ec);
    T3D_USER_CHECK(!ec, "snapshot.memory_every: cannot create `", dir_, "`: ", ec.message());
    // What this job's directory holds now (a restart's snapshot) is replaced as it goes.
    const uint64_t free = ck::memory_tier_free_bytes() + (restoring_ ? bytes_under(dir_) : 0);
    T3D_USER_CHECK(
        need <= free, "recipe error: ", job_.recipe.origin("snapshot.memory_every"),
        ": `snapshot.memory_every` = ", job_.recipe.snapshot.memory_every, ": /dev/shm on host ",
        job_.hostname, " cannot hold the memory tier: it needs ", kernels::format_bytes(need),
        " (two snapshots of its ranks' shards, ", kernels::format_bytes(own),
        ", and of the buddy copies it keeps, ", kernels::format_bytes(buddies), ") and has ",
        kernels::format_bytes(free),
        " free. Enlarge /dev/shm (mount -o remount,size=...), run fewer ranks per host, or set "
        "snapshot.memory_every = 0.");
  });
  if (world.rank() == 0)
    spdlog::info(
        "memory tier: a snapshot every {} steps in {} (each host its own), {}; /dev/shm needs "
        "{} on this host",
        job_.recipe.snapshot.memory_every, ck::memory_tier_dir(job_id_, "<host>"),
        ring_.copies()
            ? fmt::format("each host's shards also copied to the next host's ({} -> {})",
                          fmt::join(ring_.names, " -> "), ring_.names.front())
            : std::string("one host, so the buddy copy adds nothing: the snapshot lives in this "
                          "host's /dev/shm only (it survives a rank's failure, not the host's)"),
        kernels::format_bytes(need));
}

std::string MemoryTier::move_files(const std::vector<FileMove>& moves) {
  const auto& world = job_.mesh->world();
  FileTransfer transfer(world);
  for (const FileMove& m : moves) {
    if (m.src == world.rank()) transfer.send(dir_ + "/" + m.file, m.bytes, m.dst);
    if (m.dst == world.rank()) transfer.receive(dir_ + "/" + m.file, m.bytes, m.src);
  }
  return agreed_error(world, transfer.complete());
}

// The buddy copies in flight, and when and how many bytes they started.
struct MemoryTier::Copies {
  explicit Copies(const parallel::Comm& world) : transfer(world) {}
  FileTransfer transfer;
  std::chrono::steady_clock::time_point t0 = std::chrono::steady_clock::now();
  uint64_t bytes = 0;
};

MemoryTier::~MemoryTier() {
  // MPI may still write into or read from the files until the process ends: left mapped.
  if (copies_ && copies_->transfer.in_flight()) (void)copies_.release();
}

void MemoryTier::start_copies(const ck::IndexInfo& info, const std::vector<int>& writers) {
  const auto& world = job_.mesh->world();
  copies_ = std::make_unique<Copies>(world);
  if (!ring_.copies()) return;
  for (size_t i = 0; i < info.shards.size(); ++i) {
    const int src = writers[i], dst = ring_.buddy(src);
    const std::string path = dir_ + "/" + info.shards[i].file;
    copies_->bytes += info.shards[i].bytes;
    if (src == world.rank()) copies_->transfer.send(path, info.shards[i].bytes, dst);
    if (dst == world.rank()) copies_->transfer.receive(path, info.shards[i].bytes, src);
  }
}

bool MemoryTier::copies_done() { return copies_->transfer.arrived(); }

std::string MemoryTier::finish_commit(const ck::IndexInfo& info, double* copy_s, uint64_t* copied) {
  const auto& world = job_.mesh->world();
  Copies& c = *copies_;
  std::string error = c.transfer.complete();
  *copy_s = seconds_since(c.t0);
  *copied = c.bytes;
  error = agreed_error(world, error);
  if (!error.empty()) {
    c.transfer.discard();
    copies_.reset();
    return "its buddy copy failed on " + error;
  }
  copies_.reset();
  std::string mine;
  if (leader()) try {
      ck::write_manifest(dir_, info);
    } catch (const std::exception& e) {
      mine = e.what();
    }
  error = agreed_error(world, mine);
  if (!error.empty()) return "writing its manifest failed on " + error;
  if (leader()) ck::retain_memory_snapshot(dir_, info.step);
  return "";
}

std::string MemoryTier::share_catalog(const ck::IndexInfo& info, const std::vector<int>& source,
                                      std::vector<ck::ShardPiece>* pieces) {
  const auto& world = job_.mesh->world();
  const size_t n = info.shards.size();
  std::string catalog, unreadable;
  try {
    std::vector<ck::ShardPiece> read;
    io_.run([&] {
      for (size_t i = 0; i < n; ++i)
        if (source[i] == world.rank())
          for (auto& p : ck::shard_pieces(dir_, info.shards[i].file)) read.push_back(std::move(p));
    });
    catalog = pieces_text(read);
  } catch (const std::exception& e) {
    unreadable = e.what();
  }
  if (std::string error = agreed_error(world, unreadable); !error.empty()) return error;
  std::map<std::string, std::vector<ck::ShardPiece>> by_file;
  for (const int leader_rank : ring_.leader) {
    std::string part = world.rank() == leader_rank ? catalog : "";
    world.broadcast(part, leader_rank);
    for (auto& p : parse_pieces(part)) by_file[p.file].push_back(std::move(p));
  }
  for (const auto& shard : info.shards)
    for (auto& p : by_file[shard.file]) pieces->push_back(std::move(p));
  return "";
}

std::string MemoryTier::prepare_restore(int64_t disk_step, const std::vector<ck::Slice>& boxes,
                                        int64_t* step, uint64_t* id, std::string* why) {
  const auto& world = job_.mesh->world();
  const auto t0 = std::chrono::steady_clock::now();
  // Per rank: newest manifest's step + 1 (0: none; only hosts' leaders look) and its id.
  uint64_t mine[2] = {0, 0};
  std::optional<ck::IndexInfo> manifest;
  if (leader()) {
    const auto steps = ck::manifest_steps(dir_);
    if (!steps.empty()) manifest = ck::read_manifest(dir_, steps.back());
    if (manifest) mine[0] = static_cast<uint64_t>(manifest->step) + 1, mine[1] = manifest->id;
  }
  std::vector<uint64_t> all(2 * static_cast<size_t>(world.size()));
  world.all_gather(mine, all.data(), 2);
  int root = -1;
  for (int k = 0; k < world.size(); ++k)
    if (all[2 * k] > 0 && (root < 0 || all[2 * k] > all[2 * root])) root = k;
  const std::string living =
      fmt::format("{} living host(s): {}", ring_.names.size(), fmt::join(ring_.names, ", "));
  if (root < 0) {
    *why = "no complete memory snapshot in /dev/shm on the " + living;
    return "";
  }
  *step = static_cast<int64_t>(all[2 * root]) - 1;
  *id = all[2 * root + 1];
  if (*step <= disk_step) {
    *why = fmt::format(
        "the memory tier's newest complete snapshot (step {}) is not newer than the disk's "
        "(step {})",
        *step, disk_step);
    return "";
  }
  std::string text = world.rank() == root ? ck::manifest_text(*manifest) : "";
  world.broadcast(text, root);
  const auto info = ck::parse_manifest(text);
  T3D_ASSERT(info.has_value(), "memory tier manifest garbled in transit");
  const size_t n = info->shards.size();
  // Which host's directory holds which shard of that snapshot (whole: its size checked here, its
  // hash by the reader).
  std::vector<char> have(n, 0), held(n * static_cast<size_t>(world.size()), 0);
  if (leader())
    for (size_t i = 0; i < n; ++i) {
      std::error_code ec;
      const auto size = fs::file_size(dir_ + "/" + info->shards[i].file, ec);
      have[i] = !ec && size == info->shards[i].bytes ? 1 : 0;
    }
  world.all_gather(have.data(), held.data(), n);
  // Each shard comes from the first rank whose host holds it.
  std::vector<int> source(n, -1);
  for (size_t i = 0; i < n; ++i) {
    source[i] = first_holder(held, n, i);
    if (source[i] < 0) {
      *why = fmt::format(
          "the memory tier's step {} has no living copy of shard {} (neither its host's "
          "/dev/shm nor its buddy's is among the {})",
          *step, info->shards[i].file, living);
      return "";
    }
  }
  // The catalog, so that every host can index the snapshot while holding only the shards it reads.
  std::vector<ck::ShardPiece> pieces;
  if (std::string error = share_catalog(*info, source, &pieces); !error.empty()) {
    *why = "reading the memory tier's catalog failed on " + error;
    return "";
  }
  // The shards each rank reads; each host gets those of its ranks.
  const std::vector<char> need = shards_read(info->shards, pieces, boxes);
  std::vector<char> needed(n * static_cast<size_t>(world.size()), 0);
  world.all_gather(need.data(), needed.data(), n);
  const std::vector<FileMove> moves = restore_moves(ring_, info->shards, held, needed);
  uint64_t moved = 0;
  for (const auto& m : moves) moved += m.bytes;
  if (std::string error = move_files(moves); !error.empty()) {
    *why = "moving the memory tier's shards between hosts failed on " + error;
    return "";
  }
  std::string failed;
  if (leader()) try {
      if (!manifest || manifest->step != *step) ck::write_manifest(dir_, *info);
      io_.run([&] { ck::write_index(dir_, *info, &pieces); });
    } catch (const std::exception& e) {
      failed = e.what();
    }
  if (std::string error = agreed_error(world, failed); !error.empty()) {
    *why = "writing the memory tier's index failed on " + error;
    return "";
  }
  if (world.rank() == 0)
    spdlog::info(
        "memory tier: step {} complete among the {}; {} shard(s) ({}) moved to the hosts whose "
        "ranks read them; indexed in {:.2f} s",
        *step, living, moves.size(), kernels::format_bytes(moved), seconds_since(t0));
  return ck::index_path(dir_, *step);
}

void MemoryTier::remove() {
  job_.mesh->world().barrier();
  if (!leader()) return;
  std::error_code ec;
  fs::remove_all(dir_, ec);
}

}  // namespace t3d::runtime
