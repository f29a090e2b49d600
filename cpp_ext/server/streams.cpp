// See streams.h.
#include "server/streams.h"

#include <arpa/inet.h>
#include <netinet/in.h>
#include <sys/socket.h>
#include <unistd.h>

#include <algorithm>
#include <cstdio>
#include <cstring>

#include "common/errors.h"

namespace bps::server {

namespace {

constexpr size_t kMaxStreams = 4096;
constexpr double kAuthSeconds = 10.0;
constexpr size_t kAuthFrameBytes = 4096;  // a stranger's frames, before AUTH admitted it
constexpr uint64_t kMaxQueuedBytes = uint64_t{256} << 20;  // unsent replies of a peer that stopped reading
constexpr size_t kBatch = 256;  // messages read from one stream per wake-up

std::string peerAddress(int fd) {
  sockaddr_storage addr{};
  socklen_t len = sizeof(addr);
  if (getpeername(fd, reinterpret_cast<sockaddr*>(&addr), &len) != 0) return "";
  if (addr.ss_family == AF_UNIX) return "local";  // torch_bps.wire.LOCAL_PEER
  char text[INET6_ADDRSTRLEN] = {0};
  const void* raw = addr.ss_family == AF_INET6 ? static_cast<const void*>(&reinterpret_cast<sockaddr_in6*>(&addr)->sin6_addr)
                                               : static_cast<const void*>(&reinterpret_cast<sockaddr_in*>(&addr)->sin_addr);
  inet_ntop(addr.ss_family, raw, text, sizeof(text));
  return text;
}

}  // namespace

bool isStreamIdentity(const void* data, size_t size) {
  return size == kStreamIdentitySize && std::memcmp(data, kStreamIdentityTag, sizeof(kStreamIdentityTag)) == 0;
}

uint16_t ServerStreams::listen(const std::string& host, int receiveBufferBytes) {
  uint16_t port = 0;
  listenFd_ = listenStream(host, 0, &port, receiveBufferBytes);
  receiveBufferBytes_ = receiveBufferBytes;
  return port;
}

bool ServerStreams::listenLocal(const std::string& name) {
  if (localFd_ < 0) localFd_ = listenLocalStream(name);
  return localFd_ >= 0;
}

void ServerStreams::watch(EpollSet& epoll) {
  if (epollFd_ != epoll.fd()) {
    epollFd_ = epoll.fd();
    if (listenFd_ >= 0) epoll.add(listenFd_, eventTag(kListenEvent, 0), "the stream listener");
    if (localFd_ >= 0) epoll.add(localFd_, eventTag(kLocalListenEvent, 0), "the local stream's listener");
  }
  for (const auto& [number, peer] : streams_) {
    uint32_t events = EPOLLIN | (peer->conn->wantsWrite() ? EPOLLOUT : 0);
    if (!peer->conn->watch(epollFd_, events, eventTag(kPeerEvent, number))) {
      throw Error(ErrorKind::kTransport, std::string("epoll_ctl on a stream: ") + std::strerror(errno));
    }
  }
}

bool ServerStreams::hasBuffered() const {
  for (const auto& [number, peer] : streams_) {
    if (peer->conn->hasBuffered()) return true;
  }
  return false;
}

void ServerStreams::serve(const epoll_event* events, int count, double now, const Admit& admit,
                          const Deliver& deliver, const Closed& closed) {
  bool acceptTcp = false, acceptLocal = false;
  ready_.clear();
  for (int e = 0; e < count; ++e) {
    uint64_t tag = events[e].data.u64;
    switch (eventKind(tag)) {
      case kListenEvent: acceptTcp = true; break;
      case kLocalListenEvent: acceptLocal = true; break;
      case kPeerEvent: ready_.emplace_back(eventIndex(tag), events[e].events); break;
      default: break;  // the core's sockets
    }
  }
  std::sort(ready_.begin(), ready_.end());
  // Every stream in number order, with what epoll said of it (a stream with bytes buffered reads on regardless).
  auto said = ready_.begin();
  for (auto& [number, peer] : streams_) {
    while (said != ready_.end() && said->first < number) ++said;
    uint32_t revents = said != ready_.end() && said->first == number ? said->second : 0;
    StreamConn& conn = *peer->conn;
    if (conn.closed()) continue;
    if ((revents & EPOLLOUT) && !conn.flush()) continue;
    if ((revents & (EPOLLIN | EPOLLERR | EPOLLHUP)) || conn.hasBuffered()) read(*peer, admit, deliver);
  }
  if (acceptTcp) accept(listenFd_, now);
  if (acceptLocal) accept(localFd_, now);
  flush(closed);
}

void ServerStreams::accept(int listenFd, double now) {
  for (;;) {
    int fd = ::accept4(listenFd, nullptr, nullptr, SOCK_NONBLOCK | SOCK_CLOEXEC);
    if (fd < 0) return;  // EAGAIN, or a connection that died before it was taken
    if (streams_.size() >= kMaxStreams) {
      ::close(fd);
      continue;
    }
    auto peer = std::make_unique<StreamPeer>();
    peer->number = nextNumber_++;
    peer->fd = fd;
    peer->identity.assign(kStreamIdentityTag, sizeof(kStreamIdentityTag));
    peer->identity.append(reinterpret_cast<const char*>(&peer->number), sizeof(peer->number));
    peer->address = peerAddress(fd);
    peer->authDeadline = now + kAuthSeconds;
    peer->conn = std::make_unique<StreamConn>(fd, kAuthFrameBytes);
    if (peer->conn->local()) {
      int bytes = kLocalStreamBufferBytes;  // replies: fewer, bigger pieces per partition
      setsockopt(fd, SOL_SOCKET, SO_SNDBUF, &bytes, sizeof(bytes));
      peer->conn->acceptFd();  // the worker's shared rings come with its first bytes
    } else if (receiveBufferBytes_ > 0) {
      peer->conn->lockedReceiveBuffer();  // inherited from the listener
    }
    streams_.emplace(peer->number, std::move(peer));
  }
}

void ServerStreams::read(StreamPeer& peer, const Admit& admit, const Deliver& deliver) {
  messages_.clear();
  peer.conn->read(messages_, kBatch);  // a close is seen by reap(); the messages read before it still count
  for (auto& frames : messages_) {
    if (peer.conn->closed() && !peer.admitted) return;
    if (!peer.admitted) {
      // The first message must be AUTH; a refused peer gets nothing back and nothing else it sent is read.
      if (!admit(peer, frames)) {
        peer.conn->close("AUTH refused");
        return;
      }
      peer.admitted = true;
      peer.conn->setMaxFrameBytes(maxFrameBytes_);
      std::vector<Message> answer(2);
      answer[0] = Message::copyOf(kStreamGreeting, std::strlen(kStreamGreeting));
      answer[1] = Message::copyOf("200", 3);
      if (adoptRings(*peer.conn)) answer.push_back(Message::copyOf(kStreamSharedAnswer, std::strlen(kStreamSharedAnswer)));
      peer.conn->queue(answer);
      peer.conn->shareWrites();  // after the answer: it is the last frame the worker reads from the socket alone
      continue;
    }
    frames.insert(frames.begin(), Message::copyOf(peer.identity.data(), peer.identity.size()));
    deliver(peer, frames);
  }
}

bool ServerStreams::adoptRings(StreamConn& conn) {
  int fd = conn.takeReceivedFd();
  if (fd < 0) return false;
  std::string why;
  std::unique_ptr<SharedRings> rings = SharedRings::adopt(fd, &why);
  if (!rings) {  // the worker stays on the socket alone
    std::fprintf(stderr, "torch_bps server: a local stream's shared memory refused: %s\n", why.c_str());
    return false;
  }
  conn.share(std::move(rings), false);
  return true;
}

bool ServerStreams::send(const std::string& identity, std::vector<Message>& frames) {
  if (identity.size() != kStreamIdentitySize) return false;
  uint64_t number;
  std::memcpy(&number, identity.data() + sizeof(kStreamIdentityTag), sizeof(number));
  auto found = streams_.find(number);
  if (found == streams_.end() || found->second->conn->closed()) return false;
  StreamConn& conn = *found->second->conn;
  conn.queue(frames);
  if (conn.queuedBytes() > kMaxQueuedBytes) conn.close("over 256 MiB of replies unsent: the peer stopped reading");
  return true;
}

void ServerStreams::flush(const Closed& closed) {
  for (auto& [number, peer] : streams_) {
    if (peer->conn->wantsWrite() && !peer->conn->writeBlocked()) peer->conn->flush();  // blocked: on POLLOUT
  }
  reap(closed);
}

void ServerStreams::expire(double now, const Closed& closed) {
  for (auto& [number, peer] : streams_) {
    if (!peer->admitted && now > peer->authDeadline) peer->conn->close("no AUTH within 10 s");
  }
  reap(closed);
}

void ServerStreams::reap(const Closed& closed) {
  for (auto it = streams_.begin(); it != streams_.end();) {
    if (!it->second->conn->closed()) {
      ++it;
      continue;
    }
    std::unique_ptr<StreamPeer> peer = std::move(it->second);
    it = streams_.erase(it);
    if (peer->admitted) closed(*peer);
  }
}

void ServerStreams::closeAll() {
  streams_.clear();  // each stream leaves the epoll set as it closes
  for (int fd : {listenFd_, localFd_}) {
    if (fd >= 0 && epollFd_ >= 0) epoll_ctl(epollFd_, EPOLL_CTL_DEL, fd, nullptr);
    if (fd >= 0) ::close(fd);
  }
  listenFd_ = localFd_ = epollFd_ = -1;
}

}  // namespace bps::server
