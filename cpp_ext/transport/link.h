// One road to one server, whatever carries it: a ZeroMQ DEALER (zmq_link.h) or a stream over TCP or the local
// unix socket, maybe with shared memory (stream_link.h). The client schedules requests, matches their replies
// and fails what a drop took through this surface only; each transport fills in the primitives below (the
// shape of ps-lite's Van, and of gloo's transport::Pair with one folder per backend).
//
// The IO loop's turn, for every link: watch() before it waits, notify() for each event epoll reported under the
// link's tags, poll() after the wait. What a link finds it reports to its LinkListener, in the order it happened.
//
// Threading: driven by the client's IO thread only; ready() and the byte counters may be read from any thread.
#pragma once

#include <ATen/core/Tensor.h>

#include <chrono>
#include <cstddef>
#include <cstdint>
#include <string>
#include <utility>

#include "transport/epoll_set.h"
#include "transport/wire.h"

namespace bps::transport {

// One received message, whichever link it came on; valid during LinkListener::onReply only.
struct Reply {
  const uint8_t* header = nullptr;
  size_t headerSize = 0;
  const uint8_t* payload = nullptr;  // the second frame, if any
  size_t payloadSize = 0;
  size_t frames = 0;
};

class Link;

// What links report to the IO thread that drives them.
class LinkListener {
 public:
  virtual ~LinkListener() = default;
  virtual void onReply(Link& link, const Reply& reply) = 0;
  // The connection (re)opened by itself (a link that reconnects()).
  virtual void onConnected(Link& link) = 0;
  // Requests may go on it now (a link that is opened: connected, authenticated, its HELLO answered).
  virtual void onReady(Link& link) = 0;
  // It closed: `why` ("" when the transport knows no more); wasReady false: it never carried a request.
  virtual void onClosed(Link& link, const std::string& why, bool wasReady) = 0;
};

class Link {
 public:
  using Clock = std::chrono::steady_clock;

  Link(size_t server, std::string address) : server_(server), address_(std::move(address)) {}
  virtual ~Link() = default;
  Link(const Link&) = delete;
  Link& operator=(const Link&) = delete;

  size_t server() const { return server_; }  // the index of the server it leads to
  const std::string& address() const { return address_; }  // the server's "host:port"

  // Requests may be sent on it now.
  virtual bool ready() const = 0;
  // After a drop it reconnects by itself (and reports onConnected); otherwise it stays closed until reopened.
  virtual bool reconnects() const = 0;
  // Queue one request: its header and, for a PUSH, the payload, zero-copy (a reference to the tensor is held
  // until its bytes are gone). Returns "" if queued, else why not. Never blocks.
  virtual std::string send(const Header& header, const at::Tensor* payload) = 0;

  // Before the wait: do what needs no event (write what was queued, check deadlines) and keep its fds in `epoll`
  // under eventTag(kind, slot | its own bits << 32). Throws Error(kTransport) if epoll refuses them.
  virtual void watch(EpollSet& epoll, uint64_t kind, uint32_t slot, LinkListener& listener) = 0;
  // epoll reported `events` under one of its tags (`bits`: the tag's bits above the slot).
  virtual void notify(uint32_t bits, uint32_t events) = 0;
  // After the wait: read and write what the events allow.
  virtual void poll(LinkListener& listener) = 0;
  // The next wait must not block: work is waiting that no fd will signal.
  virtual bool mustPoll() const = 0;
  // When it must be polled even without events (an opening deadline); max: never.
  virtual Clock::time_point deadline() const { return Clock::time_point::max(); }

  // The request whose reply is being read straight into its destination right now, or 0. Before that
  // request's destination is handed back, the link must be closed: nothing else stops the bytes.
  virtual uint64_t placing() const { return 0; }

  // Close without reporting anything (the caller knows why); a link that reconnects() is closed for good.
  virtual void close(const std::string& why) = 0;
  // Close at once and report it as a drop (onClosed, as ready): what it carried is lost.
  virtual void abort(const std::string& why, LinkListener& listener) {
    close(why);
    listener.onClosed(*this, why, true);
  }

  virtual uint64_t bytesSent() const = 0;
  virtual uint64_t bytesReceived() const = 0;

 private:
  size_t server_;
  std::string address_;
};

// The tag bits a link adds above its slot (the client keeps a slot's index in the low 32 bits).
inline uint64_t linkTag(uint64_t kind, uint32_t slot, uint32_t bits) {
  return eventTag(kind, (uint64_t{bits} << 32) | slot);
}

}  // namespace bps::transport
