// See scheduler.h.
#include "client/scheduler.h"

#include <chrono>

namespace bps::client {
namespace {

// The automatic credit's bounds, and the sender's scheduling jitter it covers (credit_sizer.h): the link must
// stay busy while the IO thread waits to run again.
constexpr int64_t kMinAutoCredit = 256 << 10, kMaxAutoCredit = 64 << 20;
constexpr double kAutoCreditJitterSeconds = 0.008;

}  // namespace

Scheduler::Scheduler(const ClientOptions& options, size_t servers)
    : autoCredit_(options.autoCredit),
      credit_(options.creditBytes, options.serverCreditBytes),
      creditSizer_(kMinAutoCredit, kMaxAutoCredit, kAutoCreditJitterSeconds),
      serverPushBytesInFlight_(servers, 0) {}

void Scheduler::queue(const OpPtr& op) {
  credit_.push(op->server, static_cast<int64_t>(op->src.nbytes()), op->priority, op);
}

OpPtr Scheduler::admit() {
  auto next = credit_.pop();
  if (!next) return nullptr;
  auto& [op, nbytes, server] = *next;
  op->credit = nbytes;
  return op;
}

bool Scheduler::takeKey(const OpPtr& op, bool* init) {
  KeyState& key = keys_[op->key];
  if (key.busy) {
    key.waiting.push_back(op);
    return false;
  }
  key.busy = true;
  op->holdsKey = true;
  op->round = key.nextRound++;
  *init = !key.initSent;
  key.initSent = true;
  return true;
}

OpPtr Scheduler::releaseKey(const Op& op, bool next) {
  KeyState& key = keys_[op.key];
  key.busy = false;
  if (!next || key.waiting.empty()) return nullptr;
  OpPtr waiting = std::move(key.waiting.front());
  key.waiting.pop_front();
  return waiting;
}

void Scheduler::pushSent(Op& op) {
  op.pushInFlight = true;
  int64_t inFlight = pushBytesInFlight_ += static_cast<int64_t>(op.src.nbytes());
  if (inFlight > peakPushBytesInFlight_) peakPushBytesInFlight_ = inFlight;  // only this thread writes it
  int64_t toServer = serverPushBytesInFlight_[op.server] += static_cast<int64_t>(op.src.nbytes());
  if (toServer > peakServerPushBytesInFlight_) peakServerPushBytesInFlight_ = toServer;
  ++partsSent_;
}

void Scheduler::pushEnded(Op& op, bool acknowledged) {
  if (op.pushInFlight) {
    op.pushInFlight = false;
    pushBytesInFlight_ -= static_cast<int64_t>(op.src.nbytes());
    serverPushBytesInFlight_[op.server] -= static_cast<int64_t>(op.src.nbytes());
  }
  if (op.credit == 0) return;
  if (autoCredit_ && acknowledged) {
    double now = std::chrono::duration<double>(Clock::now().time_since_epoch()).count();
    int64_t sized = creditSizer_.onAck(op.server, op.credit, now, credit_.queued() > 0);
    if (sized != 0) credit_.setCreditBytes(sized);
  }
  credit_.release(op.server, op.credit);
  op.credit = 0;  // exactly once: on the acknowledgement, or when the op ends without one
}

std::vector<OpPtr> Scheduler::drain() {
  std::vector<OpPtr> ops = credit_.drain();
  for (auto& entry : keys_) {
    for (auto& op : entry.second.waiting) ops.push_back(op);
    entry.second.waiting.clear();
  }
  return ops;
}

SchedulerStats Scheduler::stats() const {
  SchedulerStats s;
  s.creditBytes = credit_.creditBytes();
  s.creditInFlight = credit_.inFlight();
  s.peakCreditInFlight = credit_.peakInFlight();
  s.queued = credit_.queued();
  s.pushBytesInFlight = pushBytesInFlight_.load();
  s.peakPushBytesInFlight = peakPushBytesInFlight_.load();
  s.partsSent = partsSent_.load();
  s.partsAcknowledged = partsAcknowledged_.load();
  s.serverCreditBytes = credit_.destinationCreditBytes();
  s.peakServerCreditInFlight = credit_.peakDestinationInFlight();
  s.peakServerPushBytesInFlight = peakServerPushBytesInFlight_.load();
  s.ioWakeups = ioWakeups_.load();
  return s;
}

}  // namespace bps::client
