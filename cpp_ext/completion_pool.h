// Runs completion handlers (which complete torch futures, and so run their `then` callbacks) on threads
// that are never the IO thread.
//
// A callback may block for as long as it likes, even on another push_pull of this client (PowerSGD's
// hooks do): whenever work is posted and no pool thread is idle, the pool starts another thread, up to
// kMaxThreads. Threads idle for kIdleExit beyond the first exit again. Only if kMaxThreads callbacks block
// at once do further completions wait for one of them to return.
#pragma once

#include <chrono>
#include <condition_variable>
#include <deque>
#include <functional>
#include <memory>
#include <mutex>
#include <thread>
#include <unordered_map>

namespace bps {

class CompletionPool {
 public:
  using Task = std::function<void()>;

  static constexpr size_t kMaxThreads = 64;
  static constexpr std::chrono::seconds kIdleExit{10};

  CompletionPool() = default;
  ~CompletionPool() { shutdown(); }
  CompletionPool(const CompletionPool&) = delete;
  CompletionPool& operator=(const CompletionPool&) = delete;

  // Queue `task`; it runs on a pool thread. Never blocks on a running task.
  void post(Task task);

  // Run every queued task, then stop and join the threads (the calling pool thread, if any, is left to
  // return on its own). Tasks posted afterwards run inline on the caller.
  void shutdown();

  size_t threadCount();

 private:
  // Shared with the threads, so a thread detached by shutdown() from inside a task (closing the client
  // from a callback) never touches a destroyed pool.
  struct State {
    std::mutex mutex;
    std::condition_variable ready;
    std::deque<Task> tasks;
    std::unordered_map<std::thread::id, std::thread> threads;
    std::deque<std::thread> finished;  // threads that exited when idle, joined lazily
    size_t idle = 0;
    bool stopping = false;
  };

  static void run(std::shared_ptr<State> state);

  std::shared_ptr<State> state_ = std::make_shared<State>();
};

}  // namespace bps
