// Credit-bounded priority order of partitions onto the network: the C++ twin of
// torch_bps/_reference/scheduler.py's CreditScheduler, which stays as the reference
// (tests/client/test_scheduler.py feeds both the same submissions and compares the send order).
//
// Items wait in a priority queue per destination (a server). pop() considers each destination's head that its
// destination's credit admits (its bytes fit within destinationCreditBytes of credit that destination already
// holds, or that destination holds none, or destinationCreditBytes is 0: no per-destination limit), takes the
// best of those (higher priority first, then submission order), and hands it out if it also fits within
// creditBytes of credit already taken in all, or if no credit is taken at all (so an item bigger than a credit
// never starves). release() gives credit back to its destination and to the total.
//
// With destinationCreditBytes 0 every head is admitted and the rule is the single queue's: the best item
// overall goes when the total credit allows. With a per-destination credit, an item whose server already
// holds its share waits while items for other servers go past it: that is the point (bytes in flight toward
// one server stay bounded), at the cost of strict priority order across servers.
//
// Threading: one thread pushes, pops and releases (the client's IO thread); the counters may be read from
// any thread.
#pragma once

#include <atomic>
#include <cstddef>
#include <cstdint>
#include <memory>
#include <optional>
#include <queue>
#include <tuple>
#include <utility>
#include <vector>

namespace bps::client {

template <typename T>
class CreditQueue {
 public:
  explicit CreditQueue(int64_t creditBytes, int64_t destinationCreditBytes = 0)
      : creditBytes_(creditBytes), destinationCreditBytes_(destinationCreditBytes) {}

  void push(size_t destination, int64_t nbytes, int64_t priority, T item) {
    grow(destination);
    destinations_[destination].queue.push(Entry{priority, nextArrival_++, nbytes, std::move(item)});
    queued_.fetch_add(1, std::memory_order_relaxed);
  }

  // The best admitted head, with its credit taken, if it may go now; nothing otherwise.
  // Returns (item, nbytes, destination).
  std::optional<std::tuple<T, int64_t, size_t>> pop() {
    size_t bestIndex = next();
    if (bestIndex == kNone) return std::nullopt;
    Destination* best = &destinations_[bestIndex];
    const Entry& head = best->queue.top();
    int64_t inFlight = inFlight_.load(std::memory_order_relaxed);
    // Moving the item out leaves the fields the heap orders by intact, so pop() below still works.
    std::tuple<T, int64_t, size_t> out{std::move(const_cast<Entry&>(head).item), head.nbytes, bestIndex};
    int64_t nbytes = head.nbytes;
    best->queue.pop();
    queued_.fetch_sub(1, std::memory_order_relaxed);
    inFlight += nbytes;
    inFlight_.store(inFlight, std::memory_order_relaxed);
    if (inFlight > peakInFlight_.load(std::memory_order_relaxed)) {
      peakInFlight_.store(inFlight, std::memory_order_relaxed);
    }
    best->inFlight += nbytes;
    if (best->inFlight > peakDestinationInFlight_.load(std::memory_order_relaxed)) {
      peakDestinationInFlight_.store(best->inFlight, std::memory_order_relaxed);
    }
    return out;
  }

  // pop() would hand out an item now.
  bool ready() const { return next() != kNone; }

  void release(size_t destination, int64_t nbytes) {
    grow(destination);
    destinations_[destination].inFlight -= nbytes;
    inFlight_.fetch_sub(nbytes, std::memory_order_relaxed);
  }

  // Everything still queued, in no particular order (the client fails them when it closes).
  std::vector<T> drain() {
    std::vector<T> out;
    for (Destination& d : destinations_) {
      while (!d.queue.empty()) {
        out.push_back(std::move(const_cast<Entry&>(d.queue.top()).item));
        d.queue.pop();
      }
    }
    queued_.store(0, std::memory_order_relaxed);
    return out;
  }

  int64_t creditBytes() const { return creditBytes_.load(std::memory_order_relaxed); }
  // A new total credit (CreditSizer's); what is in flight beyond it stays, and nothing more goes until it fits.
  void setCreditBytes(int64_t creditBytes) { creditBytes_.store(creditBytes, std::memory_order_relaxed); }
  int64_t destinationCreditBytes() const { return destinationCreditBytes_; }
  int64_t inFlight() const { return inFlight_.load(std::memory_order_relaxed); }
  int64_t peakInFlight() const { return peakInFlight_.load(std::memory_order_relaxed); }
  // The most credit any one destination held at once.
  int64_t peakDestinationInFlight() const { return peakDestinationInFlight_.load(std::memory_order_relaxed); }
  // Credit `destination` holds now (IO thread only).
  int64_t destinationInFlight(size_t destination) const {
    return destination < destinations_.size() ? destinations_[destination].inFlight : 0;
  }
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

  struct Destination {
    std::priority_queue<Entry> queue;
    int64_t inFlight = 0;
  };

  static constexpr size_t kNone = ~size_t{0};

  // The destination whose head pop() hands out now, or kNone.
  size_t next() const {
    size_t best = kNone;
    for (size_t i = 0; i < destinations_.size(); ++i) {
      const Destination& d = destinations_[i];
      if (d.queue.empty()) continue;
      const Entry& head = d.queue.top();
      if (destinationCreditBytes_ > 0 && d.inFlight != 0 && d.inFlight + head.nbytes > destinationCreditBytes_) {
        continue;
      }
      if (best == kNone || destinations_[best].queue.top() < head) best = i;
    }
    if (best == kNone) return kNone;
    int64_t inFlight = inFlight_.load(std::memory_order_relaxed);
    int64_t nbytes = destinations_[best].queue.top().nbytes;
    return inFlight != 0 && inFlight + nbytes > creditBytes_.load(std::memory_order_relaxed) ? kNone : best;
  }

  void grow(size_t destination) {
    if (destination >= destinations_.size()) destinations_.resize(destination + 1);
  }

  std::atomic<int64_t> creditBytes_;
  int64_t destinationCreditBytes_;
  std::vector<Destination> destinations_;
  uint64_t nextArrival_ = 0;
  std::atomic<int64_t> inFlight_{0};
  std::atomic<int64_t> peakInFlight_{0};
  std::atomic<int64_t> peakDestinationInFlight_{0};
  std::atomic<size_t> queued_{0};
};

}  // namespace bps::client
