#include "parallel/fault.h"

#include <spdlog/spdlog.h>

#include <chrono>
#include <csignal>
#include <cstdio>
#include <cstdlib>
#include <map>
#include <sstream>
#include <thread>
#include <vector>

#include "kernels/check.h"

namespace t3d::parallel::fault::detail {

namespace {

enum class Kind { none, skip, die, corrupt, nosend, die_at_step, slow_step, slow_link, flip };

struct Spec {
  Kind kind = Kind::none;
  int rank = -1;
  std::string group = "*";
  long n = 0;
  int peer = -1;  // slow_link's other rank
  Flip flip = Flip::none;
};

std::vector<std::string> split(const std::string& s, char sep) {
  std::vector<std::string> parts;
  std::stringstream in(s);
  for (std::string p; std::getline(in, p, sep);) parts.push_back(p);
  return parts;
}

Spec parse(const char* text) {
  Spec s;
  if (!text || !*text) return s;
  const auto parts = split(text, ':');
  const auto bad = [&] {
    return UserError(std::string("T3D_FAULT=`") + text +
                     "` is malformed: expected skip:RANK:GROUP:N, die:RANK:GROUP:N, corrupt:RANK, "
                     "nosend:RANK, die_at_step:RANK:STEP, slow_step:RANK:MS, slow_link:A:B:MS or "
                     "flip:RANK:STEP:grad|param|act|update "
                     "(test-only; see parallel/fault.h)");
  };
  const std::map<std::string, Kind> kinds = {{"skip", Kind::skip},
                                             {"die", Kind::die},
                                             {"corrupt", Kind::corrupt},
                                             {"nosend", Kind::nosend},
                                             {"die_at_step", Kind::die_at_step},
                                             {"slow_step", Kind::slow_step},
                                             {"slow_link", Kind::slow_link},
                                             {"flip", Kind::flip}};
  const std::map<std::string, Flip> flips = {
      {"grad", Flip::grad}, {"param", Flip::param}, {"act", Flip::act}, {"update", Flip::update}};
  if (parts.size() < 2 || !kinds.count(parts[0])) throw bad();
  s.kind = kinds.at(parts[0]);
  const bool counted = s.kind == Kind::skip || s.kind == Kind::die;
  const bool stepped = s.kind == Kind::die_at_step || s.kind == Kind::slow_step;
  const bool link = s.kind == Kind::slow_link, flip = s.kind == Kind::flip;
  if (parts.size() != (counted || link || flip ? 4u : stepped ? 3u : 2u)) throw bad();
  try {
    s.rank = std::stoi(parts[1]);
    if (counted) s.group = parts[2], s.n = std::stol(parts[3]);
    if (stepped) s.n = std::stol(parts[2]);
    if (link) s.peer = std::stoi(parts[2]), s.n = std::stol(parts[3]);
    if (flip) s.n = std::stol(parts[2]);
  } catch (const std::exception&) {
    throw bad();
  }
  if (flip) {
    if (!flips.count(parts[3])) throw bad();
    s.flip = flips.at(parts[3]);
  }
  if (s.rank < 0 || ((counted || stepped || link || flip) && s.n < 1) || (link && s.peer < 0))
    throw bad();
  return s;
}

const Spec& spec() {
  static const Spec s = parse(std::getenv("T3D_FAULT"));
  return s;
}

template <typename T>
void double_all(void* data, size_t count) {
  T* x = static_cast<T*>(data);
  for (size_t i = 0; i < count; ++i) x[i] += x[i];
}

}  // namespace

bool active() { return spec().kind != Kind::none; }

bool before_operation(const std::string& group, int world_rank) {
  const Spec& s = spec();
  if ((s.kind != Kind::skip && s.kind != Kind::die) || s.rank != world_rank) return false;
  if (s.group != "*" && s.group != group) return false;
  static std::map<std::string, long> seen;  // operations per group on this process
  if (++seen[s.group == "*" ? "*" : group] != s.n) return false;
  const char* what = s.kind == Kind::die ? "dies" : "skips it";
  spdlog::warn("T3D_FAULT: world rank {} at its operation {} on group `{}`: {}", world_rank, s.n,
               group, what);
  if (s.kind == Kind::die) std::raise(SIGKILL);
  return true;
}

bool corrupts(int world_rank) { return spec().kind == Kind::corrupt && spec().rank == world_rank; }

void corrupt_sum(void* data, size_t count, MPI_Datatype type, int world_rank) {
  if (!corrupts(world_rank)) return;
  if (type == MPI_FLOAT) double_all<float>(data, count);
  if (type == MPI_DOUBLE) double_all<double>(data, count);
}

void at_step(int world_rank, long step) {
  const Spec& s = spec();
  if (s.kind == Kind::slow_step && s.rank == world_rank) {
    std::this_thread::sleep_for(std::chrono::milliseconds(s.n));
    return;
  }
  if (s.kind != Kind::die_at_step || s.rank != world_rank || s.n != step) return;
  spdlog::warn("T3D_FAULT: world rank {} dies at step {}", world_rank, step);
  std::raise(SIGKILL);
}

bool drop_send(int world_rank) { return spec().kind == Kind::nosend && spec().rank == world_rank; }

void delay_send(int from_world_rank, int to_world_rank) {
  const Spec& s = spec();
  if (s.kind != Kind::slow_link) return;
  if ((s.rank == from_world_rank && s.peer == to_world_rank) ||
      (s.rank == to_world_rank && s.peer == from_world_rank))
    std::this_thread::sleep_for(std::chrono::milliseconds(s.n));
}

}  // namespace t3d::parallel::fault::detail

namespace t3d::parallel::fault {

Flip flip_at(int world_rank, long step) {
  if (!detail::active()) return Flip::none;
  const detail::Spec& s = detail::spec();
  if (s.kind != detail::Kind::flip || s.rank != world_rank || s.n != step) return Flip::none;
  static const char* const kWhat[] = {"", "its local gradient", "a parameter",
                                      "a stored activation", "its optimizer update's output"};
  spdlog::warn("T3D_FAULT: world rank {} flips bit {} of {} at step {}", world_rank, kFlipBit,
               kWhat[static_cast<int>(s.flip)], step);
  return s.flip;
}

}  // namespace t3d::parallel::fault
