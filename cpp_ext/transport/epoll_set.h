// The epoll set the client's IO thread and the server's loop each wait on: level-triggered, as poll(2) is, and a
// wake-up costs the same whatever the number of sockets (poll walked them all on every one).
//
// Tags (epoll_event.data.u64) say what an event is about: a kind in the top byte, an index below it (eventTag).
// Sockets that come and go (streams) are kept in the set by StreamConn::watch, which takes fd() and removes its
// socket before closing it.
#pragma once

#include <sys/epoll.h>
#include <unistd.h>

#include <cerrno>
#include <cstdint>
#include <cstring>
#include <string>
#include <vector>

#include "common/errors.h"

namespace bps::transport {

constexpr int kEventKindShift = 56;
inline uint64_t eventTag(uint64_t kind, uint64_t index) { return (kind << kEventKindShift) | index; }
inline uint64_t eventKind(uint64_t tag) { return tag >> kEventKindShift; }
inline uint64_t eventIndex(uint64_t tag) { return tag & ((uint64_t{1} << kEventKindShift) - 1); }

class EpollSet {
 public:
  // Reports at most maxEvents per wait (the rest at the next: level-triggered). Throws Error(kTransport).
  explicit EpollSet(size_t maxEvents) : fd_(epoll_create1(EPOLL_CLOEXEC)), events_(maxEvents) {
    if (fd_ < 0) throw Error(ErrorKind::kTransport, std::string("epoll_create1 failed: ") + std::strerror(errno));
  }
  ~EpollSet() { ::close(fd_); }
  EpollSet(const EpollSet&) = delete;
  EpollSet& operator=(const EpollSet&) = delete;

  int fd() const { return fd_; }

  // Watch `fd` for reading under `tag`; throws Error(kTransport) naming `what`.
  void add(int fd, uint64_t tag, const char* what) {
    epoll_event event{};
    event.events = EPOLLIN;
    event.data.u64 = tag;
    if (epoll_ctl(fd_, EPOLL_CTL_ADD, fd, &event) != 0) {
      throw Error(ErrorKind::kTransport, std::string("epoll_ctl on ") + what + " failed: " + std::strerror(errno));
    }
  }

  // Wait up to timeoutMs (0: look only): how many events events() holds, -1 if a signal interrupted the wait.
  // Throws Error(kTransport) on any other failure.
  int wait(int timeoutMs) {
    int count = epoll_wait(fd_, events_.data(), static_cast<int>(events_.size()), timeoutMs);
    if (count < 0 && errno != EINTR) {
      throw Error(ErrorKind::kTransport, std::string("epoll_wait failed: ") + std::strerror(errno));
    }
    return count;
  }
  const epoll_event* events() const { return events_.data(); }

 private:
  int fd_;
  std::vector<epoll_event> events_;
};

}  // namespace bps::transport
