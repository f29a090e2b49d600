// One end of a stream connection (docs/protocol.md, "The stream transport"): whole messages in, whole
// messages out, on a non-blocking TCP socket (or the local stream's unix socket), without ZeroMQ's I/O thread in
// between. Used by the client's
// I/O thread (one per server) and by the server's loop thread (one per accepted stream), and only by that
// thread: nothing here locks.
//
// Buffer lifetime: a queued frame is a Message, so a payload shared by reference count (a round's result,
// a tensor wrapped without a copy) stays alive until its last byte went into the kernel.
#pragma once

#include <sys/types.h>

#include <cstddef>
#include <cstdint>
#include <deque>
#include <functional>
#include <string>
#include <vector>

#include "transport/message.h"
#include "transport/shared_ring.h"

namespace bps::transport {

constexpr uint64_t kStreamMore = uint64_t{1} << 63;  // a frame's length word: another frame follows
constexpr size_t kStreamMaxFrames = 4;
constexpr const char* kStreamGreeting = "BPS-STREAM-1";
// AUTH's answer, third frame: the server took the worker's shared rings (shared_ring.h).
constexpr const char* kStreamSharedAnswer = "shared";

class StreamConn {
 public:
  // Own `fd` (connected or connecting, made non-blocking here, TCP_NODELAY set): frames longer than
  // maxFrameBytes close the connection as soon as their length word is read, before any allocation.
  StreamConn(int fd, uint64_t maxFrameBytes);
  ~StreamConn();
  StreamConn(const StreamConn&) = delete;
  StreamConn& operator=(const StreamConn&) = delete;

  // Where a message's second frame (its payload) is read to: given the first frame and the payload's length,
  // point `into` at memory of exactly that length (zmq_msg_init_data, e.g. a destination tensor kept alive by
  // its free function) and return true; false: a buffer of the frame's own. Saves a copy and the fresh pages of
  // a buffer per message on the client's pulls.
  using Placement = std::function<bool(const Message& first, uint64_t length, Message& into)>;
  void setPlacement(Placement placement) { placement_ = std::move(placement); }
  // A payload is being read into placed memory (the message is not complete yet).
  bool placing() const { return placing_; }

  int fd() const { return fd_; }
  bool local() const { return !tcp_; }  // a unix socket (connectLocalStream), not TCP
  // Keep this socket in epoll set `epollFd` for `events` (level-triggered) under `tag`: a system call only when
  // they changed. The socket leaves the set before it closes: a forked child still holding it would keep its
  // events coming otherwise. Returns false if epoll refused it (errno set).
  bool watch(int epollFd, uint32_t events, uint64_t tag);
  void setMaxFrameBytes(uint64_t bytes) { maxFrameBytes_ = bytes; }
  // The socket's SO_RCVBUF was set (locked: the kernel will not grow it): SO_RCVLOWAT stays under a quarter
  // of it from now on.
  void lockedReceiveBuffer();
  bool closed() const { return fd_ < 0; }
  // Why it closed ("" while open).
  const std::string& why() const { return why_; }

  // Read what the socket has and append each complete message (its frames) to `out`, at most maxMessages
  // of them per call. Returns false once the connection is closed (the peer closed it, an error, or a
  // framing violation): why() says which; messages completed before that are still in `out`.
  bool read(std::vector<std::vector<Message>>& out, size_t maxMessages);

  // Bytes read from the socket but not yet taken into a message: after read() stopped at maxMessages, the
  // caller must call it again without waiting for the socket (poll will not report these). Not after read()
  // stopped because the socket had nothing more: what is left then is part of a message, poll reports the rest
  // (else a caller polling with timeout 0 while this holds would spin until the message's rest arrives).
  bool hasBuffered() const { return inEnd_ > inBegin_ && !wouldBlock_; }

  // Queue one message; nothing is written before flush(). Small frames are copied in with their length word,
  // bigger ones queued as they are (shared, not copied).
  void queue(std::vector<Message>& frames);
  // Write what the kernel takes now. Returns false once the connection is closed (why() says why).
  bool flush();
  bool wantsWrite() const { return !out_.empty(); }
  // The last flush() left bytes the kernel would not take: flushing again before poll reports POLLOUT only
  // costs a system call that fails.
  bool writeBlocked() const { return writeBlocked_; }
  uint64_t queuedBytes() const { return queuedBytes_; }

  // Close the socket (idempotent); `why` is kept if none was yet.
  void close(const std::string& why);

  uint64_t bytesRead() const { return bytesRead_; }
  uint64_t bytesWritten() const { return bytesWritten_; }

