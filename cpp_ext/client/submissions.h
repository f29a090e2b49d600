// The hand-over between the callers' threads and the client's IO thread: operations submitted, abandon()
// requests, and whether the client is closing or its IO thread stopped. Callers wake the IO thread through an
// eventfd; it takes everything queued at once.
//
// Threading: every method takes the one mutex; take(), abandonsDone(), fail(), stopped() and clearWake() are
// the IO thread's, the rest the callers'.
#pragma once

#include <condition_variable>
#include <cstdint>
#include <mutex>
#include <string>
#include <utility>
#include <vector>

#include "client/op.h"

namespace bps::client {

class Submissions {
 public:
  // Throws Error(kTransport) if the eventfd cannot be made.
  Submissions();
  ~Submissions();
  Submissions(const Submissions&) = delete;
  Submissions& operator=(const Submissions&) = delete;

  int wakeFd() const { return wakeFd_; }
  void wake();
  // The IO thread, woken: reset the eventfd.
  void clearWake();

  // Queue operations for the IO thread. Throws Error(kClosed) once closing, Error(kTransport) once the IO
  // thread stopped on an error.
  void submit(std::vector<OpPtr> ops);
  // Ask the IO thread to abandon `server` and wait until it did (or stopped). Nothing if closing or stopped.
  void abandon(size_t server, const std::string& why);
  // Start closing: false if already closing (or closed).
  bool close();
  bool closing();

  // The IO thread: take what was submitted and asked for since the last call.
  void take(std::vector<OpPtr>& ops, std::vector<std::pair<size_t, std::string>>& abandons);
  // The IO thread: that many abandon() requests are done.
  void abandonsDone(size_t count);
  // The IO thread stops on an error: nothing more is accepted.
  void fail(const std::string& failure);
  std::string failure();  // why the IO thread stopped on an error, or ""
  // The IO thread is gone: nobody waits for an abandon() any more.
  void stopped();

 private:
  int wakeFd_ = -1;
  std::mutex mutex_;
  std::condition_variable abandonDone_;
  std::vector<OpPtr> submitted_;
  std::vector<std::pair<size_t, std::string>> abandons_;
  uint64_t abandonsAsked_ = 0, abandonsDone_ = 0;
  bool closing_ = false;
  std::string failure_;  // set if the IO thread stopped on an error: nothing is accepted any more
};

}  // namespace bps::client
