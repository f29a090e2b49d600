// See completion_pool.h.
#include "completion_pool.h"

#include <system_error>
#include <utility>
#include <vector>

namespace bps {

void CompletionPool::post(Task task) {
  State& s = *state_;
  std::unique_lock<std::mutex> lock(s.mutex);
  if (s.stopping) {
    lock.unlock();
    task();
    return;
  }
  s.tasks.push_back(std::move(task));
  // Threads that exited when idle are joined here so they never pile up.
  std::deque<std::thread> finished;
  finished.swap(s.finished);
  if (s.idle >= s.tasks.size()) {
    s.ready.notify_one();
  } else if (s.threads.size() < kMaxThreads) {
    try {
      std::thread t(run, state_);
      s.threads.emplace(t.get_id(), std::move(t));
    } catch (const std::system_error&) {
      // Out of threads. The busy ones pick the task up when they return; with none at all, the task
      // runs here rather than never.
      if (s.threads.empty()) {
        Task inline_task = std::move(s.tasks.back());
        s.tasks.pop_back();
        lock.unlock();
        inline_task();
        return;
      }
    }
  }
  lock.unlock();
  for (auto& t : finished) t.join();
}

void CompletionPool::run(std::shared_ptr<State> state) {
  State& s = *state;
  std::unique_lock<std::mutex> lock(s.mutex);
  for (;;) {
    if (s.tasks.empty()) {
      if (s.stopping) return;
      ++s.idle;
      bool woke = s.ready.wait_for(lock, kIdleExit, [&s] { return !s.tasks.empty() || s.stopping; });
      --s.idle;
      if (!woke && s.threads.size() > 1) {
        // Idle for long: leave, unless we are the last thread (kept warm for latency).
        auto self = s.threads.find(std::this_thread::get_id());
        if (self != s.threads.end()) {
          s.finished.push_back(std::move(self->second));
          s.threads.erase(self);
          return;
        }
      }
      continue;
    }
    Task task = std::move(s.tasks.front());
    s.tasks.pop_front();
    lock.unlock();
    task();
    task = nullptr;  // destroy what it captured before taking the lock again
    lock.lock();
  }
}

void CompletionPool::shutdown() {
  State& s = *state_;
  std::unique_lock<std::mutex> lock(s.mutex);
  s.stopping = true;
  s.ready.notify_all();
  std::vector<std::thread> joinable;
  for (auto& entry : s.threads) {
    if (entry.first == std::this_thread::get_id()) {
      entry.second.detach();  // closing from inside a callback: this thread returns by itself
    } else {
      joinable.push_back(std::move(entry.second));
    }
  }
  s.threads.clear();
  for (auto& t : s.finished) joinable.push_back(std::move(t));
  s.finished.clear();
  lock.unlock();
  for (auto& t : joinable) t.join();
  // Whatever is still queued (e.g. only the detached caller was left to run it) runs here.
  lock.lock();
  while (!s.tasks.empty()) {
    Task task = std::move(s.tasks.front());
    s.tasks.pop_front();
    lock.unlock();
    task();
    lock.lock();
  }
}

size_t CompletionPool::threadCount() {
  std::lock_guard<std::mutex> lock(state_->mutex);
  return state_->threads.size();
}

}  // namespace bps
