// The client's stream link to one server (link.h; docs/protocol.md, "The stream transport"): a plain TCP
// connection (a unix socket to a server on this machine: its local stream) beside the server's DEALER (ZmqLink),
// which the IO thread reads and writes itself, saving ZeroMQ's I/O thread and its wake-ups on every message.
//
// States: none -> connecting -> AUTH sent -> HELLO sent -> ready, and back to none from any of them. Opening
// (connect, AUTH, HELLO) has one deadline, kStreamOpenTimeout: a stream never hangs in between. A stream that
// fails to open is simply not used (the client stays on ZeroMQ); one that drops once ready is the server's
// connection dropping, which the client handles (server_links.cpp, dispatcher_health.cpp).
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

#include "transport/credentials.h"
#include "transport/link.h"
#include "transport/message.h"
#include "transport/stream_conn.h"

namespace bps::transport {

constexpr std::chrono::seconds kStreamOpenTimeout{10};

enum class StreamState { kNone, kConnecting, kAuthSent, kHelloSent, kReady };

// What one StreamLink::step() found.
struct StreamStep {
  std::vector<std::vector<Message>> replies;  // messages received while ready, in order
  bool becameReady = false;
  bool closed = false;  // the stream closed in this step (why: `why`); it was ready if wasReady
  bool wasReady = false;
  std::string why;
};

class StreamLink : public Link {
 public:
  StreamLink(size_t server, std::string address) : Link(server, std::move(address)) {}

  // Start opening a stream to host:port: connect, then AUTH with `keys` (a token: PLAIN; none: NULL), then the
  // HELLO `hello` (a packed header whose request id is helloId); ready once its reply carries `incarnation`.
  // Returns "" if under way, else why it failed at once (state none).
  // localName not empty: try that local stream first (connectLocalStream), TCP if none listens here; there,
  // sharedMemory: offer the server shared rings for big frames (shared_ring.h).
  std::string open(const std::string& host, uint16_t port, int sendBufferBytes, int receiveBufferBytes,
                   const LinkCredentials& keys, Message hello, uint64_t helloId, uint64_t incarnation,
                   const std::string& localName = "", bool sharedMemory = false);

  StreamState state() const { return state_; }

  // Link: ready once its HELLO was answered; never reopened by itself.
  bool ready() const override { return ready_.load(std::memory_order_acquire); }
  bool reconnects() const override { return false; }
  // Queued while ready, written by the loop's next watch() or poll() with whatever else was queued by then.
  std::string send(const Header& header, const at::Tensor* payload) override;
  void watch(EpollSet& epoll, uint64_t kind, uint32_t slot, LinkListener& listener) override;
  void notify(uint32_t bits, uint32_t events) override;
  void poll(LinkListener& listener) override;
  // Bytes already read but not parsed: epoll would not report them.
  bool mustPoll() const override { return hasBuffered(); }
  Clock::time_point deadline() const override { return opening() ? deadline_ : Clock::time_point::max(); }
  uint64_t placing() const override { return conn_ && conn_->placing() ? placingRequest_ : 0; }
  // Close without reporting anything (the client already knows why: close(), abandon, its link went down).
  void close(const std::string& why) override;
  void abort(const std::string& why, LinkListener& listener) override;
  uint64_t bytesSent() const override { return bytesSent_.load(std::memory_order_relaxed); }
  uint64_t bytesReceived() const override { return bytesReceived_.load(std::memory_order_relaxed); }

  bool local() const { return local_.load(std::memory_order_acquire); }  // open on the local stream, not TCP
  bool shared() const { return shared_.load(std::memory_order_acquire); }  // big frames through shared rings
  uint64_t sharedBytes() const { return sharedBytes_.load(std::memory_order_relaxed); }  // through them, both ways
  bool active() const { return conn_ != nullptr; }  // a socket to poll
  bool opening() const { return active() && state_ != StreamState::kReady; }
  int fd() const { return conn_ ? conn_->fd() : -1; }
  // Counts open()s: tells a poll result of an earlier stream (closed meanwhile, its fd number maybe reused) from
  // one of the stream open now.
  uint64_t generation() const { return generation_; }
  // Bytes already read but not parsed: step() must run again without waiting for poll.
  bool hasBuffered() const { return conn_ && conn_->hasBuffered(); }

  // Where payloads are read to (StreamConn::Placement), for every stream opened from now on.
  void setPlacement(StreamConn::Placement placement);

 private:
  // POLLIN/POLLOUT to ask for: POLLOUT only while connecting or while writes wait.
  short pollEvents() const;
  // Handle what poll reported (revents 0: none; still flushes queued writes and checks the deadline).
  void step(short revents, StreamStep& out);
  void fail(const std::string& why, StreamStep& out);
  void take(std::vector<Message>& message, StreamStep& out);  // one message received
  // Queue one message (its frames; payloads shared, not copied); written by the next step().
  void queue(std::vector<Message>& frames);
  void report(StreamStep& step, LinkListener& listener);  // what a step() found, in order

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
  uint64_t placingRequest_ = 0;  // the request whose reply the placement took last
  bool watched_ = false;  // this turn's watch() put it in the epoll set, as generation watchedGeneration_
  uint64_t watchedGeneration_ = 0;
  short signalled_ = 0;  // what this turn's wait reported
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
