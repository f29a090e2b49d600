// The client's end of one server's stream (docs/protocol.md, "The stream transport"): a plain TCP connection
// (a unix socket to a server on this machine: its local stream) beside the server's DEALER (ZmqLink), which the
// IO thread reads and writes itself, saving ZeroMQ's I/O thread and its wake-ups on every message.
//
// States: none -> connecting -> AUTH sent -> HELLO sent -> ready, and back to none from any of them. Opening
// (connect, AUTH, HELLO) has one deadline, kStreamOpenTimeout: a stream never hangs in between. A stream that
// fails to open is simply not used (the client stays on ZeroMQ); one that drops once ready is the server's
// connection dropping, which the client handles (client_stream.cpp).
//
// Threading: driven by the client's IO thread only; ready() and the byte counters may be read from any thread.
#pragma once

#include <ATen/core/Tensor.h>

#include <atomic>
#include <chrono>
#include <cstdint>
#include <memory>
#include <string>
#include <vector>

#include "transport/auth_keys.h"
#include "transport/message.h"
#include "transport/stream_conn.h"

namespace bps::transport {

constexpr std::chrono::seconds kStreamOpenTimeout{10};

enum class StreamState { kNone, kConnecting, kAuthSent, kHelloSent, kReady };

// What one StreamLink::step() found.
struct StreamStep {
  std::vector<std::vector<Message>> replies;  // messages received while ready, in order: for Client::onReply
  bool becameReady = false;
  bool closed = false;  // the stream closed in this step (why: `why`); it was ready if wasReady
  bool wasReady = false;
  std::string why;
};

class StreamLink {
 public:
  using Clock = std::chrono::steady_clock;

  explicit StreamLink(std::string address) : address_(std::move(address)) {}

  // Start opening a stream to host:port: connect, then AUTH with `keys` (a token: PLAIN; none: NULL), then the
  // HELLO `hello` (a packed header whose request id is helloId); ready once its reply carries `incarnation`.
  // Returns "" if under way, else why it failed at once (state none).
  // localName not empty: try that local stream first (connectLocalStream), TCP if none listens here; there,
  // sharedMemory: offer the server shared rings for big frames (shared_ring.h).
  std::string open(const std::string& host, uint16_t port, int sendBufferBytes, int receiveBufferBytes,
                   const LinkKeys& keys, Message hello, uint64_t helloId, uint64_t incarnation,
                   const std::string& localName = "", bool sharedMemory = false);

  StreamState state() const { return state_; }
  bool ready() const { return ready_.load(std::memory_order_acquire); }
  bool local() const { return local_.load(std::memory_order_acquire); }  // open on the local stream, not TCP
  bool shared() const { return shared_.load(std::memory_order_acquire); }  // big frames through shared rings
  uint64_t sharedBytes() const { return sharedBytes_.load(std::memory_order_relaxed); }  // through them, both ways
  bool active() const { return conn_ != nullptr; }  // a socket to poll
  bool opening() const { return active() && state_ != StreamState::kReady; }
  int fd() const { return conn_ ? conn_->fd() : -1; }
  // Counts open()s: tells a poll result of an earlier stream (closed meanwhile, its fd number maybe reused) from
  // one of the stream open now.
  uint64_t generation() const { return generation_; }
  // POLLIN/POLLOUT to ask for: POLLOUT only while connecting or while writes wait.
  short pollEvents() const;
  // Keep the open stream in epoll set `epollFd` for pollEvents() under `tag` (StreamConn::watch); false if epoll
  // refused it (errno set).
  bool watch(int epollFd, uint64_t tag) {
    return !conn_ || conn_->watch(epollFd, static_cast<uint16_t>(pollEvents()), tag);
  }
  // Bytes already read but not parsed: step() must run again without waiting for poll.
  bool hasBuffered() const { return conn_ && conn_->hasBuffered(); }
  Clock::time_point deadline() const { return deadline_; }

  // Handle what poll reported (revents 0: none; still flushes queued writes and checks the deadline).
  void step(short revents, StreamStep& out);

  // Where payloads are read to (StreamConn::Placement), for every stream opened from now on.
  void setPlacement(StreamConn::Placement placement) { placement_ = std::move(placement); }
  // A payload is being read into placed memory.
  bool placing() const { return conn_ && conn_->placing(); }

  // Queue one request (its frames; payloads shared, not copied) while ready; written by the next step().
  void send(std::vector<Message>& frames);

  // Close without reporting anything (the client already knows why: close(), abandon, its link went down).
  void close(const std::string& why);

  uint64_t bytesSent() const { return bytesSent_.load(std::memory_order_relaxed); }
  uint64_t bytesReceived() const { return bytesReceived_.load(std::memory_order_relaxed); }

 private:
  void fail(const std::string& why, StreamStep& out);
  void take(std::vector<Message>& message, StreamStep& out);  // one message received

  std::string address_;
  std::unique_ptr<StreamConn> conn_;
  StreamConn::Placement placement_;
  StreamState state_ = StreamState::kNone;
  std::atomic<bool> ready_{false};
  std::atomic<bool> local_{false};
  std::atomic<bool> shared_{false};
  Clock::time_point deadline_{};
  uint16_t port_ = 0;
  uint64_t generation_ = 0;
  Message hello_;
  uint64_t helloId_ = 0;
  uint64_t incarnation_ = 0;
  void countShared();  // add what conn_ moved through its rings since the last call
  std::atomic<uint64_t> bytesSent_{0};
  std::atomic<uint64_t> sharedBytes_{0};
  uint64_t sharedSeen_ = 0;  // conn_'s count at the last countShared()
  std::atomic<uint64_t> bytesReceived_{0};
};

// A message frame of n bytes copied from data.
Message copyFrame(const void* data, size_t n);
// A message frame over a tensor's bytes, zero-copy: holds a reference to the tensor until the frame is released.
Message tensorFrame(const at::Tensor& tensor);

}  // namespace bps::transport
