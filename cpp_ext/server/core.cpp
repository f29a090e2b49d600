// ServerCore: the summation server's loop (see core.h).
#include "server/core.h"

#include <algorithm>
#include <cerrno>
#include <cmath>
#include <cstring>
#include <limits>
#include <utility>

#include "transport/epoll_set.h"
#include "transport/zmq_fd.h"

namespace bps::server {

namespace {

// Messages read from the ROUTER per wake-up before the monitor and ZAP sockets are looked at again.
constexpr int kBatch = 256;
// How often waiting pulls are checked against their deadlines (ROUND_TIMEOUT's accuracy).
constexpr double kExpireSeconds = 0.1;

[[noreturn]] void fail(const std::string& what) {
  throw Error(ErrorKind::kTransport, what + ": " + zmq_strerror(zmq_errno()));
}

Header replyTo(const Header& h, uint16_t status) {
  Header reply = h;
  reply.command = static_cast<uint16_t>(h.command | kReplyFlag);
  reply.status = status;
  if (status != kOk) reply.nbytes = 0;
  return reply;
}

std::string metadata(Message& frame, const char* property) {
  const char* value = zmq_msg_gets(frame.get(), property);
  return value ? value : "";
}

}  // namespace

ServerCore::ServerCore(uint64_t incarnation) : incarnation_(incarnation) {
  ctx_ = zmq_ctx_new();
  if (!ctx_) fail("zmq_ctx_new");
  router_ = zmq_socket(ctx_, ZMQ_ROUTER);
  if (!router_) fail("zmq_socket(ROUTER)");
  setOption(ZMQ_LINGER, int64_t{0});
  // Dropped connections, to name lost workers: a killed worker at once, a stopped one after the heartbeat timeout.
  std::string endpoint = formatText("inproc://bps-monitor-%p", static_cast<void*>(this));
  if (zmq_socket_monitor(router_, endpoint.c_str(), ZMQ_EVENT_DISCONNECTED) != 0) fail("zmq_socket_monitor");
  monitor_ = zmq_socket(ctx_, ZMQ_PAIR);
  int zero = 0;
  zmq_setsockopt(monitor_, ZMQ_LINGER, &zero, sizeof(zero));
  if (zmq_connect(monitor_, endpoint.c_str()) != 0) fail("connecting the monitor");
}

ServerCore::~ServerCore() { close(); }

void ServerCore::setOption(int option, int64_t value) {
  int rc;
  if (option == ZMQ_MAXMSGSIZE) {  // the one int64 option a server sets
    rc = zmq_setsockopt(router_, option, &value, sizeof(value));
    if (value > 0) streams_.setMaxFrameBytes(static_cast<uint64_t>(value));
  } else {
    int small = static_cast<int>(value);
    rc = zmq_setsockopt(router_, option, &small, sizeof(small));
  }
  if (rc != 0) fail(formatText("ROUTER option %d", option));
}

void ServerCore::setOption(int option, const std::string& value) {
  if (option == ZMQ_ZAP_DOMAIN) zapDomain_ = value;  // a stream's AUTH is asked of the ZAP handler in it too
  if (zmq_setsockopt(router_, option, value.data(), value.size()) != 0) fail(formatText("ROUTER option %d", option));
}

void ServerCore::enableZap() {
  zap_ = zmq_socket(ctx_, ZMQ_REP);
  int zero = 0;
  zmq_setsockopt(zap_, ZMQ_LINGER, &zero, sizeof(zero));
  if (zmq_bind(zap_, "inproc://zeromq.zap.01") != 0) fail("binding the ZAP handler");  // RFC 27's address
}

std::string ServerCore::bind(const std::string& endpoint) {
  if (zmq_bind(router_, endpoint.c_str()) != 0) fail("bind " + endpoint);
  char last[256];
  size_t size = sizeof(last);
  if (zmq_getsockopt(router_, ZMQ_LAST_ENDPOINT, last, &size) != 0) fail("ZMQ_LAST_ENDPOINT");
  return std::string(last);
}

uint16_t ServerCore::listenStream(const std::string& host, int receiveBufferBytes) {
  uint16_t port = streams_.listen(host, receiveBufferBytes);
  streams_.listenLocal(localStreamName(incarnation_));  // EADDRINUSE: another holds the name (not ours): TCP only
  return port;
}

void ServerCore::run(ControlPlane& control, double tickSeconds) {
  // The monitor first: a disconnect must be seen before a message from a new connection that reuses its fd
  // number (its HELLO would otherwise be recorded, then dropped with the old connection). Then the ZAP
  // socket (without authentication, none), the ROUTER, the streams. ZeroMQ's sockets are polled through their
  // signal fds (zmq_fd.h): read when signalled, and the ROUTER again after anything was sent on it.
  const int monitorFd = zmqSignalFd(monitor_, "the server's monitor");
  const int zapFd = zap_ ? zmqSignalFd(zap_, "the server's ZAP handler") : -1;
  const int routerFd = zmqSignalFd(router_, "the server's ROUTER");
  // Closed after close() below: the streams leave the set as they close.
  EpollSet epoll(256);
  enum : uint64_t { kMonitorEvent = 0, kZapEvent = 1, kRouterEvent = 2 };  // below ServerStreams' kinds
  epoll.add(monitorFd, eventTag(kMonitorEvent, 0), "the server's monitor");
  if (zapFd >= 0) epoll.add(zapFd, eventTag(kZapEvent, 0), "the server's ZAP handler");
  epoll.add(routerFd, eventTag(kRouterEvent, 0), "the server's ROUTER");
  std::vector<Message> frames;
  frames.reserve(4);
  auto admit = [&](StreamPeer& peer, std::vector<Message>& auth) { return admitStream(peer, auth, control); };
  auto deliver = [&](StreamPeer& peer, std::vector<Message>& request) {
    handle(request, control, &peer);
    ++counters_.requests;
  };
  auto closed = [&](const StreamPeer& peer) { control.onDisconnect(peer.fd); };
  double now = monotonicSeconds();
  double nextTick = now + tickSeconds, nextExpire = now + kExpireSeconds;
  bool readRouter = true, readMonitor = true, readZap = zap_ != nullptr;  // unknown before the first look
  try {
    for (;;) {
      streams_.watch(epoll);
      double wait = std::min(nextTick, nextExpire) - monotonicSeconds();
      bool noWait = streams_.hasBuffered() || readRouter || routerSent_ || readMonitor || readZap;
      int timeoutMs = noWait ? 0 : wait > 0 ? static_cast<int>(std::min(wait * 1000, 1e9)) + 1 : 0;
      int ready = epoll.wait(timeoutMs);
      if (ready < 0) {
        nextTick = 0;  // a signal: let the control plane look at it now (its handler may have asked to stop)
        ready = 0;
      }
      for (int e = 0; e < ready; ++e) {
        uint64_t kind = eventKind(epoll.events()[e].data.u64);
        readMonitor |= kind == kMonitorEvent;
        readZap |= kind == kZapEvent;
        readRouter |= kind == kRouterEvent;
      }
      if (readMonitor) drainMonitor(control);  // each reads until EAGAIN
      if (readZap) serveZap(control);
      readMonitor = readZap = false;
      int64_t woke = trace_.on() ? realtimeNs() : 0;
      uint64_t before = counters_.requests;
      // Also after a send: it may have taken the signal of a request that arrived meanwhile.
      if (readRouter || routerSent_) {
        int read = 0;
        while (read < kBatch && receive(frames)) {  // its EAGAIN clears routerSent_
          handle(frames, control, nullptr);
          ++counters_.requests;
          ++read;
        }
        readRouter = read == kBatch;  // more may wait: look again without blocking
      }
      streams_.serve(epoll.events(), ready, monotonicSeconds(), admit, deliver, closed);
      uint64_t read = counters_.requests - before;
      if (read > 0) {
        ++counters_.wakeups;
        if (trace_.on()) {
          trace_.record(TraceEvent{woke, realtimeNs() - woke, 0, jobs_.keysWaiting(), 0, read, 0, kTraceWake});
        }
      }
      now = monotonicSeconds();
      if (now >= nextExpire) {
        answer(jobs_.expire(now));
        streams_.expire(now, closed);
        nextExpire = now + kExpireSeconds;
      }
      if (now >= nextTick) {
        nextTick = now + tickSeconds;
        if (!control.tick()) break;
      }
    }
  } catch (...) {
    close();
    throw;
  }
  close();
}

void ServerCore::close() {
  streams_.closeAll();
  if (router_) {
    zmq_socket_monitor(router_, nullptr, 0);
    zmq_close(router_);
    router_ = nullptr;
  }
  if (monitor_) zmq_close(monitor_);
  if (zap_) zmq_close(zap_);
  monitor_ = zap_ = nullptr;
  if (ctx_) zmq_ctx_term(ctx_);
  ctx_ = nullptr;
}

bool ServerCore::receive(std::vector<Message>& frames) {
  frames.clear();
  for (;;) {
    Message m;
    if (zmq_msg_recv(m.get(), router_, frames.empty() ? ZMQ_DONTWAIT : 0) < 0) {
      if (frames.empty()) {  // nothing waiting (EAGAIN), or a signal
        routerSent_ = false;  // that recv processed the ROUTER's commands: its fd signals what comes next
        return false;
      }
      fail("receiving a message's next frame");
    }
    bool more = zmq_msg_more(m.get());
    frames.push_back(std::move(m));
    if (!more) return true;
  }
}

void ServerCore::handle(std::vector<Message>& frames, ControlPlane& control, const StreamPeer* stream) {
  // frames[0] is the peer's identity. A ROUTER peer claiming a stream's would have its replies sent there.
  if (!stream && isStreamIdentity(frames[0].data(), frames[0].size())) return;
  // The hot path: PUSH (header + payload) or PULL (header).
  if ((frames.size() == 2 || frames.size() == 3) && frames[1].size() == kHeaderSize) {
    const uint8_t* head = frames[1].data();
    uint16_t command = detail::load<uint16_t>(head, 6);
    if (detail::load<uint32_t>(head, 0) == kMagic && detail::load<uint16_t>(head, 4) == kVersion &&
        ((command == kPush && frames.size() == 3) || (command == kPull && frames.size() == 2))) {
      Header h = unpackHeader(head, kHeaderSize);  // checked above: cannot throw
      std::string userId = stream ? stream->userId : zap_ ? metadata(frames[1], "User-Id") : std::string();
      if (handleNatively(frames, h, userId)) return;
    }
  }
  toControlPlane(frames, control, stream);
}

bool ServerCore::admitStream(StreamPeer& peer, std::vector<Message>& auth, ControlPlane& control) {
  auto text = [&](size_t i) { return std::string(reinterpret_cast<const char*>(auth[i].data()), auth[i].size()); };
  if (auth.size() < 2 || text(0) != kStreamGreeting) return false;
  std::string mechanism = text(1);
  if (!zap_) {
    peer.userId.clear();
    return mechanism == "NULL" && auth.size() == 2;
  }
  if (mechanism != "PLAIN") return false;
  // The ZAP handler's question for a ZeroMQ connection (RFC 27), asked of the same handler.
  std::vector<std::string> request = {"1.0", "stream", zapDomain_, peer.address, "", mechanism};
  for (size_t i = 2; i < auth.size(); ++i) request.push_back(text(i));
  std::vector<std::string> reply = control.onZap(request);
  if (reply.size() < 5 || reply[2] != "200" || reply[4].empty()) return false;
  peer.userId = reply[4];
  return true;
}

void ServerCore::deliver(const std::string& peer, std::vector<Message>& frames) {
  if (isStreamIdentity(peer.data(), peer.size())) {
    streams_.send(peer, frames);  // a closed stream's replies are dropped, as a vanished ROUTER peer's
    return;
  }
  // ROUTER_MANDATORY is off: a reply to a vanished peer is dropped, never blocks.
  Message identity = Message::copyOf(peer.data(), peer.size());
  routerSent_ = true;
  zmq_msg_send(identity.get(), router_, ZMQ_SNDMORE | ZMQ_DONTWAIT);
  for (size_t i = 0; i < frames.size(); ++i) {
    zmq_msg_send(frames[i].get(), router_, (i + 1 < frames.size() ? ZMQ_SNDMORE : 0) | ZMQ_DONTWAIT);
  }
}

bool ServerCore::handleNatively(std::vector<Message>& frames, const Header& h, const std::string& userId) {
  // Any check failing here: the control plane answers, with keys.py's and auth.py's words.
  if (h.incarnation != incarnation_) return false;
  bool push = h.command == kPush;
  Job* job = nullptr;
  KeyState* found = nullptr;
  if (!jobs_.admit(h, userId, push ? frames[2].size() : 0, &job, &found)) return false;
  KeyState& key = *found;

  double now = monotonicSeconds();
  Job& j = *job;
  jobs_.ran(h.jobId, j, h.worker, now);
  std::string peer(reinterpret_cast<const char*>(frames[0].data()), frames[0].size());
  // The job's share of what this request adds to the server's counters (errors: countError).
  JobCounters& mine = j.counters;
  uint64_t outBefore = counters_.bytesOut;
  try {
    if (push) {
      ++counters_.pushes;
      ++mine.pushes;
      counters_.bytesIn += h.length;
      mine.bytesIn += h.length;
      uint64_t summedBefore = counters_.sums.bytesSummed, nsBefore = counters_.sums.sumNs;
      uint64_t lateBefore = counters_.sums.latePushes;
      int64_t start = trace_.on() ? realtimeNs() : 0;
      std::vector<Answer> ready = key.rounds.push(h.worker, h.round, std::move(frames[2]), h.offset);
      uint64_t summed = counters_.sums.bytesSummed - summedBefore, ns = counters_.sums.sumNs - nsBefore;
      mine.latePushes += counters_.sums.latePushes - lateBefore;
      if (summed != 0) {
        ++counters_.sumCount;
        ++mine.sums;
        mine.bytesSummed += summed;
        mine.sumNs += ns;
      }
      if (trace_.on()) {
        int64_t took = summed != 0 ? static_cast<int64_t>(ns) : realtimeNs() - start;
        trace_.record(TraceEvent{start, took, h.jobId, h.key, h.round, h.length, h.worker,
                                 summed != 0 ? kTraceSum : kTraceStore});
      }
      sendReply(peer, replyTo(h, kOk), nullptr);
      answer(std::move(ready));
    } else {
      ++counters_.pulls;
      ++mine.pulls;
      double deadline = h.waitMs ? now + h.waitMs / 1000.0 : std::numeric_limits<double>::infinity();
      Answer result;
      if (key.rounds.pull(Pull{peer, h}, deadline, &result)) answerOne(result);
    }
  } catch (const RoundError& e) {
    replyError(peer, h, e.status, e.message);
  } catch (const std::exception& e) {  // a bug: answer it, keep serving everyone else
    replyError(peer, h, kInternal, std::string("native server core: ") + e.what());
  }
  answer(key.rounds.takeReleased());  // freeing a round may have moved a backup job's window
  mine.bytesOut += counters_.bytesOut - outBefore;  // this job's pulls answered, by this push or at once
  jobs_.track(key.rounds);
  return true;
}

void ServerCore::toControlPlane(std::vector<Message>& frames, ControlPlane& control, const StreamPeer* stream) {
  drainMonitor(control);  // this message's connection may reuse the fd number of one that just dropped
  RequestMeta meta;
  if (stream) {
    meta.fd = stream->fd;
    meta.peerAddress = stream->address;
    meta.userId = stream->userId;
  } else {
    Message& head = frames.size() > 1 ? frames[1] : frames[0];
    meta.fd = zmq_msg_get(head.get(), ZMQ_SRCFD);
    meta.peerAddress = metadata(head, "Peer-Address");
    meta.userId = zap_ ? metadata(head, "User-Id") : "";
  }
  std::vector<std::string> strings;
  strings.reserve(frames.size());
  for (auto& f : frames) strings.emplace_back(reinterpret_cast<const char*>(f.data()), f.size());
  std::vector<std::string> reply = control.onRequest(strings, meta);
  if (reply.size() < 2) return;
  std::vector<Message> out;
  for (const auto& f : reply) out.push_back(Message::copyOf(f.data(), f.size()));
  // A reply in another version's framing (BAD_VERSION, wire.h kVersionedPrefix) still counts as an error.
  if (out.size() > 2 && out[1].size() >= kVersionedPrefix) {
    bool ours = out[1].size() == kHeaderSize;
    uint16_t status = detail::load<uint16_t>(out[1].data(), 8);
    uint16_t command = detail::load<uint16_t>(out[1].data(), 6);
    if (status != kOk) {
      countError(ours ? detail::load<uint64_t>(out[1].data(), 40) : 0);  // the reply's job_id
    } else if (ours && command == (kPull | kReplyFlag)) {
      counters_.bytesOut += out[2].size();
    }
  }
  std::string peer(reinterpret_cast<const char*>(out[0].data()), out[0].size());
  out.erase(out.begin());
  deliver(peer, out);
}

void ServerCore::drainMonitor(ControlPlane& control) {
  for (;;) {
    Message event;
    if (zmq_msg_recv(event.get(), monitor_, ZMQ_DONTWAIT) < 0) return;
    uint16_t kind = 0;
    uint32_t fd = 0;
    if (event.size() >= 6) {
      kind = detail::load<uint16_t>(event.data(), 0);
      fd = detail::load<uint32_t>(event.data(), 2);
    }
    while (zmq_msg_more(event.get())) {  // the endpoint's address: not needed
      Message rest;
      if (zmq_msg_recv(rest.get(), monitor_, 0) < 0) break;
      event = std::move(rest);
    }
    if (kind == ZMQ_EVENT_DISCONNECTED) control.onDisconnect(static_cast<int>(fd));
  }
}

void ServerCore::serveZap(ControlPlane& control) {
  for (;;) {
    std::vector<std::string> request;
    for (bool more = true; more;) {
      Message m;
      if (zmq_msg_recv(m.get(), zap_, request.empty() ? ZMQ_DONTWAIT : 0) < 0) {
        if (request.empty()) return;
        fail("receiving a ZAP request");
      }
      more = zmq_msg_more(m.get());
      request.emplace_back(reinterpret_cast<const char*>(m.data()), m.size());
    }
    std::vector<std::string> reply = control.onZap(request);
    for (size_t i = 0; i < reply.size(); ++i) {
      zmq_send(zap_, reply[i].data(), reply[i].size(), i + 1 < reply.size() ? ZMQ_SNDMORE : 0);
    }
  }
}

void ServerCore::answer(std::vector<Answer>&& answers) {
  for (auto& a : answers) answerOne(a);
}

void ServerCore::answerOne(Answer& a) {
  if (a.status == kOk) {
    sendReply(a.pull.peer, replyTo(a.pull.header, kOk), &a.data);
  } else {
    replyError(a.pull.peer, a.pull.header, a.status, a.message);
  }
}

void ServerCore::replyError(const std::string& peer, const Header& h, uint16_t status, const std::string& message) {
  Message text = Message::copyOf(message.data(), message.size());
  sendReply(peer, replyTo(h, status), &text);
}

void ServerCore::sendReply(const std::string& peer, const Header& reply, Message* payload) {
  if (payload) {
    if (reply.status != kOk) {
      countError(reply.jobId);
    } else {
      counters_.bytesOut += payload->size();  // only PULL results carry a payload with status OK here
    }
  }
  std::vector<Message> frames;
  frames.reserve(2);
  frames.push_back(Message::ofSize(kHeaderSize));
  packHeader(reply, frames[0].data());
  if (payload) frames.push_back(std::move(*payload));
  deliver(peer, frames);
}

void ServerCore::countError(uint64_t jobId) {
  ++counters_.errors;
  Job* job = jobs_.find(jobId);  // errors are rare: the lookup stays off the hot path
  if (job != nullptr) ++job->counters.errors;
}

void ServerCore::workerLost(uint64_t jobId, uint32_t worker, const std::string& how) {
  answer(jobs_.workerLost(jobId, worker, how));
}

void ServerCore::refuse(uint64_t jobId, uint64_t key, uint32_t worker, uint64_t round, const std::string& reason) {
  answer(jobs_.refuse(jobId, key, worker, round, reason));
}

void ServerCore::forgetJob(uint64_t jobId, const std::string& message) { answer(jobs_.forgetJob(jobId, message)); }

}  // namespace bps::server
