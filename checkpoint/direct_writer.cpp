// O_DIRECT writes on a thread of their own (direct_writer.h).
#include "checkpoint/direct_writer.h"

#include <unistd.h>

#include <algorithm>
#include <cerrno>
#include <cstdlib>

namespace t3d::checkpoint {

namespace {
// Largest single O_DIRECT write (the kernel caps a write at just under 2 GiB).
constexpr size_t kMaxWrite = 256 << 20;
}  // namespace

bool write_all(int fd, const void* data, size_t size, uint64_t at) {
  const auto* p = static_cast<const char*>(data);
  while (size > 0) {
    const ssize_t n = ::pwrite(fd, p, std::min(size, kMaxWrite), static_cast<off_t>(at));
    if (n < 0 && errno == EINTR) continue;
    if (n <= 0) {
      if (n == 0) errno = EIO;
      return false;
    }
    p += n, at += static_cast<uint64_t>(n), size -= static_cast<size_t>(n);
  }
  return true;
}

DirectWriter::~DirectWriter() {
  if (thread_.joinable()) {
    {
      std::lock_guard<std::mutex> lock(mutex_);
      stop_ = true;
    }
    ready_.notify_all();
    thread_.join();
  }
  for (char* b : buffers_) std::free(b);
}

char* DirectWriter::buffer() {
  char*& b = buffers_[submitted_ % kDepth];
  if (!b) {
    void* p = nullptr;
    if (::posix_memalign(&p, kAlign, kBounce) != 0) return errno = ENOMEM, nullptr;
    b = static_cast<char*>(p);
  }
  std::unique_lock<std::mutex> lock(mutex_);
  done_.wait(lock, [this] { return submitted_ - written_ < kDepth; });
  return b;
}

bool DirectWriter::submit(size_t size, uint64_t at) {
  if (!thread_.joinable()) thread_ = std::thread([this] { run(); });
  {
    std::lock_guard<std::mutex> lock(mutex_);
    if (error_) return errno = error_, false;
    jobs_[submitted_ % kDepth] = {buffers_[submitted_ % kDepth], size, at};
    ++submitted_;
  }
  ready_.notify_all();
  return true;
}

bool DirectWriter::wait() {
  std::unique_lock<std::mutex> lock(mutex_);
  done_.wait(lock, [this] { return written_ == submitted_; });
  if (error_) errno = error_;
  return error_ == 0;
}

void DirectWriter::run() {
  std::unique_lock<std::mutex> lock(mutex_);
  for (;;) {
    ready_.wait(lock, [this] { return written_ < submitted_ || stop_; });
    if (written_ == submitted_) return;
    const Job job = jobs_[written_ % kDepth];
    const bool failed_before = error_ != 0;  // the file is abandoned: the rest is not written
    lock.unlock();
    const int err = failed_before || write_all(fd_, job.data, job.size, job.at) ? 0 : errno;
    lock.lock();
    if (err && !error_) error_ = err;
    ++written_;
    done_.notify_all();
  }
}

}  // namespace t3d::checkpoint
