// The one thread of a process that may call HDF5.
//
// Debian's HDF5 is built without thread safety: two threads inside the library at once corrupt
// its global state. So every HDF5 call of a titan3d process (writing shards and the index,
// reading a snapshot at start-up) runs as a job on this thread, in submission order. Synchronous
// snapshots are the same jobs, waited for at once.
#pragma once

#include <condition_variable>
#include <deque>
#include <functional>
#include <future>
#include <mutex>
#include <thread>

namespace t3d::checkpoint {

class IoThread {
 public:
  IoThread();
  ~IoThread();  // finishes queued jobs, then joins
  IoThread(const IoThread&) = delete;
  IoThread& operator=(const IoThread&) = delete;

  // Queues `job`; the future carries its exception, if any.
  std::future<void> submit(std::function<void()> job);
  // Runs `job` on the I/O thread and waits; rethrows its exception here.
  void run(std::function<void()> job) { submit(std::move(job)).get(); }

 private:
  void loop();
  std::mutex mutex_;
  std::condition_variable cv_;
  std::deque<std::packaged_task<void()>> queue_;
  bool stopping_ = false;
  std::thread thread_;
};

}  // namespace t3d::checkpoint
