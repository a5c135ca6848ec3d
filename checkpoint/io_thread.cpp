#include "checkpoint/io_thread.h"

namespace t3d::checkpoint {

IoThread::IoThread() : thread_([this] { loop(); }) {}

IoThread::~IoThread() {
  {
    std::lock_guard lock(mutex_);
    stopping_ = true;
  }
  cv_.notify_one();
  thread_.join();
}

std::future<void> IoThread::submit(std::function<void()> job) {
  std::packaged_task<void()> task(std::move(job));
  auto future = task.get_future();
  {
    std::lock_guard lock(mutex_);
    queue_.push_back(std::move(task));
  }
  cv_.notify_one();
  return future;
}

void IoThread::loop() {
  for (;;) {
    std::packaged_task<void()> task;
    {
      std::unique_lock lock(mutex_);
      cv_.wait(lock, [&] { return stopping_ || !queue_.empty(); });
      if (queue_.empty()) return;  // stopping, and nothing left to do
      task = std::move(queue_.front());
      queue_.pop_front();
    }
    task();  // exceptions land in the task's future
  }
}

}  // namespace t3d::checkpoint
