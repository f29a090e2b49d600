// Runs completion handlers (which complete torch futures, and so run their `then` callbacks) on threads
// that are never the IO thread.
//
// A callback may block for as long as it likes, even on another push_pull of this client (PowerSGD's
// hooks do): when work waits, no pool thread is idle and no queued task was started for kGrowAfter, a
// watchdog starts another thread, up to kMaxThreads. Not sooner: the tasks are short and all need the
// GIL, so a thread for every completion that finds none idle only adds thread switches (and dozens of threads
// that cost CPU for nothing). Threads idle for kIdleExit beyond
// the first exit again. Only if kMaxThreads callbacks block at once do further completions wait for one
// of them to return.
#pragma once

#include <chrono>
#include <condition_variable>
#include <cstdint>
#include <deque>
#include <functional>
#include <memory>
#include <mutex>
#include <thread>
#include <unordered_map>

namespace bps::client {

class CompletionPool {
 public:
  using Task = std::function<void()>;

  static constexpr size_t kMaxThreads = 64;
  static constexpr std::chrono::seconds kIdleExit{10};
  static constexpr std::chrono::milliseconds kGrowAfter{2};

  CompletionPool() = default;
  ~CompletionPool() { shutdown(); }
  CompletionPool(const CompletionPool&) = delete;
  CompletionPool& operator=(const CompletionPool&) = delete;

  // Queue `task`; it runs on a pool thread. Never blocks on a running task.
  void post(Task task);

  // Run every queued task, then stop and join the threads (the calling pool thread, if any, is left to
  // return on its own). Tasks posted afterwards run inline on the caller.
  void shutdown();

  // The most threads the pool ran at once (threads idle for kIdleExit leave, so the count now says less).
  size_t peakThreadCount();

 private:
  // Shared with the threads, so a thread detached by shutdown() from inside a task (closing the client
  // from a callback) never touches a destroyed pool.
  struct State {
    std::mutex mutex;
    std::condition_variable ready;
    std::condition_variable stalled;  // wakes the watchdog: tasks wait and no thread is idle
    std::deque<Task> tasks;
    std::unordered_map<std::thread::id, std::thread> threads;
    std::deque<std::thread> finished;  // threads that exited when idle, joined lazily
    std::thread watchdog;
    size_t idle = 0;
    size_t peak = 0;  // most threads at once
    uint64_t started = 0;  // tasks taken off the queue so far: the watchdog's measure of progress
    bool counting = false;  // the watchdog is waiting kGrowAfter to see whether any task starts
    bool stopping = false;
  };

  static void run(std::shared_ptr<State> state);
  static void watch(std::shared_ptr<State> state);
  // Start a pool thread (the caller holds the mutex); false if the system has no thread to give.
  static bool grow(const std::shared_ptr<State>& state);

  std::shared_ptr<State> state_ = std::make_shared<State>();
};

}  // namespace bps::client
