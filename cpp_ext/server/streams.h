// The server's side of the stream transport (docs/protocol.md, "The stream transport"): the listeners (TCP, and
// the local stream's unix socket) and the streams they accepted, served by the core's loop thread beside the
// ROUTER. This file handles the connections (accept, AUTH, framing, writing, closing); what a request means stays
// in ServerCore, which sees a stream's messages exactly as ROUTER messages: frames[0] is the peer's identity, here
// kStreamIdentityTag + the stream's number, a form no ROUTER peer gets (ServerCore drops ROUTER messages that claim
// it).
//
// Thread contract: everything runs on the core's loop thread (listen() before run()).
#pragma once

#include <zmq.h>

#include <cstdint>
#include <functional>
#include <map>
#include <memory>
#include <string>
#include <vector>

#include "transport/epoll_set.h"
#include "transport/message.h"
#include "transport/stream_conn.h"

namespace bps::server {

using namespace bps::transport;  // see rounds.h


// The kinds of their epoll tags (epoll_set.h; a stream's index is its number). The core's own sockets use the
// kinds below kListenEvent.
enum StreamsEvent : uint64_t { kListenEvent = 3, kLocalListenEvent = 4, kPeerEvent = 5 };

// A stream's identity: these two bytes, then its number (u64). ROUTER-made identities are 5 bytes.
constexpr char kStreamIdentityTag[2] = {'\0', 'S'};
constexpr size_t kStreamIdentitySize = 2 + sizeof(uint64_t);

bool isStreamIdentity(const void* data, size_t size);

struct StreamPeer {
  uint64_t number = 0;
  int fd = -1;  // kept after the socket closed, for ControlPlane::onDisconnect
  std::string identity;
  std::string address;  // the peer's IP
  std::string userId;  // set by AUTH
  bool admitted = false;
  double authDeadline = 0;
  std::unique_ptr<StreamConn> conn;
};

class ServerStreams {
 public:
  // AUTH's frames (greeting first) -> true to admit, with peer.userId set.
  using Admit = std::function<bool(StreamPeer& peer, std::vector<Message>& frames)>;
  // An admitted stream's message, its identity prepended as frames[0].
  using Deliver = std::function<void(StreamPeer& peer, std::vector<Message>& frames)>;
  // An admitted stream closed (its fd number may be reused from now on).
  using Closed = std::function<void(const StreamPeer& peer)>;

  ~ServerStreams() { closeAll(); }

  // Listen on host (any free port); returns the port. receiveBufferBytes > 0: every stream's SO_RCVBUF.
  uint16_t listen(const std::string& host, int receiveBufferBytes = 0);
  bool listening() const { return listenFd_ >= 0; }
  // Also listen on the local stream `name` (localStreamName): false if it cannot (errno set), and then only TCP.
  bool listenLocal(const std::string& name);
  bool listeningLocal() const { return localFd_ >= 0; }
  // Frames of admitted streams may be this long (the ROUTER's ZMQ_MAXMSGSIZE).
  void setMaxFrameBytes(uint64_t bytes) { maxFrameBytes_ = bytes; }

  // Keep the listeners and every stream in `epoll` (POLLOUT only while a stream's writes wait): system calls only
  // for what changed since the last call.
  void watch(EpollSet& epoll);
  // Bytes already read and not yet served: wait without blocking.
  bool hasBuffered() const;
  // Accept, read and write what epoll reported (events[0..count), those of the kinds above; others ignored).
  void serve(const epoll_event* events, int count, double now, const Admit& admit, const Deliver& deliver,
             const Closed& closed);
  // Queue a message (without identity) to the stream named by identity; false if no such stream is open.
  bool send(const std::string& identity, std::vector<Message>& frames);
  // Write every stream with something queued; close those that failed or stopped reading.
  void flush(const Closed& closed);
  // Close the streams that did not finish AUTH in time.
  void expire(double now, const Closed& closed);
  void closeAll();

  size_t count() const { return streams_.size(); }

 private:
  void accept(int listenFd, double now);
  void read(StreamPeer& peer, const Admit& admit, const Deliver& deliver);
  bool adoptRings(StreamConn& conn);  // the admitted worker's shared rings, if it passed some that are sound
  void reap(const Closed& closed);  // drop the closed streams

  int listenFd_ = -1;
  int localFd_ = -1;  // the local stream's listener (listenLocal)
  int epollFd_ = -1;  // the set watch() put the listeners in
  std::vector<std::pair<uint64_t, uint32_t>> ready_;  // serve(): the streams epoll reported, by number
  int receiveBufferBytes_ = 0;  // every accepted stream's SO_RCVBUF (0: the kernel's)
  uint64_t maxFrameBytes_ = 16 << 20;
  uint64_t nextNumber_ = 1;
  std::map<uint64_t, std::unique_ptr<StreamPeer>> streams_;  // by number: serve() walks it beside ready_
  std::vector<std::vector<Message>> messages_;  // read() scratch
};

}  // namespace bps::server
