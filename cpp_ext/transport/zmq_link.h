// The client's ZeroMQ link to one server (link.h): a DEALER socket, the PAIR socket its monitor reports on, and
// byte counters. Sends never block; the payload goes out zero-copy from the tensor's memory. ZeroMQ reconnects
// by itself: the monitor reports each drop (onClosed) and each (re)connection (onConnected).
//
// Threading: built on the caller's thread, then used and closed only by the client's IO thread
// (starting that thread is the memory barrier ZeroMQ asks for when a socket changes threads).
#pragma once

#include <ATen/core/Tensor.h>
#include <zmq.h>

#include <atomic>
#include <cstdint>
#include <string>

#include "transport/credentials.h"
#include "transport/link.h"
#include "transport/wire.h"

namespace bps::transport {

// One ZeroMQ message part, closed when it goes out of scope.
class Frame {
 public:
  Frame() { zmq_msg_init(&msg_); }
  ~Frame() { zmq_msg_close(&msg_); }
  Frame(const Frame&) = delete;
  Frame& operator=(const Frame&) = delete;
  Frame& operator=(Frame&& other) noexcept {
    zmq_msg_move(&msg_, &other.msg_);
    return *this;
  }

  zmq_msg_t* get() { return &msg_; }
  const uint8_t* data() { return static_cast<const uint8_t*>(zmq_msg_data(&msg_)); }
  size_t size() { return zmq_msg_size(&msg_); }

 private:
  zmq_msg_t msg_;
};

// A received message: the header frame, the payload frame if any, and how many frames came. Not named
// Message: message.h's transport::Message is another type in the same namespace.
struct LinkMessage {
  Frame header;
  Frame payload;
  size_t frames = 0;
};

// One monitor event, or kNothing when none is waiting.
enum class LinkEvent { kNothing, kConnected, kDisconnected, kOther };

class ZmqLink : public Link {
 public:
  // Connect a DEALER to `address` ("host:port") with keys' mechanism (token, CURVE or none); throws
  // Error(kTransport) if ZeroMQ refuses it (an address, or CURVE keys that are not 40 characters of Z85).
  // Heartbeats catch a server that vanished without closing TCP (stopped, cut off): silent for
  // heartbeatTimeout after a PING, the connection drops. Any traffic counts as an answer, so a PING
  // queued behind a big message does not time out. A killed process closes TCP and is noticed at once.
  // socketBufferBytes > 0 sets SO_SNDBUF and SO_RCVBUF of the TCP connection (before it opens), which bound
  // its bytes in flight both ways; 0 leaves the kernel's autotuning.
  ZmqLink(size_t server, void* context, const std::string& address, const std::string& monitorEndpoint,
          double heartbeatInterval, double heartbeatTimeout, const LinkCredentials& keys = LinkCredentials{},
          int socketBufferBytes = 0);
  ~ZmqLink() override;

  bool everConnected() const { return everConnected_.load(); }

  // Link: always ready while open (ZeroMQ queues what it cannot send yet, and reconnects by itself).
  bool ready() const override { return socket_ != nullptr; }
  bool reconnects() const override { return true; }
  std::string send(const Header& header, const at::Tensor* payload) override;
  void watch(EpollSet& epoll, uint64_t kind, uint32_t slot, LinkListener& listener) override;
  void notify(uint32_t bits, uint32_t events) override;
  void poll(LinkListener& listener) override;
  // Before the first look, and after a send (zmq_fd.h: it may have taken the signal of a reply meanwhile).
  bool mustPoll() const override { return first_ || sentSinceRead_; }
  // Close both sockets without lingering (pending messages are dropped and their tensors released).
  void close(const std::string& why = "") override;

  uint64_t bytesSent() const override { return bytesSent_.load(std::memory_order_relaxed); }
  uint64_t bytesReceived() const override { return bytesReceived_.load(std::memory_order_relaxed); }

 private:
  // Queue a header (and the payload, zero-copy); false with zmq_errno() set if ZeroMQ refused it.
  bool sendFrames(const Header& header, const at::Tensor* payload);
  // Take the next waiting message, if any; false when none is waiting (ZeroMQ said EAGAIN: the DEALER's fd
  // will signal the next one).
  bool receive(LinkMessage& out);
  // Read one monitor event; kNothing if none is waiting.
  LinkEvent readMonitor();

  void* socket_ = nullptr;
  void* monitor_ = nullptr;
  int socketFd_ = -1, monitorFd_ = -1;
  bool watched_ = false;  // its fds are in the IO loop's epoll set
  bool first_ = true;  // nothing is known of the sockets before the first look
  bool socketSignalled_ = false, monitorSignalled_ = false;  // by this turn's wait
  bool sentSinceRead_ = false;  // sent on since a receive() found nothing: read again before a blocking wait
  std::atomic<bool> everConnected_{false};
  std::atomic<uint64_t> bytesSent_{0};
  std::atomic<uint64_t> bytesReceived_{0};
};

}  // namespace bps::transport
