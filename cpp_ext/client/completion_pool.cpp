// See completion_pool.h.
#include "client/completion_pool.h"

#include <pthread.h>

#include <algorithm>
#include <system_error>
#include <utility>
#include <vector>

namespace bps::client {

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
  } else if (s.threads.empty()) {
    if (!grow(state_)) {
      // No thread at all and none to be had: run the task here rather than never.
      Task inline_task = std::move(s.tasks.back());
      s.tasks.pop_back();
      lock.unlock();
      for (auto& t : finished) t.join();
      inline_task();
      return;
    }
  } else {
    if (!s.watchdog.joinable()) {
      try {
        s.watchdog = std::thread(watch, state_);
      } catch (const std::system_error&) {
        // Without a watchdog the pool does not grow; the busy threads take the task when they return.
      }
    }
    // The busy threads may take it; if they do not, the watchdog adds one. Not woken while it counts
    // down already: that would cost a thread switch per completion in a busy stretch.
    if (!s.counting) s.stalled.notify_one();
  }
  lock.unlock();
  for (auto& t : finished) t.join();
}

bool CompletionPool::grow(const std::shared_ptr<State>& state) {
  try {
    std::thread t(run, state);
    state->threads.emplace(t.get_id(), std::move(t));
    state->peak = std::max(state->peak, state->threads.size());
    return true;
  } catch (const std::system_error&) {
    return false;
  }
}

void CompletionPool::run(std::shared_ptr<State> state) {
  pthread_setname_np(pthread_self(), "bps-completion");
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
    ++s.started;
    lock.unlock();
    task();
    task = nullptr;  // destroy what it captured before taking the lock again
    lock.lock();
  }
}

void CompletionPool::watch(std::shared_ptr<State> state) {
  State& s = *state;
  auto waiting = [&s] { return !s.tasks.empty() && s.idle == 0; };
  std::unique_lock<std::mutex> lock(s.mutex);
  while (!s.stopping) {
    s.stalled.wait(lock, [&] { return waiting() || s.stopping; });
    uint64_t seen = s.started;
    s.counting = true;
    s.stalled.wait_for(lock, kGrowAfter, [&s] { return s.stopping; });
    s.counting = false;
    // Still waiting and nothing started for kGrowAfter: every thread is stuck in a callback.
    if (!s.stopping && waiting() && s.started == seen && s.threads.size() < kMaxThreads) grow(state);
  }
}

void CompletionPool::shutdown() {
  State& s = *state_;
  std::unique_lock<std::mutex> lock(s.mutex);
  s.stopping = true;
  s.ready.notify_all();
  s.stalled.notify_all();
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
  if (s.watchdog.joinable()) joinable.push_back(std::move(s.watchdog));
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

size_t CompletionPool::peakThreadCount() {
  std::lock_guard<std::mutex> lock(state_->mutex);
  return state_->peak;
}

}  // namespace bps::client
