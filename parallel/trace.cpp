#include "parallel/trace.h"

#include <unistd.h>

#include <cstdio>
#include <filesystem>
#include <fstream>
#include <mutex>
#include <thread>
#include <vector>

#include "kernels/check.h"
#include "parallel/comm.h"

namespace t3d::parallel::trace {

namespace detail {
bool g_enabled = false;
}

namespace {

struct Recorder {
  std::mutex mutex;  // the snapshot I/O thread may record too
  std::chrono::steady_clock::time_point origin;
  int rank = 0;
  std::string label;
  std::vector<std::string> events;       // serialised JSON objects
  std::vector<std::thread::id> threads;  // index = tid in the trace
};

Recorder& recorder() {
  static Recorder r;
  return r;
}

int thread_index(Recorder& r) {
  const auto id = std::this_thread::get_id();
  for (size_t i = 0; i < r.threads.size(); ++i)
    if (r.threads[i] == id) return static_cast<int>(i);
  r.threads.push_back(id);
  return static_cast<int>(r.threads.size() - 1);
}

// Metadata events that name the rank's row ("process") and keep rows in rank order.
std::string metadata(int rank, const std::string& label) {
  char buf[512];
  std::snprintf(buf, sizeof(buf),
                "{\"name\": \"process_name\", \"ph\": \"M\", \"pid\": %d, \"args\": {\"name\": "
                "%s}},\n{\"name\": \"process_sort_index\", \"ph\": \"M\", \"pid\": "
                "%d, \"args\": {\"sort_index\": %d}}",
                rank, json_string("rank " + std::to_string(rank) + " " + label).c_str(), rank,
                rank);
  return buf;
}

std::string joined(const std::vector<std::string>& events) {
  std::string out;
  for (const auto& e : events) out += (out.empty() ? "" : ",\n") + e;
  return out;
}

void write_file(const std::string& path, const std::string& body) {
  std::ofstream out(path);
  out << "{\"displayTimeUnit\": \"ms\", \"traceEvents\": [\n" << body << "\n]}\n";
  T3D_USER_CHECK(out.good(), "cannot write trace file `", path, "`");
}

}  // namespace

namespace detail {
void record(const char* name, const char* category, std::chrono::steady_clock::time_point start,
            std::chrono::steady_clock::time_point end, std::string args) {
  Recorder& r = recorder();
  using us = std::chrono::duration<double, std::micro>;
  const double ts = us(start - r.origin).count(), dur = us(end - start).count();
  char head[256];
  std::lock_guard lock(r.mutex);
  std::snprintf(head, sizeof(head),
                "{\"name\": \"%s\", \"cat\": \"%s\", \"ph\": \"X\", \"ts\": %.3f, \"dur\": %.3f, "
                "\"pid\": %d, \"tid\": %d, \"args\": {",
                name, category, ts, dur, r.rank, thread_index(r));
  r.events.push_back(head + args + "}}");
}
}  // namespace detail

void enable(const Comm& world, const std::string& label) {
  Recorder& r = recorder();
  r.rank = world.rank();
  r.label = label;
  r.events.clear();
  r.events.reserve(1 << 14);
  world.barrier();
  r.origin = std::chrono::steady_clock::now();
  detail::g_enabled = true;
}

Span& Span::arg(const char* key, int64_t value) {
  if (on_)
    args_ += (args_.empty() ? "\"" : ", \"") + std::string(key) + "\": " + std::to_string(value);
  return *this;
}

Span& Span::arg(const char* key, const std::string& value) {
  if (on_)
    args_ += (args_.empty() ? "\"" : ", \"") + std::string(key) + "\": " + json_string(value);
  return *this;
}

size_t write(const Comm& world, const std::string& dir, const std::string& merged) {
  if (!enabled()) return 0;
  detail::g_enabled = false;  // the gathering below is not part of the run
  Recorder& r = recorder();
  std::filesystem::create_directories(dir);
  std::string mine = metadata(r.rank, r.label);
  if (!r.events.empty()) mine += ",\n" + joined(r.events);
  write_file(dir + "/rank" + std::to_string(r.rank) + ".json", mine);

  // Rank 0 receives each rank's serialised events in turn (length, then bytes): one rank's trace
  // at a time in memory beside its own, and no shared file system needed.
  uint64_t len = mine.size();
  if (world.rank() != 0) {
    world.send(&len, 1, 0, 0);
    world.send(mine.data(), mine.size(), 0, 1);
    return 0;
  }
  std::string all = mine;
  for (int src = 1; src < world.size(); ++src) {
    world.recv(&len, 1, src, 0);
    std::string theirs(len, '\0');
    world.recv(theirs.data(), theirs.size(), src, 1);
    all += ",\n" + theirs;
  }
  write_file(merged, all);
  size_t events = 0;  // complete events of all ranks, for the caller's log line
  for (size_t at = 0; (at = all.find("\"ph\": \"X\"", at)) != std::string::npos; ++at) ++events;
  return events;
}

std::string json_string(std::string_view s) {
  std::string out = "\"";
  for (char c : s) {
    if (c == '"' || c == '\\') out += '\\';
    if (static_cast<unsigned char>(c) < 0x20) {
      char buf[8];
      std::snprintf(buf, sizeof(buf), "\\u%04x", static_cast<unsigned>(c));
      out += buf;
      continue;
    }
    out += c;
  }
  return out + "\"";
}

}  // namespace t3d::parallel::trace
