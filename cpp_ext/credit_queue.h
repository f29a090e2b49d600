// Credit-bounded priority order of partitions onto the network: the C++ twin of
// torch_bps/engine/scheduler.py's CreditScheduler, which stays as the reference (tests/test_scheduler.py feeds
// both the same submissions and compares the send order).
//
// Items wait in a priority queue (higher priority first, then submission order). pop() hands out the head
// and takes its credit if it fits within creditBytes of credit already taken, or if no credit is taken at all
// (so an item bigger than the credit never starves). release() gives credit back.
//
// Threading: one thread pushes, pops and releases (the client's IO thread); the counters may be read from
// any thread.
#pragma once

#include <algorithm>
#include <atomic>
#include <cstdint>
#include <optional>
#include <queue>
#include <utility>
#include <vector>

namespace bps {

template <typename T>
class CreditQueue {
 public:
  explicit CreditQueue(int64_t creditBytes) : creditBytes_(creditBytes) {}

  void push(int64_t nbytes, int64_t priority, T item) {
    queue_.push(Entry{priority, nextArrival_++, nbytes, std::move(item)});
    queued_.store(queue_.size(), std::memory_order_relaxed);
  }

  // The head, with its credit taken, if it may go now; nothing otherwise.
  std::optional<std::pair<T, int64_t>> pop() {
    if (queue_.empty()) return std::nullopt;
    const Entry& head = queue_.top();
    int64_t inFlight = inFlight_.load(std::memory_order_relaxed);
    if (inFlight != 0 && inFlight + head.nbytes > creditBytes_) return std::nullopt;
    // Moving the item out leaves the fields the heap orders by intact, so pop() below still works.
    std::pair<T, int64_t> out{std::move(const_cast<Entry&>(head).item), head.nbytes};
    queue_.pop();
    queued_.store(queue_.size(), std::memory_order_relaxed);
    inFlight += out.second;
    inFlight_.store(inFlight, std::memory_order_relaxed);
    if (inFlight > peakInFlight_.load(std::memory_order_relaxed)) {
      peakInFlight_.store(inFlight, std::memory_order_relaxed);
    }
    return out;
  }

  void release(int64_t nbytes) { inFlight_.fetch_sub(nbytes, std::memory_order_relaxed); }

  // Everything still queued, in no particular order (the client fails them when it closes).
  std::vector<T> drain() {
    std::vector<T> out;
    while (!queue_.empty()) {
      out.push_back(std::move(const_cast<Entry&>(queue_.top()).item));
      queue_.pop();
    }
    queued_.store(0, std::memory_order_relaxed);
    return out;
  }

  int64_t creditBytes() const { return creditBytes_; }
  int64_t inFlight() const { return inFlight_.load(std::memory_order_relaxed); }
  int64_t peakInFlight() const { return peakInFlight_.load(std::memory_order_relaxed); }
  size_t queued() const { return queued_.load(std::memory_order_relaxed); }

 private:
  struct Entry {
    int64_t priority;
    uint64_t arrival;
    int64_t nbytes;
    T item;
    // std::priority_queue puts the greatest on top: higher priority, then the earlier arrival.
    bool operator<(const Entry& other) const {
      return priority != other.priority ? priority < other.priority : arrival > other.arrival;
    }
  };

  int64_t creditBytes_;
  std::priority_queue<Entry> queue_;
  uint64_t nextArrival_ = 0;
  std::atomic<int64_t> inFlight_{0};
  std::atomic<int64_t> peakInFlight_{0};
  std::atomic<size_t> queued_{0};
};

}  // namespace bps
