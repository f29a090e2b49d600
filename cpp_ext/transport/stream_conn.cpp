// See stream_conn.h.
#include "transport/stream_conn.h"

#include <arpa/inet.h>
#include <fcntl.h>
#include <netdb.h>
#include <netinet/in.h>
#include <netinet/tcp.h>
#include <sys/epoll.h>
#include <sys/socket.h>
#include <sys/uio.h>
#include <sys/un.h>
#include <unistd.h>

#include <algorithm>
#include <cerrno>
#include <cinttypes>
#include <cstddef>
#include <cstring>
#include <new>

#include "common/errors.h"

namespace bps::transport {

namespace {

constexpr size_t kStaging = 64 << 10;
// A frame's bytes still missing beyond this are read straight into it (no staging copy).
constexpr size_t kDirectRead = 16 << 10;
// Frames up to this size are copied into one piece with their length word: one iovec, one allocation.
constexpr size_t kInlineFrame = 256;
constexpr int kMaxIov = 64;
constexpr size_t kMaxLowWater = 1 << 20;

void setNonBlocking(int fd) {
  int flags = fcntl(fd, F_GETFL, 0);
  if (flags >= 0) fcntl(fd, F_SETFL, flags | O_NONBLOCK);
}

void setNoDelay(int fd) {
  int one = 1;
  setsockopt(fd, IPPROTO_TCP, TCP_NODELAY, &one, sizeof(one));  // fails harmlessly on a non-TCP fd
}

Message sized(size_t n) {
  Message m;
  if (zmq_msg_init_size(m.get(), n) != 0) throw std::bad_alloc();
  return m;
}

// Resolve host:port to addresses (numeric or by name).
addrinfo* resolve(const std::string& host, uint16_t port, bool passive, std::string* why) {
  addrinfo hints{};
  hints.ai_family = AF_UNSPEC;
  hints.ai_socktype = SOCK_STREAM;
  hints.ai_flags = passive ? AI_PASSIVE : 0;
  addrinfo* found = nullptr;
  std::string service = std::to_string(port);
  std::string name = host;
  if (name.size() > 2 && name.front() == '[' && name.back() == ']') name = name.substr(1, name.size() - 2);
  int rc = getaddrinfo(name.empty() || name == "*" ? nullptr : name.c_str(), service.c_str(), &hints, &found);
  if (rc != 0) {
    *why = formatText("cannot resolve %s: %s", host.c_str(), gai_strerror(rc));
    return nullptr;
  }
  return found;
}

}  // namespace

StreamConn::StreamConn(int fd, uint64_t maxFrameBytes)
    : fd_(fd), maxFrameBytes_(maxFrameBytes), maxLowWater_(kMaxLowWater), in_(kStaging) {
  setNonBlocking(fd_);
  sockaddr_storage addr{};
  socklen_t len = sizeof(addr);
  tcp_ = getsockname(fd_, reinterpret_cast<sockaddr*>(&addr), &len) != 0 || addr.ss_family != AF_UNIX;
  if (tcp_) setNoDelay(fd_);
}

StreamConn::~StreamConn() { close("closed"); }

void StreamConn::close(const std::string& why) {
  if (why_.empty()) why_ = why;
  if (receivedFd_ >= 0) ::close(receivedFd_);
  receivedFd_ = -1;
  rings_.reset();
  shareWrites_ = passFd_ = false;
  if (fd_ >= 0 && epollFd_ >= 0) epoll_ctl(epollFd_, EPOLL_CTL_DEL, fd_, nullptr);
  epollFd_ = -1;
  if (fd_ >= 0) ::close(fd_);
  fd_ = -1;
  out_.clear();  // releases the queued payloads
  queuedBytes_ = 0;
}

bool StreamConn::watch(int epollFd, uint32_t events, uint64_t tag) {
  if (closed()) return true;
  if (epollFd == epollFd_ && events == watchedEvents_ && tag == watchedTag_) return true;
  epoll_event event{};
  event.events = events;
  event.data.u64 = tag;
  if (epoll_ctl(epollFd, epollFd == epollFd_ ? EPOLL_CTL_MOD : EPOLL_CTL_ADD, fd_, &event) != 0) return false;
  epollFd_ = epollFd;
  watchedEvents_ = events;
  watchedTag_ = tag;
  return true;
}

bool StreamConn::fail(const std::string& why) {
  close(why);
  return false;
}

bool StreamConn::fill() {
  if (inBegin_ == inEnd_) inBegin_ = inEnd_ = 0;
  if (inEnd_ == in_.size()) {  // compact: what is left is shorter than a length word or a small frame
    std::memmove(in_.data(), in_.data() + inBegin_, inEnd_ - inBegin_);
    inEnd_ -= inBegin_;
    inBegin_ = 0;
  }
  size_t got = receive(in_.data() + inEnd_, in_.size() - inEnd_);
  inEnd_ += got;
  return got > 0;
}

size_t StreamConn::receive(void* into, size_t n) {
  if (drained_) {  // the last recv came back short: the socket had no more (poll says when it has)
    wouldBlock_ = true;
    return 0;
  }
  for (;;) {
    ssize_t got = acceptFd_ ? receiveWithFd(into, n) : ::recv(fd_, into, n, 0);
    if (got > 0) {
      bytesRead_ += static_cast<uint64_t>(got);
      drained_ = static_cast<size_t>(got) < n;
      return static_cast<size_t>(got);
    }
    if (got == 0) {
      fail("the peer closed the connection");
    } else if (errno == EINTR) {
      continue;
    } else if (errno == EAGAIN || errno == EWOULDBLOCK) {
      wouldBlock_ = true;
    } else {
      fail(std::string("receive failed: ") + std::strerror(errno));
    }
    return 0;
  }
}

ssize_t StreamConn::receiveWithFd(void* into, size_t n) {
  // A descriptor passed with SCM_RIGHTS arrives with the first byte sent beside it: only the first read looks.
  // Any other descriptor a peer sends is closed by the kernel when a plain recv() takes its bytes.
  iovec iov{into, n};
  alignas(cmsghdr) char control[CMSG_SPACE(sizeof(int))];
  msghdr m{};
  m.msg_iov = &iov;
  m.msg_iovlen = 1;
  m.msg_control = control;
  m.msg_controllen = sizeof(control);
  ssize_t got = ::recvmsg(fd_, &m, MSG_CMSG_CLOEXEC);
  if (got <= 0) return got;
  acceptFd_ = false;
  for (cmsghdr* c = CMSG_FIRSTHDR(&m); c; c = CMSG_NXTHDR(&m, c)) {
    if (c->cmsg_level != SOL_SOCKET || c->cmsg_type != SCM_RIGHTS) continue;
    size_t count = (c->cmsg_len - CMSG_LEN(0)) / sizeof(int);
    for (size_t i = 0; i < count; ++i) {
      int fd;
      std::memcpy(&fd, CMSG_DATA(c) + i * sizeof(int), sizeof(fd));
      if (receivedFd_ < 0) {
        receivedFd_ = fd;
      } else {
        ::close(fd);
      }
    }
  }
  return got;
}

int StreamConn::takeReceivedFd() {
  int fd = receivedFd_;
  receivedFd_ = -1;
  return fd;
}

void StreamConn::share(std::unique_ptr<SharedRings> rings, bool passFd) {
  rings_ = std::move(rings);
  passFd_ = passFd && rings_;
}

bool StreamConn::takeFrameBytes() {
  // Copy what the staging buffer holds of the frame, then read a big remainder straight into the frame.
  size_t need = frame_.size() - frameFilled_;
  size_t take = std::min(need, inEnd_ - inBegin_);
  if (take) {
    std::memcpy(frame_.data() + frameFilled_, in_.data() + inBegin_, take);
    inBegin_ += take;
    frameFilled_ += take;
    need -= take;
  }
  while (need >= kDirectRead) {
    size_t got = receive(frame_.data() + frameFilled_, need);
    if (got == 0) return !closed();  // nothing there yet (wouldBlock_), or closed
    frameFilled_ += got;
    need -= got;
  }
  return true;
}

void StreamConn::lockedReceiveBuffer() {
  // A low-water mark near what the window lets in keeps the receive queue full, and on a locked buffer the
  // kernel counts each packet's whole allocation (more than its payload) against SO_RCVBUF: past it,
  // it collapses the queue (CPU), prunes it and drops packets, and a lost retransmission waits 200 ms for a timer.
  // A quarter of the buffer never gets there.
  int kernel = 0;
  socklen_t len = sizeof(kernel);
  if (getsockopt(fd_, SOL_SOCKET, SO_RCVBUF, &kernel, &len) == 0 && kernel > 0) {
    maxLowWater_ = std::max<size_t>(1, std::min<size_t>(kMaxLowWater, static_cast<size_t>(kernel) / 4));
  }
}

void StreamConn::setLowWater(size_t bytes) {
  // The kernel caps it at half the receive buffer (and poll still reports end of stream and errors at once).
  if (!tcp_) return;
  int want = static_cast<int>(std::min<size_t>(std::max<size_t>(bytes, 1), maxLowWater_));
  if (want == lowWater_) return;
  if (setsockopt(fd_, SOL_SOCKET, SO_RCVLOWAT, &want, sizeof(want)) == 0) lowWater_ = want;
}

bool StreamConn::read(std::vector<std::vector<Message>>& out, size_t maxMessages) {
  if (closed()) return false;
  wouldBlock_ = drained_ = false;
  bool open = readMessages(out, maxMessages);
  // Readable for poll once what comes next is there: a frame's rest (one wake-up per big frame, not one per
  // segment), else any byte. Set here only, when it changes: a system call per wake-up at most (a non-blocking
  // recv returns what there is, whatever the mark).
  if (open) setLowWater(haveLength_ ? frame_.size() - frameFilled_ : 1);
  return open;
}

bool StreamConn::readMessages(std::vector<std::vector<Message>>& out, size_t maxMessages) {
  size_t done = 0;
  while (done < maxMessages) {
    if (!haveLength_) {
      if (inEnd_ - inBegin_ < sizeof(uint64_t)) {
        if (wouldBlock_ || !fill()) return !closed();
        continue;
      }
      uint64_t word;
      std::memcpy(&word, in_.data() + inBegin_, sizeof(word));
      inBegin_ += sizeof(word);
      uint64_t length = word & ~(kStreamMore | kStreamShared);
      if (length > maxFrameBytes_) {
        return fail(formatText("a frame of %llu bytes, over the bound of %llu", static_cast<unsigned long long>(length),
                               static_cast<unsigned long long>(maxFrameBytes_)));
      }
      if (frames_.size() >= kStreamMaxFrames) return fail(formatText("a message of over %zu frames", kStreamMaxFrames));
      more_ = (word & kStreamMore) != 0;
      placing_ = frames_.size() == 1 && length > 0 && placement_ && placement_(frames_[0], length, frame_);
      if (!placing_ && zmq_msg_init_size(frame_.get(), static_cast<size_t>(length)) != 0) {  // frame_: empty
        return fail(formatText("out of memory for a frame of %llu bytes", static_cast<unsigned long long>(length)));
      }
      frameFilled_ = 0;
      haveLength_ = true;
      if (word & kStreamShared) {  // its bytes are in the peer's ring, whole: copy them out
        if (!rings_) return fail("a frame in shared memory, but this stream has none");
        std::string why;
        if (!rings_->take(frame_.data(), static_cast<size_t>(length), &why)) return fail(why);
        frameFilled_ = static_cast<size_t>(length);
        sharedBytes_ += length;
      }
    }
    if (!takeFrameBytes()) return false;
    if (frameFilled_ < frame_.size()) {
      if (wouldBlock_) return true;
      if (!fill()) return !closed();
      continue;
    }
    haveLength_ = false;
    placing_ = false;
    frames_.push_back(std::move(frame_));
    if (more_) continue;
    out.push_back(std::move(frames_));
    frames_.clear();
    ++done;
  }
  return true;
}

void StreamConn::queue(std::vector<Message>& frames) {
  if (closed()) return;
  for (size_t i = 0; i < frames.size(); ++i) {
    Message& frame = frames[i];
    size_t size = frame.size();
    uint64_t word = size | (i + 1 < frames.size() ? kStreamMore : 0);
    if (shareWrites_ && size >= kSharedFrameMin) {  // copied into the ring now, or (no room) sent below
      std::string why;
      SharedRings::Put put = rings_->put(frame.data(), size, &why);
      if (put == SharedRings::Put::kBroken) return close(why);
      if (put == SharedRings::Put::kDone) {
        word |= kStreamShared;
        sharedBytes_ += size;
        size = 0;  // only the length word goes on the socket
      }
    }
    queuedBytes_ += sizeof(word) + size;
    if (size <= kInlineFrame) {
      Message piece = sized(sizeof(word) + size);
      std::memcpy(piece.data(), &word, sizeof(word));
      if (size) std::memcpy(piece.data() + sizeof(word), frame.data(), size);
      out_.push_back(Piece{std::move(piece), 0});
    } else {
      Message head = sized(sizeof(word));  // 8 bytes: held inside the zmq_msg_t, no allocation
      std::memcpy(head.data(), &word, sizeof(word));
      out_.push_back(Piece{std::move(head), 0});
      out_.push_back(Piece{std::move(frame), 0});
    }
  }
}

bool StreamConn::flush() {
  if (closed()) return false;
  writeBlocked_ = false;
  while (!out_.empty()) {
    iovec iov[kMaxIov];
    int count = 0;
    size_t asked = 0;
    for (auto it = out_.begin(); it != out_.end() && count < kMaxIov; ++it) {
      iov[count].iov_base = it->msg.data() + it->offset;
      iov[count].iov_len = it->msg.size() - it->offset;
      asked += iov[count].iov_len;
      ++count;
    }
    msghdr header{};
    header.msg_iov = iov;
    header.msg_iovlen = static_cast<size_t>(count);
    alignas(cmsghdr) char control[CMSG_SPACE(sizeof(int))];
    if (passFd_) {  // the rings' memfd, beside the stream's first bytes
      header.msg_control = control;
      header.msg_controllen = sizeof(control);
      cmsghdr* c = CMSG_FIRSTHDR(&header);
      c->cmsg_level = SOL_SOCKET;
      c->cmsg_type = SCM_RIGHTS;
      c->cmsg_len = CMSG_LEN(sizeof(int));
      int fd = rings_->fd();
      std::memcpy(CMSG_DATA(c), &fd, sizeof(fd));
    }
    ssize_t sent = ::sendmsg(fd_, &header, MSG_NOSIGNAL | MSG_DONTWAIT);
    if (sent > 0) passFd_ = false;
    if (sent < 0) {
      if (errno == EINTR) continue;
      if (errno == EAGAIN || errno == EWOULDBLOCK) {
        writeBlocked_ = true;
        return true;
      }
      return fail(std::string("send failed: ") + std::strerror(errno));
    }
    size_t left = static_cast<size_t>(sent);
    bytesWritten_ += left;
    queuedBytes_ -= std::min<uint64_t>(queuedBytes_, left);
    while (left > 0) {
      Piece& piece = out_.front();
      size_t rest = piece.msg.size() - piece.offset;
      if (left < rest) {
        piece.offset += left;
        break;
      }
      left -= rest;
      out_.pop_front();
    }
    if (static_cast<size_t>(sent) < asked) {  // the send buffer is full: another call now would fail
      writeBlocked_ = true;
      return true;
    }
  }
  return true;
}

int listenStream(const std::string& host, uint16_t port, uint16_t* boundPort, int receiveBufferBytes) {
  std::string why;
  addrinfo* found = resolve(host, port, true, &why);
  if (!found) throw Error(ErrorKind::kTransport, "stream listener: " + why);
  int fd = -1;
  for (addrinfo* a = found; a && fd < 0; a = a->ai_next) {
    fd = ::socket(a->ai_family, a->ai_socktype | SOCK_CLOEXEC, a->ai_protocol);
    if (fd < 0) continue;
    int one = 1;
    setsockopt(fd, SOL_SOCKET, SO_REUSEADDR, &one, sizeof(one));
    if (receiveBufferBytes > 0) setsockopt(fd, SOL_SOCKET, SO_RCVBUF, &receiveBufferBytes, sizeof(receiveBufferBytes));
    if (::bind(fd, a->ai_addr, a->ai_addrlen) != 0 || ::listen(fd, 512) != 0) {
      why = std::strerror(errno);
      ::close(fd);
      fd = -1;
    }
  }
  freeaddrinfo(found);
  if (fd < 0) {
    throw Error(ErrorKind::kTransport,
                formatText("stream listener: cannot listen on %s:%u: %s", host.c_str(), port, why.c_str()));
  }
  setNonBlocking(fd);
  sockaddr_storage addr{};
  socklen_t len = sizeof(addr);
  getsockname(fd, reinterpret_cast<sockaddr*>(&addr), &len);
  *boundPort = ntohs(addr.ss_family == AF_INET6 ? reinterpret_cast<sockaddr_in6*>(&addr)->sin6_port
                                                : reinterpret_cast<sockaddr_in*>(&addr)->sin_port);
  return fd;
}

int connectStream(const std::string& host, uint16_t port, int sendBufferBytes, int receiveBufferBytes,
                  std::string* why) {
  addrinfo* found = resolve(host, port, false, why);
  if (!found) return -1;
  int fd = -1;
  for (addrinfo* a = found; a && fd < 0; a = a->ai_next) {
    fd = ::socket(a->ai_family, a->ai_socktype | SOCK_CLOEXEC | SOCK_NONBLOCK, a->ai_protocol);
    if (fd < 0) continue;
    if (sendBufferBytes > 0) setsockopt(fd, SOL_SOCKET, SO_SNDBUF, &sendBufferBytes, sizeof(sendBufferBytes));
    if (receiveBufferBytes > 0) setsockopt(fd, SOL_SOCKET, SO_RCVBUF, &receiveBufferBytes, sizeof(receiveBufferBytes));
    if (::connect(fd, a->ai_addr, a->ai_addrlen) != 0 && errno != EINPROGRESS) {
      *why = formatText("cannot connect to %s:%u: %s", host.c_str(), port, std::strerror(errno));
      ::close(fd);
      fd = -1;
    }
  }
  freeaddrinfo(found);
  return fd;
}

std::string connectResult(int fd) {
  int error = 0;
  socklen_t len = sizeof(error);
  if (getsockopt(fd, SOL_SOCKET, SO_ERROR, &error, &len) != 0) error = errno;
  return error == 0 ? std::string() : std::string(std::strerror(error));
}

namespace {

socklen_t abstractAddress(const std::string& name, sockaddr_un* addr) {
  *addr = sockaddr_un{};
  addr->sun_family = AF_UNIX;
  size_t n = std::min(name.size(), sizeof(addr->sun_path) - 1);
  std::memcpy(addr->sun_path + 1, name.data(), n);  // sun_path[0] = 0: the abstract namespace, no file
  return static_cast<socklen_t>(offsetof(sockaddr_un, sun_path) + 1 + n);
}

}  // namespace

std::string localStreamName(uint64_t incarnation) { return formatText("torch_bps/stream/%016" PRIx64, incarnation); }

int listenLocalStream(const std::string& name) {
  int fd = ::socket(AF_UNIX, SOCK_STREAM | SOCK_CLOEXEC | SOCK_NONBLOCK, 0);
  if (fd < 0) return -1;
  sockaddr_un addr;
  socklen_t len = abstractAddress(name, &addr);
  if (::bind(fd, reinterpret_cast<sockaddr*>(&addr), len) != 0 || ::listen(fd, 512) != 0) {
    int error = errno;
    ::close(fd);
    errno = error;
    return -1;
  }
  return fd;
}

int connectLocalStream(const std::string& name, std::string* why) {
  int fd = ::socket(AF_UNIX, SOCK_STREAM | SOCK_CLOEXEC | SOCK_NONBLOCK, 0);
  if (fd < 0) {
    *why = std::string("no unix socket: ") + std::strerror(errno);
    return -1;
  }
  int bytes = kLocalStreamBufferBytes;
  setsockopt(fd, SOL_SOCKET, SO_SNDBUF, &bytes, sizeof(bytes));
  sockaddr_un addr;
  socklen_t len = abstractAddress(name, &addr);
  if (::connect(fd, reinterpret_cast<sockaddr*>(&addr), len) != 0) {  // a unix connect is done at once, or not
    *why = formatText("no local stream %s here: %s", name.c_str(), std::strerror(errno));
    ::close(fd);
    return -1;
  }
  return fd;
}

}  // namespace bps::transport
