// See stream_link.h.
#include "transport/stream_link.h"

#include <poll.h>
#include <zmq.h>

#include <cinttypes>
#include <cstdio>
#include <cstring>
#include <exception>

#include "common/errors.h"
#include "transport/wire.h"

namespace bps::transport {
namespace {

// Replies may be whole partitions (PULL), and the server is trusted as on ZeroMQ (whose client side has no
// bound either); this only stops a garbled length word from asking for an absurd allocation.
constexpr uint64_t kMaxReplyFrame = uint64_t{1} << 40;
// Messages taken per step: a burst of replies does not starve the other servers' sockets.
constexpr size_t kReadBatch = 64;

void releaseTensor(void* /*data*/, void* hint) { delete static_cast<at::Tensor*>(hint); }

std::string text(const Message& frame) { return std::string(reinterpret_cast<const char*>(frame.data()), frame.size()); }

}  // namespace

Message copyFrame(const void* data, size_t n) {
  Message m;
  zmq_msg_close(m.get());
  if (zmq_msg_init_size(m.get(), n) != 0) throw Error(ErrorKind::kTransport, "out of memory for a stream frame");
  if (n) std::memcpy(m.data(), data, n);
  return m;
}

Message tensorFrame(const at::Tensor& tensor) {
  Message m;
  size_t n = tensor.nbytes();
  if (n == 0) return m;
  auto* holder = new at::Tensor(tensor);
  zmq_msg_close(m.get());
  zmq_msg_init_data(m.get(), holder->data_ptr(), n, releaseTensor, holder);
  return m;
}

void StreamLink::setPlacement(StreamConn::Placement placement) {
  // Remember which request a placed payload belongs to: placing() names it.
  placement_ = [this, placement = std::move(placement)](const Message& head, uint64_t length, Message& into) {
    if (!placement(head, length, into)) return false;
    placingRequest_ = detail::load<uint64_t>(head.data(), 64);  // the header's request_id (wire.h)
    return true;
  };
}

std::string StreamLink::send(const Header& header, const at::Tensor* payload) {
  if (!ready()) return "its stream closed";  // after the op started on it: the op's earlier requests went with it
  uint8_t packed[kHeaderSize];
  packHeader(header, packed);
  std::vector<Message> frames;
  frames.push_back(copyFrame(packed, kHeaderSize));
  if (payload != nullptr) frames.push_back(tensorFrame(*payload));  // zero-copy, as on ZeroMQ
  queue(frames);
  return "";
}

void StreamLink::watch(EpollSet& epoll, uint64_t kind, uint32_t slot, LinkListener& listener) {
  // Write what was queued since the last wait (one writev for a burst of requests), check the opening deadline,
  // then watch the stream if still open (POLLOUT only while connecting or while writes wait).
  watched_ = false;
  signalled_ = 0;
  if (!active()) return;
  StreamStep step;
  this->step(0, step);
  report(step, listener);
  if (!active()) return;
  // The generation tells this stream's events from those of one closed meanwhile (maybe on the same fd number).
  if (!conn_->watch(epoll.fd(), static_cast<uint16_t>(pollEvents()),
                    linkTag(kind, slot, static_cast<uint32_t>(generation_ & 0xffffff)))) {
    throw Error(ErrorKind::kTransport, std::string("epoll_ctl failed on a stream: ") + std::strerror(errno));
  }
  watched_ = true;
  watchedGeneration_ = generation_;
}

void StreamLink::notify(uint32_t bits, uint32_t events) {
  if (watched_ && bits == (watchedGeneration_ & 0xffffff)) signalled_ = static_cast<short>(events);
}

void StreamLink::poll(LinkListener& listener) {
  // Closed since watch() (its server's connection dropped), maybe reopened on the same fd number: not this one.
  if (!watched_ || !active() || generation_ != watchedGeneration_) return;
  watched_ = false;
  StreamStep step;
  this->step(signalled_, step);
  signalled_ = 0;
  report(step, listener);
}

void StreamLink::report(StreamStep& step, LinkListener& listener) {
  for (auto& frames : step.replies) {
    Reply reply;
    reply.frames = frames.size();
    reply.header = frames[0].data();
    reply.headerSize = frames[0].size();
    if (frames.size() > 1) {
      reply.payload = frames[1].data();
      reply.payloadSize = frames[1].size();
    }
    listener.onReply(*this, reply);
  }
  if (step.becameReady) listener.onReady(*this);
  // Dropping once ready is the server's connection dropping: callers match "lost the connection (its stream
  // closed: ...)"; before, it only says why the stream never opened.
  if (step.closed) listener.onClosed(*this, step.wasReady ? "its stream closed: " + step.why : step.why, step.wasReady);
}

void StreamLink::abort(const std::string& why, LinkListener& listener) {
  close(why);
  listener.onClosed(*this, "its stream closed: " + why, true);
}

std::string StreamLink::open(const std::string& host, uint16_t port, int sendBufferBytes, int receiveBufferBytes,
                             const LinkCredentials& keys, Message hello, uint64_t helloId, uint64_t incarnation,
                             const std::string& localName, bool sharedMemory) {
  close("reopened");
  ++generation_;
  std::string why;
  int fd = localName.empty() ? -1 : connectLocalStream(localName, &why);  // not on this machine: TCP
  bool local = fd >= 0;
  if (!local) fd = connectStream(host, port, sendBufferBytes, receiveBufferBytes, &why);
  if (fd < 0) return why;
  conn_ = std::make_unique<StreamConn>(fd, kMaxReplyFrame);
  sharedSeen_ = 0;
  local_.store(local, std::memory_order_release);
  if (receiveBufferBytes > 0 && !local) conn_->lockedReceiveBuffer();
  if (local && sharedMemory) {
    std::string whyNot;
    std::unique_ptr<SharedRings> rings = SharedRings::create(&whyNot);
    if (rings) {
      conn_->share(std::move(rings), true);
    } else {
      std::fprintf(stderr, "torch_bps: the local stream to %s goes without shared memory (%s)\n", address().c_str(),
                   whyNot.c_str());
    }
  }
  conn_->setPlacement(placement_);
  state_ = StreamState::kConnecting;
  deadline_ = Clock::now() + kStreamOpenTimeout;
  port_ = port;
  hello_ = std::move(hello);
  helloId_ = helloId;
  incarnation_ = incarnation;
  // AUTH goes out as soon as the connection opens; the server reads nothing else before answering it.
  std::vector<std::string> auth = {kStreamGreeting};
  if (keys.usesToken()) {
    auth.insert(auth.end(), {"PLAIN", keys.identity, keys.token});
  } else {
    auth.push_back("NULL");
  }
  std::vector<Message> frames;
  for (const auto& s : auth) frames.push_back(copyFrame(s.data(), s.size()));
  queue(frames);
  return "";
}

short StreamLink::pollEvents() const {
  if (!conn_) return 0;
  if (state_ == StreamState::kConnecting || conn_->wantsWrite()) return POLLIN | POLLOUT;
  return POLLIN;
}

void StreamLink::queue(std::vector<Message>& frames) {
  if (!conn_) return;
  uint64_t bytes = 0;
  for (const auto& f : frames) bytes += f.size();
  bytesSent_.fetch_add(bytes, std::memory_order_relaxed);
  conn_->queue(frames);
  countShared();
}

void StreamLink::countShared() {
  uint64_t now = conn_->sharedBytes();
  sharedBytes_.fetch_add(now - sharedSeen_, std::memory_order_relaxed);
  sharedSeen_ = now;
}

void StreamLink::step(short revents, StreamStep& out) {
  if (!conn_) return;
  if (state_ == StreamState::kConnecting) {
    if (revents != 0) {
      std::string why = connectResult(conn_->fd());
      if (!why.empty()) return fail(formatText("cannot connect to its stream port %u: %s", port_, why.c_str()), out);
      state_ = StreamState::kAuthSent;
    }
  }
  if (state_ != StreamState::kConnecting) {
    bool writable = !conn_->writeBlocked() || (revents & (POLLOUT | POLLERR | POLLHUP));
    if (conn_->wantsWrite() && writable && !conn_->flush()) return fail(conn_->why(), out);
    if ((revents & (POLLIN | POLLERR | POLLHUP)) || conn_->hasBuffered()) {
      std::vector<std::vector<Message>> got;
      bool open;
      try {
        open = conn_->read(got, kReadBatch);
        countShared();
      } catch (const std::exception& e) {  // out of memory for a frame
        conn_->close(e.what());
        open = false;
      }
      for (auto& message : got) {
        take(message, out);
        if (!conn_) return;  // take() failed it
      }
      if (!open) return fail(conn_->why(), out);
      // Written at once: the HELLO queued by take() should not wait for the next poll.
      if (conn_->wantsWrite() && !conn_->writeBlocked() && !conn_->flush()) return fail(conn_->why(), out);
    }
  }
  if (opening() && Clock::now() >= deadline_) {
    fail(formatText("not ready within %lld s", static_cast<long long>(kStreamOpenTimeout.count())), out);
  }
}

void StreamLink::take(std::vector<Message>& message, StreamStep& out) {
  uint64_t bytes = 0;
  for (const auto& f : message) bytes += f.size();
  bytesReceived_.fetch_add(bytes, std::memory_order_relaxed);
  switch (state_) {
    case StreamState::kReady:
      out.replies.push_back(std::move(message));
      return;
    case StreamState::kAuthSent: {
      // A third frame: the server took our shared rings (only offered on a local stream).
      bool shared = message.size() == 3 && text(message[2]) == kStreamSharedAnswer;
      size_t frames = shared ? 3 : 2;
      if (message.size() != frames || text(message[0]) != kStreamGreeting || text(message[1]) != "200") {
        std::string said = message.empty() ? "" : text(message[0]).substr(0, 40);
        return fail(formatText("the server answered AUTH with %zu frames (%s...), not %s 200", message.size(),
                               said.c_str(), kStreamGreeting),
                    out);
      }
      if (shared) conn_->shareWrites();
      shared_.store(conn_->sharesWrites(), std::memory_order_release);
      std::vector<Message> hello;
      hello.push_back(std::move(hello_));
      queue(hello);
      state_ = StreamState::kHelloSent;
      return;
    }
    case StreamState::kHelloSent: {
      Header h;
      try {
        if (message.empty()) throw Error(ErrorKind::kProtocol, "an empty message");
        h = unpackHeader(message[0].data(), message[0].size());
      } catch (const Error& e) {
        return fail(std::string("a malformed HELLO reply: ") + e.what(), out);
      }
      if (h.command != (kHello | kReplyFlag) || h.requestId != helloId_) {
        return fail(formatText("the first reply is %s 0x%x to request %" PRIu64 ", not the HELLO's", commandName(h.command),
                               h.command, h.requestId),
                    out);
      }
      if (h.status != kOk) {
        std::string said = message.size() > 1 ? text(message[1]) : "";
        return fail(formatText("HELLO refused (%s: %s)", statusName(h.status), said.c_str()), out);
      }
      if (h.incarnation != incarnation_) {
        return fail(formatText("HELLO answered by incarnation 0x%016" PRIx64 ", not 0x%016" PRIx64, h.incarnation,
                               incarnation_),
                    out);
      }
      state_ = StreamState::kReady;
      ready_.store(true, std::memory_order_release);
      out.becameReady = true;
      return;
    }
    default:
      return;
  }
}

void StreamLink::fail(const std::string& why, StreamStep& out) {
  out.closed = true;
  out.wasReady = state_ == StreamState::kReady;
  const char* when = state_ == StreamState::kAuthSent    ? " (during AUTH: credentials refused?)"
                     : state_ == StreamState::kHelloSent ? " (during its HELLO)"
                                                         : "";
  out.why = why + when;
  close(why);
}

void StreamLink::close(const std::string& why) {
  if (conn_) conn_->close(why);
  conn_.reset();  // releases queued payloads (their tensors) now
  state_ = StreamState::kNone;
  ready_.store(false, std::memory_order_release);
  local_.store(false, std::memory_order_release);
  shared_.store(false, std::memory_order_release);
  hello_ = Message();
}

}  // namespace bps::transport
