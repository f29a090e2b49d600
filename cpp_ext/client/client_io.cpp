// The client's IO thread (see client.h): it owns every socket and all request state. Other threads only
// touch the submission queue and the HELLO results, each under its mutex.
#include <pthread.h>
#include <unistd.h>

#include <algorithm>
#include <cinttypes>
#include <cstdio>
#include <cstring>
#include <optional>

#include "client/client.h"
#include "transport/epoll_set.h"
#include "transport/zmq_fd.h"

#include <ATen/ops/empty.h>

namespace bps::client {

namespace {

// What an epoll event is about (epoll_set.h's kind), and its index: the server (low 32 bits) and, for a stream,
// which of the server's streams (its generation's low 24 bits: an event of a stream closed meanwhile must not act on
// the one opened after it, maybe on the same fd number).
enum EventKind : uint64_t { kWakeEvent = 0, kDealerEvent = 1, kMonitorEvent = 2, kStreamEvent = 3 };

uint64_t streamIndex(size_t server, uint64_t generation) {
  return ((generation & 0xffffff) << 32) | static_cast<uint32_t>(server);
}

}  // namespace

void Client::ioLoop() {
  // Named so that top -H, perf and /proc tell it from the completion threads and Python's.
  pthread_setname_np(pthread_self(), "bps-client-io");
  size_t n = links_.size();
  // Watched: the wake-up eventfd, per server its DEALER's and its monitor's signal fds (zmq_fd.h) and its stream.
  // Created inside the try (a failure stops the IO thread with a reason), kept past it: each stream leaves the set
  // as it closes below.
  std::optional<EpollSet> epoll;
  // Per server, what this wait reported: its DEALER or monitor readable, its stream's events (and generation).
  std::vector<char> dealerReady(n), monitorReady(n);
  std::vector<short> streamEvents(n);
  std::vector<uint64_t> streamGeneration(n);
  std::vector<char> streamWatched(n);
  bool first = true;  // nothing is known of the sockets before the first look
  try {
    epoll.emplace(1 + 3 * n);
    epoll->add(wakeFd_, eventTag(kWakeEvent, 0), "the wake-up eventfd");
    for (size_t i = 0; i < n; ++i) {
      epoll->add(links_[i]->socketFd(), eventTag(kDealerEvent, i), "a DEALER's signal fd");
      epoll->add(links_[i]->monitorFd(), eventTag(kMonitorEvent, i), "a monitor's signal fd");
    }
    for (;;) {
      // Streams: write what was queued since the last wait (one writev for a burst of requests), check their
      // opening deadlines, then watch those still open (POLLOUT only while connecting or while writes wait).
      for (size_t i = 0; i < n; ++i) {
        streamWatched[i] = false;
        if (!streams_[i]->active()) continue;
        stepStream(i, 0);
        if (!streams_[i]->active()) continue;
        uint64_t generation = streams_[i]->generation();
        if (!streams_[i]->watch(epoll->fd(), eventTag(kStreamEvent, streamIndex(i, generation)))) {
          throw Error(ErrorKind::kTransport, std::string("epoll_ctl failed on a stream: ") + std::strerror(errno));
        }
        streamWatched[i] = true;
        streamGeneration[i] = generation;
      }
      // A DEALER sent on since it was last read must be read before blocking (zmq_fd.h). And replies the stream
      // steps above read may have returned credit: a part it admits goes now, not after a wait that may have no
      // deadline left to end it.
      bool now = first || (!stopping_ && credit_.ready());
      for (size_t i = 0; i < n && !now; ++i) now = links_[i]->sentSinceRead();
      int count = std::max(0, epoll->wait(now ? 0 : pollTimeoutMs()));
      if (count > 0) ioWakeups_.fetch_add(1, std::memory_order_relaxed);
      std::fill(dealerReady.begin(), dealerReady.end(), 0);
      std::fill(monitorReady.begin(), monitorReady.end(), 0);
      std::fill(streamEvents.begin(), streamEvents.end(), 0);
      bool woken = false;
      for (int e = 0; e < count; ++e) {
        const epoll_event& event = epoll->events()[e];
        uint64_t index = eventIndex(event.data.u64);
        size_t server = static_cast<uint32_t>(index);
        switch (static_cast<EventKind>(eventKind(event.data.u64))) {
          case kWakeEvent:
            woken = true;
            break;
          case kDealerEvent:
            dealerReady[server] = 1;
            break;
          case kMonitorEvent:
            monitorReady[server] = 1;
            break;
          case kStreamEvent:
            // Closed and reopened since it was watched: not this stream's events.
            if (index == streamIndex(server, streamGeneration[server])) {
              streamEvents[server] = static_cast<short>(event.events);
            }
            break;
        }
      }
      if (woken) {
        uint64_t wakes;
        ssize_t got = ::read(wakeFd_, &wakes, sizeof(wakes));
        (void)got;
        {
          std::lock_guard<std::mutex> lock(submitMutex_);
          if (closing_) break;
        }
        takeSubmissions();
      }
      for (size_t i = 0; i < n; ++i) {
        // Replies first: those that arrived before a disconnect still count. Each read runs to EAGAIN.
        if (first || links_[i]->sentSinceRead() || dealerReady[i]) {
          for (;;) {
            LinkMessage message;
            if (!links_[i]->receive(message)) break;
            onReply(i, ReplyView{message.header.data(), message.header.size(), message.payload.data(),
                                 message.payload.size(), message.frames});
          }
        }
        if (!first && !monitorReady[i]) continue;
        LinkEvent event;
        while ((event = links_[i]->readMonitor()) != LinkEvent::kNothing) {
          if (event == LinkEvent::kDisconnected) onDisconnect(i);
          if (event == LinkEvent::kConnected) onReconnect(i);
        }
      }
      first = false;
      for (size_t i = 0; i < n; ++i) {
        // Closed above (a dropped link closes its stream), maybe reopened on the same fd number: not this one.
        if (streamWatched[i] && streams_[i]->active() && streams_[i]->generation() == streamGeneration[i]) {
          stepStream(i, streamEvents[i]);
        }
      }
      expireDeadlines();
      sendQueued();  // acknowledgements and failures above may have returned credit
    }
  } catch (const std::exception& e) {
    std::fprintf(stderr, "torch_bps: the client's IO thread stopped: %s\n", e.what());
    std::lock_guard<std::mutex> lock(submitMutex_);
    ioFailure_ = std::string("its IO thread stopped: ") + e.what();
  }
  failEverything(ioFailure_.empty() ? "the torch_bps client was closed"
                                    : "the torch_bps client failed (" + ioFailure_ + ")");
  for (auto& link : links_) link->close();
  for (size_t i = 0; i < n; ++i) closeStream(i, "the client was closed");
  {
    std::lock_guard<std::mutex> lock(stateMutex_);
    streamsOpening_ = 0;  // nobody waits for a stream after the IO thread is gone
    helloDone_.notify_all();
  }
  std::lock_guard<std::mutex> lock(abandonMutex_);
  abandonsDone_ = abandonsAsked_;  // nobody waits for an abandon() after the IO thread is gone
  abandonDone_.notify_all();
}

void Client::takeSubmissions() {
  std::vector<OpPtr> ops;
  std::vector<std::pair<size_t, std::string>> abandons;
  {
    std::lock_guard<std::mutex> lock(submitMutex_);
    ops.swap(submitted_);
    abandons.swap(abandons_);
  }
  if (!abandons.empty()) {
    for (auto& [server, why] : abandons) {
      markDown(server, why);
      linkStates_[server].abandoned = true;
      closeStream(server, "failed over");  // markDown did if the link was up; never reopened once abandoned
      failServer(server, "server " + links_[server]->address() + " was failed over (" + why + ")");
    }
    std::lock_guard<std::mutex> lock(abandonMutex_);
    abandonsDone_ += abandons.size();
    abandonDone_.notify_all();
  }
  for (auto& op : ops) {
    if (op->kind == kPush) trace_.mark(kTraceQueued, traceId(op.get()), op->key, 0, op->src.nbytes(), op->server);
    if (op->batch) {
      credit_.push(op->server, static_cast<int64_t>(op->src.nbytes()), op->priority, op);
    } else {
      start(op);
    }
  }
  sendQueued();
}

void Client::sendQueued() {
  while (!stopping_) {
    auto next = credit_.pop();
    if (!next) return;
    auto& [op, nbytes, server] = *next;
    op->credit = nbytes;
    start(op);  // a part that fails at once returns its credit before the next pop
  }
}

void Client::start(const OpPtr& op) {
  if (op->batch && !op->batch->error.ok() && !options_.failover) {
    op->error = {ErrorKind::kClosed, 0, "not sent: an earlier part of its batch failed"};
    finishOp(op);  // do not push the rest
    return;
  }
  if (op->kind != kHello && failIfDown(op)) return;
  if (op->kind != kPush) {
    op->stream = op->kind == kStats && streams_[op->server]->ready();  // a HELLO always goes on ZeroMQ
    sendRequest(op, op->kind, Clock::now() + op->timeout);
    return;
  }
  KeyState& key = keys_[op->key];
  if (key.busy) {
    key.waiting.push_back(op);
    return;
  }
  key.busy = true;
  op->holdsKey = true;
  op->stream = streams_[op->server]->ready();  // all of the op's requests on one connection, in order
  op->round = key.nextRound++;
  auto deadline = Clock::now() + op->timeout;
  // INIT, PUSH and PULL are pipelined: the server handles one peer's messages in order.
  if (!key.initSent) {
    key.initSent = true;
    if (!sendRequest(op, kInit, deadline)) return;
  }
  if (!sendRequest(op, kPush, deadline)) return;
  // Later than the server's own limit (waitMs), so that its answer, which names the workers that have not
  // pushed, arrives first.
  auto grace = std::max<Clock::duration>(std::chrono::seconds(2), op->timeout / 10);
  sendRequest(op, kPull, deadline + grace);
}

bool Client::sendRequest(const OpPtr& op, uint16_t command, Clock::time_point deadline) {
  Header h;
  h.command = command;
  h.dtype = op->dtype;
  h.worker = options_.worker;
  h.numWorkers = command == kHello ? options_.numWorkers : 0;
  // The server answers a PULL still waiting after the timeout itself, naming the workers that have not pushed;
  // our own deadline (a little later) covers a server that cannot answer at all.
  if (command == kPull) h.waitMs = static_cast<uint32_t>(std::min(options_.timeoutSeconds * 1000.0, 4e9));
  h.incarnation = command == kHello ? 0 : ioIncarnations_[op->server];
  h.jobId = options_.jobId;
  h.key = op->key;
  h.round = op->round;
  h.requestId = nextRequestId_++;
  h.nbytes = (command == kInit || command == kPush || command == kPull) ? op->nbytes : 0;
  h.mode = op->mode;
  if (command == kPush) {
    h.offset = op->pushOffset;
    h.length = op->src.nbytes();
  } else if (command == kPull) {
    h.offset = op->pullOffset;
    h.length = op->dst.nbytes();
  }
  ZmqLink& link = *links_[op->server];
  if (op->stream) {
    if (!sendOnStream(op, h, command)) return false;
  } else if (!link.send(h, command == kPush ? &op->src : nullptr)) {
    failOp(op, {ErrorKind::kTransport, 0,
                formatText("cannot send %s to server %s: %s (%s)", commandName(command), link.address().c_str(),
                       zmq_strerror(zmq_errno()), describe(*op).c_str())});
    return false;
  }
  if (command == kPush) trace_.mark(kTraceSent, traceId(op.get()), op->key, op->round, op->src.nbytes(), op->server);
  if (command == kPush && op->batch) {
    op->pushInFlight = true;
    int64_t inFlight = pushBytesInFlight_ += static_cast<int64_t>(op->src.nbytes());
    if (inFlight > peakPushBytesInFlight_) peakPushBytesInFlight_ = inFlight;  // only this thread writes it
    int64_t toServer = serverPushBytesInFlight_[op->server] += static_cast<int64_t>(op->src.nbytes());
    if (toServer > peakServerPushBytesInFlight_) peakServerPushBytesInFlight_ = toServer;
    ++partsSent_;
  }
  inflight_.emplace(h.requestId, Request{op, command, deadline});
  deadlines_.emplace(deadline, h.requestId);
  op->requests.push_back(h.requestId);
  return true;
}

void Client::onReply(size_t server, const ReplyView& message) {
  const ZmqLink& link = *links_[server];
  Header h;
  try {
    h = unpackHeader(message.header, message.headerSize);
  } catch (const Error& e) {
    // Nothing to fail: a header we cannot parse names no request.
    std::fprintf(stderr, "torch_bps: dropped a malformed reply from server %s: %s\n", link.address().c_str(), e.what());
    return;
  }
  auto it = inflight_.find(h.requestId);
  // Late replies (to requests failed by a deadline or a disconnect) are dropped here.
  if (it == inflight_.end() || it->second.op->server != server) return;
  OpPtr op = it->second.op;
  uint16_t command = it->second.command;
  forget(h.requestId);
  op->requests.erase(std::find(op->requests.begin(), op->requests.end(), h.requestId));

  if (h.command != (command | kReplyFlag) || h.jobId != options_.jobId || h.key != op->key || h.round != op->round) {
    failOp(op, {ErrorKind::kProtocol, kBadFrame,
                formatText("server %s answered %s with a reply that does not match it (command 0x%x, job 0x%016" PRIx64
                       ", key %" PRIu64 ", round %" PRIu64 "; %s)",
                       link.address().c_str(), commandName(command), h.command, h.jobId, h.key, h.round,
                       describe(*op).c_str())});
    return;
  }
  if (h.status != kOk) {
    std::string text(reinterpret_cast<const char*>(message.payload), message.payloadSize);
    if (text.empty()) text = "(no message)";
    failOp(op, {ErrorKind::kServer, h.status,
                text + formatText(" [%s from server %s to %s; %s]", statusName(h.status), link.address().c_str(),
                              commandName(command), describe(*op).c_str())});
    return;
  }
  if (command == kPush) {
    trace_.mark(kTraceAcked, traceId(op.get()), op->key, op->round, op->src.nbytes(), server);
    if (op->batch) ++partsAcknowledged_;
    pushEnded(op, true);
  }
  if (command == kHello && op->rehello) {
    onRehello(op, h.incarnation, h.length);
    return;
  }
  if (command == kHello) {
    ioIncarnations_[server] = h.incarnation;
    {
      std::lock_guard<std::mutex> lock(stateMutex_);
      incarnations_[server] = h.incarnation;
    }
    openStream(server, h.length, true);  // before finishOp: hello() then also waits for the stream
  } else if (command == kPull || command == kStats) {
    size_t expected = command == kPull ? op->dst.nbytes() : kStatsCounters * sizeof(uint64_t);
    size_t got = message.frames == 2 ? message.payloadSize : 0;
    if (message.frames != 2 || got != expected) {
      failOp(op, {ErrorKind::kProtocol, kBadFrame,
                  formatText("server %s answered %s with %zu frames and %zu payload bytes, expected 2 and %zu (%s)",
                         link.address().c_str(), commandName(command), message.frames, got, expected,
                         describe(*op).c_str())});
      return;
    }
    if (options_.failover && command == kPull && op->holdsKey) {
      // The round is complete for this worker: the server acknowledged its PUSH before it could answer the
      // PULL (one connection, in order). Keep what it may still owe the others: its whole result, else its
      // pushed bytes, taken before the copy below may overwrite them.
      bool whole = op->pullOffset == 0 && expected == op->nbytes;
      keepRound(*op, whole ? message.payload : op->src.data_ptr(), whole ? expected : op->src.nbytes(), whole);
    }
    // The one copy on the receive side: the received buffer -> the destination tensor (none when a stream read
    // the payload straight into it: Client::placePull).
    if (expected > 0 && message.payload != op->dst.data_ptr()) std::memcpy(op->dst.data_ptr(), message.payload, expected);
    if (command == kPull) trace_.mark(kTracePulled, traceId(op.get()), op->key, op->round, expected, server);
  }
  if (op->requests.empty()) finishOp(op);
}

void Client::expireDeadlines() {
  auto now = Clock::now();
  while (!deadlines_.empty() && deadlines_.begin()->first <= now) {
    const Request& request = inflight_.at(deadlines_.begin()->second);
    OpPtr op = request.op;
    uint16_t command = request.command;
    const std::string& address = links_[op->server]->address();
    double seconds = std::chrono::duration<double>(op->timeout).count();
    failOp(op, {ErrorKind::kTimeout, 0,
                formatText("%s timed out: no %s reply within %g s from server %s (%s)",
                       op->kind == kPush ? "push_pull" : commandName(op->kind), commandName(command), seconds,
                       address.c_str(), describe(*op).c_str())});
  }
}

int Client::pollTimeoutMs() const {
  bool any = !deadlines_.empty();
  Clock::time_point next = any ? deadlines_.begin()->first : Clock::time_point::max();
  for (const auto& stream : streams_) {
    if (stream->hasBuffered()) return 0;  // bytes read but not parsed: poll would not report them
    if (stream->opening()) {
      any = true;
      next = std::min(next, stream->deadline());
    }
  }
  if (!any) return -1;
  auto left = next - Clock::now();
  if (left <= Clock::duration::zero()) return 0;
  // Round up: waking a little late is fine, spinning on a not-yet-due deadline is not.
  return static_cast<int>(std::min<int64_t>(std::chrono::ceil<std::chrono::milliseconds>(left).count(), 1 << 30));
}

void Client::forget(uint64_t requestId) {
  auto it = inflight_.find(requestId);
  if (it == inflight_.end()) return;
  deadlines_.erase({it->second.deadline, requestId});
  inflight_.erase(it);
}

void Client::failOp(const OpPtr& op, ErrorInfo error) {
  if (op->done) return;
  if (op->kind == kPush) trace_.mark(kTraceFailed, traceId(op.get()), op->key, op->round, 0, op->server);
  // A reply being read into this op's destination right now must stop before the IO thread reads on.
  bool placing = op->kind == kPush && streams_[op->server]->placing() &&
                 std::find(op->requests.begin(), op->requests.end(), placingRequest_[op->server]) != op->requests.end();
  for (uint64_t id : op->requests) forget(id);
  op->requests.clear();
  op->error = std::move(error);
  finishOp(op);
  if (placing) stopPlacing(op->server, placingRequest_[op->server]);
}

void Client::pushEnded(const OpPtr& op, bool acknowledged) {
  if (op->pushInFlight) {
    op->pushInFlight = false;
    pushBytesInFlight_ -= static_cast<int64_t>(op->src.nbytes());
    serverPushBytesInFlight_[op->server] -= static_cast<int64_t>(op->src.nbytes());
  }
  // The credit comes back when the server has the push, not when the sum is back: a sum waits for the
  // other workers, whose clients may have picked other partitions first (priorities and timing differ per
  // worker), so holding credit until the pull would let workers wait on each other forever.
  if (op->credit != 0) {
    if (options_.autoCredit && acknowledged) {
      double now = std::chrono::duration<double>(Clock::now().time_since_epoch()).count();
      int64_t sized = creditSizer_.onAck(op->server, op->credit, now, credit_.queued() > 0);
      if (sized != 0) credit_.setCreditBytes(sized);
    }
    credit_.release(op->server, op->credit);
    op->credit = 0;  // exactly once: on the acknowledgement, or when the op ends without one
  }
  if (op->pushedToken != 0) {
    uint64_t token = op->pushedToken;
    op->pushedToken = 0;
    pool_.post([this, token] { onComplete_(token, ErrorInfo{}); });
  }
}

void Client::keepRound(const Op& op, const void* bytes, size_t nbytes, bool whole) {
  std::lock_guard<std::mutex> lock(keptMutex_);
  Kept& kept = kept_[op.key];
  ++kept.round.completed;
  kept.round.whole = whole;
  kept.round.pushOffset = op.pushOffset;
  if (!kept.bytes.defined() || static_cast<size_t>(kept.bytes.numel()) != nbytes) {
    kept.bytes = at::empty({static_cast<int64_t>(nbytes)}, at::kByte);
  }
  if (nbytes > 0) std::memcpy(kept.bytes.data_ptr(), bytes, nbytes);
}

void Client::endPart(const OpPtr& op) {
  Batch& batch = *op->batch;
  if (batch.outcomes.defined()) {
    uint8_t outcome = op->error.ok() ? kPartOk
                      : op->error.kind == ErrorKind::kTransport ? kPartServerLost
                      : op->error.kind == ErrorKind::kClosed && !batch.error.ok() && op->requests.empty() ? kPartNotRun
                                                                                                       : kPartFailed;
    batch.outcomes.data_ptr<uint8_t>()[op->partIndex] = outcome;
  }
  if (!op->error.ok() && batch.error.ok()) batch.error = op->error;
  batch.ended.push_back(op);
  if (--batch.remaining > 0) return;
  // One completion per batch. The parts (and their tensor references) die on the pool thread, after it ran;
  // moving them out of the batch also breaks the part -> batch -> part cycle.
  pool_.post([this, token = batch.token, error = batch.error, ended = std::move(batch.ended)] {
    onComplete_(token, error);
  });
}

void Client::finishOp(const OpPtr& op) {
  op->done = true;
  if (op->rehello) {
    // Ours, not a caller's: the link stays down. A server that is there but slow to answer is asked again (after
    // a stream dropped nothing else would ask: its ZeroMQ connection never went down); a lost connection asks
    // again when it comes back (onReconnect).
    if (op->error.kind == ErrorKind::kTimeout && !stopping_) onReconnect(op->server);
    return;
  }
  pushEnded(op, false);
  if (op->kind == kHello) {
    std::lock_guard<std::mutex> lock(stateMutex_);
    helloErrors_[op->server] = op->error;
    --helloPending_;
    helloDone_.notify_all();
    return;
  }
  if (op->holdsKey) {
    KeyState& key = keys_[op->key];
    key.busy = false;
    if (!stopping_ && !key.waiting.empty()) {
      OpPtr next = std::move(key.waiting.front());
      key.waiting.pop_front();
      start(next);
    }
  }
  if (op->batch) {
    endPart(op);
    return;
  }
  // The op (and its tensor references) dies on the pool thread, after its completion ran.
  pool_.post([this, op] { onComplete_(op->token, op->error); });
}

void Client::failEverything(const std::string& why) {
  stopping_ = true;  // finishing an op starts no waiting one any more
  std::vector<OpPtr> ops;
  {
    std::lock_guard<std::mutex> lock(submitMutex_);
    ops.swap(submitted_);
  }
  for (auto& op : credit_.drain()) ops.push_back(std::move(op));
  for (auto& entry : keys_) {
    for (auto& op : entry.second.waiting) ops.push_back(op);
    entry.second.waiting.clear();
  }
  for (auto& entry : inflight_) ops.push_back(entry.second.op);
  for (auto& op : ops) {
    if (op->done) continue;
    std::string pending = op->requests.empty()
                              ? std::string("before it was sent")
                              : formatText("before the %s reply from server %s",
                                       commandName(inflight_.at(op->requests.front()).command),
                                       links_[op->server]->address().c_str());
    failOp(op, {ioFailure_.empty() ? ErrorKind::kClosed : ErrorKind::kTransport, 0,
                formatText("%s %s (%s)", why.c_str(), pending.c_str(), describe(*op).c_str())});
  }
}

std::string Client::describe(const Op& op) const {
  if (op.kind != kPush) {
    return formatText("job 0x%016" PRIx64 ", worker %u of %u", options_.jobId, options_.worker, options_.numWorkers);
  }
  return formatText("job 0x%016" PRIx64 ", key %" PRIu64 ", round %" PRIu64 ", worker %u of %u", options_.jobId, op.key,
                op.round, options_.worker, options_.numWorkers);
}

}  // namespace bps::client
