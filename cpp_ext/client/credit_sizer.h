// Sizes the client's credit from what its pushes do (BPS_CREDIT_BYTES unset: the default).
//
// The credit must keep the uplink busy and no more. Too little, and pushes wait while the link idles; too much,
// and each step pays for it once: a step's first sums come back only after about credit / link rate, because
// every push in flight shares the uplink. Two things are needed in flight:
//   - a partition toward every server the worker feeds, since each server's downlink is shared by all the
//     workers and a worker's flow to it gets only its share: servers x partition bytes;
//   - what the link carries while the sender waits to be scheduled again: acknowledged push rate x jitter.
// credit = servers x partition + rate x jitter, within [minBytes, maxBytes].
//
// The rate is measured over windows in which parts waited for credit throughout (the link, not the caller, set
// the pace), and the largest of the last `windows` counts; servers and partition are those acknowledged over the
// same span. Until a window was measured the credit stays where it started.
//
// Threading: one thread (the client's IO thread) calls onAck.
#pragma once

#include <algorithm>
#include <cstddef>
#include <cstdint>
#include <deque>
#include <vector>

namespace bps::client {

class CreditSizer {
 public:
  CreditSizer(int64_t minBytes, int64_t maxBytes, double jitterSeconds, double windowSeconds = 0.05,
              size_t windows = 20)
      : minBytes_(minBytes),
        maxBytes_(maxBytes),
        jitter_(jitterSeconds),
        window_(windowSeconds),
        windows_(windows) {}

  // A push of `nbytes` toward `destination` was acknowledged at `now` (seconds, any steady origin);
  // `backlogged`: parts were waiting for credit. Returns the new credit when a measured window closed, else 0.
  int64_t onAck(size_t destination, int64_t nbytes, double now, bool backlogged) {
    if (start_ < 0) {
      start_ = now;
      backlogged_ = backlogged;
    }
    if (destination >= lastSeen_.size()) lastSeen_.resize(destination + 1, -1);
    lastSeen_[destination] = index_;
    bytes_ += nbytes;
    largest_ = std::max(largest_, nbytes);
    backlogged_ = backlogged_ && backlogged;
    if (now - start_ < window_) return 0;
    history_.push_back({backlogged_ ? static_cast<double>(bytes_) / (now - start_) : 0.0, largest_});
    if (history_.size() > windows_) history_.pop_front();
    ++index_;
    start_ = now;
    bytes_ = 0;
    largest_ = 0;
    backlogged_ = backlogged;
    double rate = 0;
    int64_t partition = 0;
    for (const Window& w : history_) {
      rate = std::max(rate, w.rate);
      partition = std::max(partition, w.largest);
    }
    if (rate == 0) return 0;  // nothing measured yet: the link never set the pace
    int64_t servers = std::count_if(lastSeen_.begin(), lastSeen_.end(), [&](int64_t seen) {
      return seen >= 0 && index_ - seen <= static_cast<int64_t>(windows_);
    });
    auto want = servers * partition + static_cast<int64_t>(rate * jitter_);
    return std::clamp(want, minBytes_, maxBytes_);
  }

 private:
  struct Window {
    double rate;  // bytes acknowledged per second; 0: not backlogged throughout
    int64_t largest;  // the largest push acknowledged
  };

  const int64_t minBytes_, maxBytes_;
  const double jitter_, window_;
  const size_t windows_;
  double start_ = -1;  // the open window's start
  int64_t bytes_ = 0, largest_ = 0;
  bool backlogged_ = true;
  int64_t index_ = 0;  // the open window's number
  std::vector<int64_t> lastSeen_;  // per destination: the window of its last acknowledgement, or -1
  std::deque<Window> history_;
};

}  // namespace bps::client
