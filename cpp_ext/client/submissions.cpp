// See submissions.h.
#include "client/submissions.h"

#include <sys/eventfd.h>
#include <unistd.h>

#include <cerrno>
#include <cstring>

namespace bps::client {

Submissions::Submissions() : wakeFd_(eventfd(0, EFD_NONBLOCK | EFD_CLOEXEC)) {
  if (wakeFd_ < 0) {
    throw Error(ErrorKind::kTransport, std::string("cannot create the client's context: ") + std::strerror(errno));
  }
}

Submissions::~Submissions() { ::close(wakeFd_); }

void Submissions::wake() {
  uint64_t one = 1;
  ssize_t written = ::write(wakeFd_, &one, sizeof(one));
  (void)written;  // EAGAIN means the counter is already non-zero: the IO thread wakes anyway
}

void Submissions::clearWake() {
  uint64_t wakes;
  ssize_t got = ::read(wakeFd_, &wakes, sizeof(wakes));
  (void)got;
}

void Submissions::submit(std::vector<OpPtr> ops) {
  bool wasEmpty;
  {
    std::lock_guard<std::mutex> lock(mutex_);
    if (closing_) throw Error(ErrorKind::kClosed, "the torch_bps client is closed");
    if (!failure_.empty()) throw Error(ErrorKind::kTransport, "the torch_bps client failed: " + failure_);
    wasEmpty = submitted_.empty();
    for (auto& op : ops) submitted_.push_back(std::move(op));
  }
  // The IO thread takes the whole queue per wake-up: only the first submission needs to wake it.
  if (wasEmpty) wake();
}

void Submissions::abandon(size_t server, const std::string& why) {
  uint64_t ticket;
  {
    std::lock_guard<std::mutex> lock(mutex_);
    if (closing_ || !failure_.empty()) return;  // nothing outstanding will ever be answered anyway
    abandons_.emplace_back(server, why);
    ticket = ++abandonsAsked_;
  }
  wake();
  std::unique_lock<std::mutex> lock(mutex_);
  abandonDone_.wait(lock, [&] { return abandonsDone_ >= ticket; });
}

bool Submissions::close() {
  std::lock_guard<std::mutex> lock(mutex_);
  if (closing_) return false;  // closed already, or closing on another thread (maybe from a callback)
  closing_ = true;
  return true;
}

bool Submissions::closing() {
  std::lock_guard<std::mutex> lock(mutex_);
  return closing_;
}

void Submissions::take(std::vector<OpPtr>& ops, std::vector<std::pair<size_t, std::string>>& abandons) {
  std::lock_guard<std::mutex> lock(mutex_);
  ops.swap(submitted_);
  abandons.swap(abandons_);
}

void Submissions::abandonsDone(size_t count) {
  std::lock_guard<std::mutex> lock(mutex_);
  abandonsDone_ += count;
  abandonDone_.notify_all();
}

void Submissions::fail(const std::string& failure) {
  std::lock_guard<std::mutex> lock(mutex_);
  failure_ = failure;
}

void Submissions::stopped() {
  std::lock_guard<std::mutex> lock(mutex_);
  abandonsDone_ = abandonsAsked_;  // nobody waits for an abandon() after the IO thread is gone
  abandonDone_.notify_all();
}

std::string Submissions::failure() {
  std::lock_guard<std::mutex> lock(mutex_);
  return failure_;
}

}  // namespace bps::client