  // Shared memory on a local stream (shared_ring.h). The worker attaches the rings it made with passFd: their
  // memfd goes out with the next write, and frames flagged kStreamShared are read from them from now on. The
  // server, whose local streams acceptFd() before their first read, takes that memfd (takeReceivedFd) and attaches
  // what it adopted. Either side writes big frames through them only after shareWrites(): once the server said it
  // adopted them.
  void share(std::unique_ptr<SharedRings> rings, bool passFd);
  void shareWrites() { shareWrites_ = rings_ != nullptr; }
  bool sharesWrites() const { return shareWrites_; }
  void acceptFd() { acceptFd_ = true; }
  int takeReceivedFd();  // -1 if none came; the caller owns it
  uint64_t sharedBytes() const { return sharedBytes_; }  // frame bytes moved through the rings, both ways

 private:
  bool fail(const std::string& why);
  bool fill();  // read into the staging buffer; false: closed (why_ set) or nothing there (wouldBlock_ set)
  // recv() up to n bytes: how many came; 0 when none were there, or the last recv came back short (wouldBlock_
  // set either way), or the connection closed.
  size_t receive(void* into, size_t n);
  ssize_t receiveWithFd(void* into, size_t n);  // recvmsg, keeping a passed descriptor in receivedFd_
  bool takeFrameBytes();
  bool readMessages(std::vector<std::vector<Message>>& out, size_t maxMessages);  // read()'s loop
  void setLowWater(size_t bytes);  // SO_RCVLOWAT, set only when it changes

  struct Piece {
    Message msg;
    size_t offset = 0;  // bytes of msg already written
  };

  int fd_ = -1;
  uint64_t maxFrameBytes_;
  std::string why_;
  bool wouldBlock_ = false;  // read() stopped for want of bytes
  bool drained_ = false;  // this read()'s last recv came back short: no point asking again before poll
  bool writeBlocked_ = false;
  bool tcp_ = true;  // SO_RCVLOWAT and TCP_NODELAY mean something (a unix socket's poll ignores the mark)
  int lowWater_ = 1;
  size_t maxLowWater_;
  int epollFd_ = -1;  // the set watch() put this socket in, with what
  uint32_t watchedEvents_ = 0;
  uint64_t watchedTag_ = 0;  // SO_RCVLOWAT's ceiling

  // Reading: a staging buffer for length words and small frames; a frame's bytes beyond it are read straight
  // into the frame.
  std::vector<uint8_t> in_;
  size_t inBegin_ = 0, inEnd_ = 0;
  bool haveLength_ = false;
  bool more_ = false;
  Message frame_;
  size_t frameFilled_ = 0;
  std::vector<Message> frames_;  // the message being read
  Placement placement_;
  bool placing_ = false;

  std::unique_ptr<SharedRings> rings_;
  bool shareWrites_ = false;
  bool passFd_ = false;  // send rings_'s memfd with the next write
  bool acceptFd_ = false;  // take an fd passed with the next bytes read
  int receivedFd_ = -1;
  uint64_t sharedBytes_ = 0;

  std::deque<Piece> out_;
  uint64_t queuedBytes_ = 0;
  uint64_t bytesRead_ = 0, bytesWritten_ = 0;
};

// Listen on host:port (port 0: any free one) for streams; returns the listening fd (non-blocking) and sets
// *boundPort. receiveBufferBytes > 0 sets SO_RCVBUF, which the accepted streams inherit. Throws
// Error(kTransport) naming the address.
int listenStream(const std::string& host, uint16_t port, uint16_t* boundPort, int receiveBufferBytes = 0);

// Start a non-blocking connection to host:port (IPv4 or IPv6 literal, or a name); a buffer size > 0 sets
// SO_SNDBUF / SO_RCVBUF first (before the handshake, which fixes the window scale). Returns the fd, connected or
// still connecting (poll it for writing, then check connectResult); -1 with *why set if it failed at once.
int connectStream(const std::string& host, uint16_t port, int sendBufferBytes, int receiveBufferBytes,
                  std::string* why);
// After a connecting fd polled writable: "" if connected, else why not.
std::string connectResult(int fd);

// The local stream (docs/protocol.md, "The stream transport"): a server also listens on an abstract unix socket
// named after its incarnation. Abstract names are scoped by network namespace, so a worker reaches it only from
// the server's own machine (or container), where it saves the TCP stack's work on every byte; elsewhere the
// connect finds nothing and the worker takes TCP. Its buffers: the link's sizing means nothing there, and bigger
// ones mean fewer wake-ups per partition.
constexpr int kLocalStreamBufferBytes = 1 << 20;
std::string localStreamName(uint64_t incarnation);
// Listen on the abstract name (non-blocking); -1 if it cannot (errno set: EADDRINUSE if another holds it).
int listenLocalStream(const std::string& name);
// Connect to the abstract name (non-blocking; SO_SNDBUF kLocalStreamBufferBytes): the fd, connected (poll it for
// writing, then check connectResult, as connectStream's), or -1 with *why set if none listens in this network
// namespace (or its backlog is full).
int connectLocalStream(const std::string& name, std::string* why);

}  // namespace bps::transport
