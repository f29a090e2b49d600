// See server_streams.h.
#include "server_streams.h"

#include <arpa/inet.h>
#include <netinet/in.h>
#include <sys/socket.h>
#include <unistd.h>

#include <cstring>

#include "errors.h"

namespace bps {

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

void ServerStreams::addPollItems(std::vector<pollfd>& items) const {
  if (listenFd_ < 0) return;
  items.push_back({listenFd_, POLLIN, 0});
  for (const auto& [number, peer] : streams_) {
    short events = static_cast<short>(POLLIN | (peer->conn->wantsWrite() ? POLLOUT : 0));
    items.push_back({peer->conn->fd(), events, 0});
  }
}

bool ServerStreams::hasBuffered() const {
  for (const auto& [number, peer] : streams_) {
    if (peer->conn->hasBuffered()) return true;
  }
  return false;
}

void ServerStreams::serve(const std::vector<pollfd>& items, size_t first, double now, const Admit& admit,
                          const Deliver& deliver, const Closed& closed) {
  if (listenFd_ < 0) return;
  // The streams in poll order, as addPollItems listed them (accepting below adds streams after them).
  size_t i = first + 1;
  for (auto& [number, peer] : streams_) {
    if (i >= items.size()) break;
    const pollfd& item = items[i++];
    StreamConn& conn = *peer->conn;
    if (item.fd != peer->fd || conn.closed()) continue;
    if ((item.revents & POLLOUT) && !conn.flush()) continue;
    if ((item.revents & (POLLIN | POLLERR | POLLHUP)) || conn.hasBuffered()) read(*peer, admit, deliver);
  }
  if (items[first].revents & POLLIN) accept(now);
  flush(closed);
}

void ServerStreams::accept(double now) {
  for (;;) {
    int fd = ::accept4(listenFd_, nullptr, nullptr, SOCK_NONBLOCK | SOCK_CLOEXEC);
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
    if (receiveBufferBytes_ > 0) peer->conn->lockedReceiveBuffer();  // inherited from the listener
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
      peer.conn->queue(answer);
      continue;
    }
    frames.insert(frames.begin(), Message::copyOf(peer.identity.data(), peer.identity.size()));
    deliver(peer, frames);
  }
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
  streams_.clear();
  if (listenFd_ >= 0) ::close(listenFd_);
  listenFd_ = -1;
}

}  // namespace bps
