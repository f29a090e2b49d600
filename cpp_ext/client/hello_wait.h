// What hello() waits for: every server's HELLO answered (or failed), and every stream those answers opened
// ready or failed, so that a job's traffic takes one road from its first request on. Also the servers'
// incarnations as the HELLO replies gave them, for any thread to read.
//
// Threading: begin() and wait() on the caller's thread; the rest on the IO thread; one mutex.
#pragma once

#include <condition_variable>
#include <cstdint>
#include <mutex>
#include <vector>

#include "common/errors.h"

namespace bps::client {

class HelloWait {
 public:
  explicit HelloWait(size_t servers) : errors_(servers), incarnations_(servers, 0) {}

  // Start waiting for every server's HELLO; throws Error(kValue) if hello() is already running.
  void begin() {
    std::lock_guard<std::mutex> lock(mutex_);
    if (pending_ != 0) throw Error(ErrorKind::kValue, "hello() is already running on another thread");
    pending_ = errors_.size();
    errors_.assign(errors_.size(), ErrorInfo{});
  }
  // `count` HELLOs will never be sent (the client closed meanwhile).
  void cancel(size_t count) {
    std::lock_guard<std::mutex> lock(mutex_);
    pending_ -= count;
    done_.notify_all();
  }
  // Wait for every HELLO (and, unless `streamsToo` is false, every stream they opened); returns each one's error.
  std::vector<ErrorInfo> wait(bool streamsToo = true) {
    std::unique_lock<std::mutex> lock(mutex_);
    done_.wait(lock, [&] { return pending_ == 0 && (!streamsToo || streamsOpening_ == 0); });
    return errors_;
  }

  // The IO thread: server's HELLO ended with `error`.
  void ended(size_t server, const ErrorInfo& error) {
    std::lock_guard<std::mutex> lock(mutex_);
    errors_[server] = error;
    --pending_;
    done_.notify_all();
  }
  void setIncarnation(size_t server, uint64_t incarnation) {
    std::lock_guard<std::mutex> lock(mutex_);
    incarnations_[server] = incarnation;
  }
  std::vector<uint64_t> incarnations() {
    std::lock_guard<std::mutex> lock(mutex_);
    return incarnations_;
  }
  // The IO thread: a stream a HELLO reply opened started opening, or settled (ready, failed, closed).
  void streamOpening() {
    std::lock_guard<std::mutex> lock(mutex_);
    ++streamsOpening_;
  }
  void streamSettled() {
    std::lock_guard<std::mutex> lock(mutex_);
    --streamsOpening_;
    done_.notify_all();
  }
  // The IO thread is gone: nobody waits for a stream any more.
  void stopped() {
    std::lock_guard<std::mutex> lock(mutex_);
    streamsOpening_ = 0;
    done_.notify_all();
  }

 private:
  std::mutex mutex_;
  std::condition_variable done_;
  size_t pending_ = 0;
  std::vector<ErrorInfo> errors_;
  std::vector<uint64_t> incarnations_;
  size_t streamsOpening_ = 0;  // streams opened by hello()'s replies and not yet ready or failed
};

}  // namespace bps::client
