// The IO thread's loop, and sending and matching requests (see dispatcher.h).
#include "client/dispatcher.h"

#include <pthread.h>

#include <algorithm>
#include <cinttypes>
#include <cstdio>
#include <cstring>
#include <optional>

namespace bps::client {

using transport::Header;
using transport::kHello;
using transport::kInit;
using transport::kPull;
using transport::kPush;
using transport::kReplyFlag;
using transport::kStats;

namespace {

// What an epoll event is about (epoll_set.h's kind): the wake-up eventfd, or a link (its index in
// ServerLinks::all() in the low 32 bits, the link's own bits above).
enum EventKind : uint64_t { kWakeEvent = 0, kLinkEvent = 1 };

}  // namespace

Dispatcher::Dispatcher(const ClientOptions& options, Clock::duration timeout, void* context, const void* owner,
                       Submissions& submissions, HelloWait& hello, KeptRounds& kept, CompletionPool& pool,
                       const CompletionHandler& onComplete, const LinkDownHandler& onLinkDown)
    : options_(options),
      timeout_(timeout),
      submissions_(submissions),
      hello_(hello),
      kept_(kept),
      pool_(pool),
      onComplete_(onComplete),
      onLinkDown_(onLinkDown),
      links_(options, context, owner,
             [this](size_t server) {
               return [this, server](const transport::Message& head, uint64_t length, transport::Message& into) {
                 return requests_.placePull(server, head, length, options_.failover, into);
               };
             }),
      scheduler_(options, options.servers.size()) {}

void Dispatcher::run() {
  // Named so that top -H, perf and /proc tell it from the completion threads and Python's.
  pthread_setname_np(pthread_self(), "bps-client-io");
  const std::vector<Link*>& links = links_.all();
  // Created inside the try (a failure stops the IO thread with a reason), kept past it: a stream leaves the set
  // as it closes below.
  std::optional<transport::EpollSet> epoll;
  bool first = true;  // nothing is known of the links before the first look
  try {
    epoll.emplace(1 + 3 * links_.size());
    epoll->add(submissions_.wakeFd(), transport::eventTag(kWakeEvent, 0), "the wake-up eventfd");
    for (;;) {
      for (uint32_t i = 0; i < links.size(); ++i) links[i]->watch(*epoll, kLinkEvent, i, *this);
      // Replies the links read in watch() may have returned credit: a part it admits goes now, not after a wait
      // that may have no deadline left to end it.
      bool now = first || (!stopping_ && scheduler_.ready());
      for (size_t i = 0; i < links.size() && !now; ++i) now = links[i]->mustPoll();
      int count = std::max(0, epoll->wait(now ? 0 : pollTimeoutMs()));
      if (count > 0) scheduler_.countWakeup();
      bool woken = false;
      for (int e = 0; e < count; ++e) {
        const epoll_event& event = epoll->events()[e];
        uint64_t index = transport::eventIndex(event.data.u64);
        if (transport::eventKind(event.data.u64) == kWakeEvent) {
          woken = true;
        } else {
          links[static_cast<uint32_t>(index)]->notify(static_cast<uint32_t>(index >> 32), event.events);
        }
      }
      if (woken) {
        submissions_.clearWake();
        if (submissions_.closing()) break;
        takeSubmissions();
      }
      for (Link* link : links) link->poll(*this);
      first = false;
      expireDeadlines();
      sendQueued();  // acknowledgements and failures above may have returned credit
    }
  } catch (const std::exception& e) {
    std::fprintf(stderr, "torch_bps: the client's IO thread stopped: %s\n", e.what());
    submissions_.fail(std::string("its IO thread stopped: ") + e.what());
  }
  std::string failure = submissions_.failure();
  failEverything(failure.empty() ? "the torch_bps client was closed" : "the torch_bps client failed (" + failure + ")");
  for (Link* link : links) link->close("the client was closed");
  for (size_t i = 0; i < links_.size(); ++i) settle(i);
  hello_.stopped();  // nobody waits for a stream after the IO thread is gone
  submissions_.stopped();  // nor for an abandon()
}

void Dispatcher::takeSubmissions() {
  std::vector<OpPtr> ops;
  std::vector<std::pair<size_t, std::string>> abandons;
  submissions_.take(ops, abandons);
  if (!abandons.empty()) {
    for (auto& [server, why] : abandons) abandon(server, why);
    submissions_.abandonsDone(abandons.size());
  }
  for (auto& op : ops) {
    if (op->kind == kPush) trace_.mark(kTraceQueued, traceId(op.get()), op->key, 0, op->src.nbytes(), op->server);
    if (op->batch) {
      scheduler_.queue(op);
    } else {
      start(op);
    }
  }
  sendQueued();
}

void Dispatcher::sendQueued() {
  while (!stopping_) {
    OpPtr op = scheduler_.admit();
    if (!op) return;
    start(op);  // a part that fails at once returns its credit before the next admit
  }
}

void Dispatcher::start(const OpPtr& op) {
  if (op->batch && batchFailed(*op->batch)) {
    op->error = {ErrorKind::kClosed, 0, "not sent: an earlier part of its batch failed"};
    finishOp(op);  // do not push the rest
    return;
  }
  if (op->kind != kHello && failIfDown(op)) return;
  if (op->kind != kPush) {
    op->link = links_.route(op->server, op->kind);
    sendRequest(op, op->kind, Clock::now() + op->timeout);
    return;
  }
  bool init = false;
  if (!scheduler_.takeKey(op, &init)) return;  // it waits for the key's round in flight
  op->link = links_.route(op->server, op->kind);  // all of the op's requests on one link, in order
  auto deadline = Clock::now() + op->timeout;
  // INIT, PUSH and PULL are pipelined: the server handles one peer's messages in order.
  if (init && !sendRequest(op, kInit, deadline)) return;
  // A SUM part with nothing to push only pulls: a worker catching up on rounds that closed without it.
  bool pullOnly = op->mode == transport::kModeSum && op->src.nbytes() == 0 && op->nbytes > 0;
  if (!pullOnly && !sendRequest(op, kPush, deadline)) return;
  // Later than the server's own limit (waitMs), so that its answer, which names the workers that have not
  // pushed, arrives first.
  auto grace = std::max<Clock::duration>(std::chrono::seconds(2), op->timeout / 10);
  sendRequest(op, kPull, deadline + grace);
}

bool Dispatcher::sendRequest(const OpPtr& op, uint16_t command, Clock::time_point deadline) {
  Header h;
  h.command = command;
  h.dtype = op->dtype;
  h.worker = options_.worker;
  if (command == kHello) {  // the control block: the job this worker belongs to
    h.numWorkers = options_.numWorkers;
    h.backups = options_.backups;
    h.window = options_.window;
    h.staleness = options_.staleness;
  } else {
    h.codec = op->codec;  // a compressed key's codec word
    h.mode = op->mode;
    h.round = op->round;
  }
  // The server answers a PULL still waiting after the timeout itself, naming the workers that have not pushed;
  // our own deadline (a little later) covers a server that cannot answer at all.
  if (command == kPull) h.waitMs = static_cast<uint32_t>(std::min(options_.timeoutSeconds * 1000.0, 4e9));
  h.incarnation = command == kHello ? 0 : links_.incarnation(op->server);
  h.jobId = options_.jobId;
  h.key = op->key;
  h.requestId = requests_.nextId();
  h.nbytes = (command == kInit || command == kPush || command == kPull) ? op->nbytes : 0;
  if (command == kInit && op->codec) h.denseBytes = op->denseBytes;
  if (command == kPush) {
    h.offset = op->pushOffset;
    h.length = op->src.nbytes();
  } else if (command == kPull) {
    h.offset = op->pullOffset;
    h.length = op->dst.nbytes();
  }
  Link& link = *op->link;
  std::string why = link.send(h, command == kPush ? &op->src : nullptr);
  if (!why.empty()) {
    failOp(op, {ErrorKind::kTransport, 0,
                formatText("cannot send %s to server %s: %s (%s)", transport::commandName(command),
                           link.address().c_str(), why.c_str(), describe(*op).c_str())});
    return false;
  }
  if (command == kPush) trace_.mark(kTraceSent, traceId(op.get()), op->key, op->round, op->src.nbytes(), op->server);
  if (command == kPush && op->batch) scheduler_.pushSent(*op);
  requests_.add(h.requestId, Request{op, command, deadline});
  op->requests.push_back(h.requestId);
  return true;
}

void Dispatcher::onReply(Link& link, const transport::Reply& reply) { onReply(link.server(), reply); }

void Dispatcher::onReply(size_t server, const transport::Reply& message) {
  const std::string& address = links_.address(server);
  Header h;
  try {
    h = transport::unpackHeader(message.header, message.headerSize);
  } catch (const Error& e) {
    if (e.info().status == transport::kBadVersion) {
      // A server of another protocol version (it may not have parsed our request either, so the reply need not
      // name it): nothing it says can be read, so every request to it fails now, naming both versions.
      failVersion(server, e.what(), message);
      return;
    }
    // Nothing to fail: a header we cannot parse names no request.
    std::fprintf(stderr, "torch_bps: dropped a malformed reply from server %s: %s\n", address.c_str(), e.what());
    return;
  }
  const Request* request = requests_.find(h.requestId);
  // Late replies (to requests failed by a deadline or a disconnect) are dropped here.
  if (request == nullptr || request->op->server != server) return;
  OpPtr op = request->op;
  uint16_t command = request->command;
  requests_.forget(h.requestId);
  op->requests.erase(std::find(op->requests.begin(), op->requests.end(), h.requestId));
  const char* asked = transport::commandName(command);

  uint64_t round = command == kHello ? 0 : op->round;  // as sendRequest wrote it
  if (h.command != (command | kReplyFlag) || h.jobId != options_.jobId || h.key != op->key || h.round != round) {
    failOp(op, {ErrorKind::kProtocol, transport::kBadFrame,
                formatText("server %s answered %s with a reply that does not match it (command 0x%x, job 0x%016" PRIx64
                           ", key %" PRIu64 ", round %" PRIu64 "; %s)",
                           address.c_str(), asked, h.command, h.jobId, h.key, h.round, describe(*op).c_str())});
    return;
  }
  if (h.status != transport::kOk) {
    std::string text(reinterpret_cast<const char*>(message.payload), message.payloadSize);
    if (text.empty()) text = "(no message)";
    text += formatText(" [%s from server %s to %s; %s]", transport::statusName(h.status), address.c_str(), asked,
                       describe(*op).c_str());
    // A worker lost after another server of the job went down: that loss came first and most likely took the
    // worker with it (it fails, and a colocated server dies with its machine), so it is the error. Not with
    // failover, where workers outlive a dedicated server and a transport error would fail over this one.
    std::string earlier =
        h.status == transport::kWorkerLost && !options_.failover ? links_.earlierLoss(server) : std::string();
    if (!earlier.empty()) {
      failOp(op, {ErrorKind::kTransport, 0, text + earlier});
      return;
    }
    failOp(op, {ErrorKind::kServer, h.status, text});
    return;
  }
  if (command == kPush) {
    trace_.mark(kTraceAcked, traceId(op.get()), op->key, op->round, op->src.nbytes(), server);
    if (op->batch) scheduler_.pushAcknowledged();
    pushEnded(op, true);
  }
  if (command == kHello && op->rehello) {
    onRehello(op, h.incarnation, h.stream);
    return;
  }
  if (command == kHello) {
    links_.setIncarnation(server, h.incarnation);
    hello_.setIncarnation(server, h.incarnation);
    openStream(server, h.stream, true);  // before finishOp: hello() then also waits for the stream
  } else if (command == kPull || command == kStats) {
    size_t expected = command == kPull ? op->dst.nbytes() : transport::kStatsCounters * sizeof(uint64_t);
    size_t got = message.frames == 2 ? message.payloadSize : 0;
    if (message.frames != 2 || got != expected) {
      failOp(op, {ErrorKind::kProtocol, transport::kBadFrame,
                  formatText("server %s answered %s with %zu frames and %zu payload bytes, expected 2 and %zu (%s)",
                             address.c_str(), asked, message.frames, got, expected, describe(*op).c_str())});
      return;
    }
    if (options_.failover && command == kPull && op->holdsKey) {
      // The round is complete for this worker: the server acknowledged its PUSH before it could answer the
      // PULL (one connection, in order). Keep what it may still owe the others: its whole result, else its
      // pushed bytes, taken before the copy below may overwrite them.
      bool whole = op->pullOffset == 0 && expected == op->nbytes;
      kept_.keep(op->key, op->pushOffset, whole ? message.payload : op->src.data_ptr(),
                 whole ? expected : op->src.nbytes(), whole);
    }
    // The one copy on the receive side: the received buffer -> the destination tensor (none when a link read
    // the payload straight into it: Requests::placePull).
    if (expected > 0 && message.payload != op->dst.data_ptr()) std::memcpy(op->dst.data_ptr(), message.payload, expected);
    if (command == kPull) {
      trace_.mark(kTracePulled, traceId(op.get()), op->key, op->round, expected, server);
      uint32_t seen = behind_.load(std::memory_order_relaxed);
      while (h.behind > seen && !behind_.compare_exchange_weak(seen, h.behind, std::memory_order_relaxed)) {
      }
    }
  }
  if (op->requests.empty()) finishOp(op);
}

void Dispatcher::failVersion(size_t server, const std::string& why, const transport::Reply& message) {
  std::string said(reinterpret_cast<const char*>(message.payload), message.frames == 2 ? message.payloadSize : 0);
  if (said.size() > 200) said.resize(200);
  std::vector<OpPtr> lost;
  for (auto& entry : requests_.all()) {
    if (entry.second.op->server == server) lost.push_back(entry.second.op);
  }
  for (auto& op : lost) {
    if (op->done) continue;
    failOp(op, {ErrorKind::kProtocol, transport::kBadVersion,
                formatText("server %s answered in another protocol version (%s)%s%s (%s)",
                           links_.address(server).c_str(), why.c_str(), said.empty() ? "" : ": ", said.c_str(),
                           describe(*op).c_str())});
  }
}

void Dispatcher::expireDeadlines() {
  auto now = Clock::now();
  while (const Request* request = requests_.firstDue(now)) {
    OpPtr op = request->op;
    uint16_t command = request->command;
    const std::string& address = links_.address(op->server);
    double seconds = std::chrono::duration<double>(op->timeout).count();
    failOp(op, {ErrorKind::kTimeout, 0,
                formatText("%s timed out: no %s reply within %g s from server %s (%s)",
                           op->kind == kPush ? "push_pull" : transport::commandName(op->kind),
                           transport::commandName(command), seconds, address.c_str(), describe(*op).c_str())});
  }
}

int Dispatcher::pollTimeoutMs() const {
  Clock::time_point next = requests_.nextDeadline();
  for (const Link* link : links_.all()) next = std::min(next, link->deadline());
  if (next == Clock::time_point::max()) return -1;
  auto left = next - Clock::now();
  if (left <= Clock::duration::zero()) return 0;
  // Round up: waking a little late is fine, spinning on a not-yet-due deadline is not.
  return static_cast<int>(std::min<int64_t>(std::chrono::ceil<std::chrono::milliseconds>(left).count(), 1 << 30));
}

}  // namespace bps::client
