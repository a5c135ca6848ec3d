// O_DIRECT writes on a thread of their own, for the HDF5 driver shards are written through
// (h5_direct_driver.h): aligned buffers, written in order while the caller fills the next. Makes
// no HDF5 call.
#pragma once

#include <condition_variable>
#include <cstddef>
#include <cstdint>
#include <mutex>
#include <thread>

namespace t3d::checkpoint {

// O_DIRECT transfers: file offsets, memory addresses and lengths in multiples of this (the
// largest logical block size in use, so it holds on every device).
constexpr uint64_t kAlign = 4096;
// Raw data is gathered into O_DIRECT writes of up to this size.
constexpr size_t kBounce = 8 << 20;

// pwrite of all `size` bytes at `at`, retried over short writes and EINTR; false (errno set) on
// failure.
bool write_all(int fd, const void* data, size_t size, uint64_t at);

// O_DIRECT writes on a thread of their own, in the order submitted, so that the device streams
// while the caller hashes and copies the next bytes. Of kDepth buffers one is being filled and the
// others wait for or are in the device: the device keeps streaming through the caller's stalls
// (descheduled while training's threads have the cores) of up to kDepth - 1 writes.
class DirectWriter {
 public:
  static constexpr int kDepth = 4;
  explicit DirectWriter(int fd) : fd_(fd) {}
  ~DirectWriter();  // lets the writes queued finish
  DirectWriter(const DirectWriter&) = delete;
  DirectWriter& operator=(const DirectWriter&) = delete;
  // The buffer to fill, of kBounce bytes, aligned, once no write reads it any more; null (errno
  // ENOMEM) when it cannot be had.
  char* buffer();
  // Queues the first `size` bytes of buffer() for writing at `at`; the next buffer becomes
  // buffer(). False (errno set) when an earlier write failed.
  bool submit(size_t size, uint64_t at);
  // Waits for every queued write; false (errno set) when a write failed.
  bool wait();

 private:
  struct Job {
    const char* data = nullptr;
    size_t size = 0;
    uint64_t at = 0;
  };
  void run();
  int fd_;
  char* buffers_[kDepth] = {};
  Job jobs_[kDepth];
  uint64_t submitted_ = 0;  // writes queued so far; buffer() is buffers_[submitted_ % kDepth]
  uint64_t written_ = 0;    // of which done (the thread takes them in order)
  std::thread thread_;
  std::mutex mutex_;
  std::condition_variable ready_, done_;
  bool stop_ = false;
  int error_ = 0;
};

}  // namespace t3d::checkpoint
