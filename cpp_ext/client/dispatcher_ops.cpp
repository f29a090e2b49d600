// How the IO thread ends operations (see dispatcher.h): failing them, finishing them, completing batches.
#include <algorithm>
#include <cinttypes>

#include "client/dispatcher.h"

namespace bps::client {

using transport::kHello;
using transport::kPush;

void Dispatcher::failOp(const OpPtr& op, ErrorInfo error) {
  if (op->done) return;
  if (op->kind == kPush) trace_.mark(kTraceFailed, traceId(op.get()), op->key, op->round, 0, op->server);
  // A reply being read into this op's destination right now must stop before the IO thread reads on.
  Link* link = op->link;
  uint64_t placing = op->kind == kPush && link != nullptr ? link->placing() : 0;
  bool stop = placing != 0 && std::find(op->requests.begin(), op->requests.end(), placing) != op->requests.end();
  for (uint64_t id : op->requests) requests_.forget(id);
  op->requests.clear();
  op->error = std::move(error);
  finishOp(op);
  // The caller may reuse that tensor at once, so the rest of the reply must not land there. Only closing the
  // link stops it; the server's other requests on it go with it, as when it drops.
  if (stop) link->abort(formatText("request %" PRIu64 " failed while its reply was arriving", placing), *this);
}

std::string Dispatcher::describe(const Op& op) const {
  if (op.kind != kPush) {
    return formatText("job 0x%016" PRIx64 ", worker %u of %u", options_.jobId, options_.worker, options_.numWorkers);
  }
  return formatText("job 0x%016" PRIx64 ", key %" PRIu64 ", round %" PRIu64 ", worker %u of %u", options_.jobId,
                    op.key, op.round, options_.worker, options_.numWorkers);
}

void Dispatcher::pushEnded(const OpPtr& op, bool acknowledged) {
  scheduler_.pushEnded(*op, acknowledged);
  if (op->pushedToken != 0) {
    uint64_t token = op->pushedToken;
    op->pushedToken = 0;
    pool_.post([this, token] { onComplete_(token, ErrorInfo{}); });
  }
}

void Dispatcher::endPart(const OpPtr& op) {
  Batch& batch = *op->batch;
  if (batch.outcomes.defined()) {
    uint8_t outcome = op->error.ok() ? kPartOk
                      : op->error.kind == ErrorKind::kTransport ? kPartServerLost
                      : op->error.kind == ErrorKind::kClosed && !batch.error.ok() && op->requests.empty() ? kPartNotRun
                                                                                                       : kPartFailed;
    batch.outcomes.data_ptr<uint8_t>()[op->partIndex] = outcome;
  }
  bool first = !op->error.ok() && batch.error.ok();
  if (first) batch.error = op->error;
  batch.ended.push_back(op);
  if (--batch.remaining > 0) {
    if (first && batchFailed(batch)) abandonParts(op->batch);
    return;
  }
  // One completion per batch. The parts (and their tensor references) die on the pool thread, after it ran;
  // moving them out of the batch also breaks the part -> batch -> part cycle.
  pool_.post([this, token = batch.token, error = batch.error, ended = std::move(batch.ended)] {
    onComplete_(token, error);
  });
}

bool Dispatcher::batchFailed(const Batch& batch) const {
  // With failover, a part whose server was lost is sent again elsewhere: only another error fails the batch.
  return !batch.error.ok() && (!options_.failover || batch.error.kind != ErrorKind::kTransport);
}

void Dispatcher::abandonParts(const std::shared_ptr<Batch>& batch) {
  // The batch has failed, so its parts in flight end now instead of each at its reply or deadline: a part whose
  // round another worker never pushes (its keys cut otherwise, its INIT refused) would wait out the whole
  // timeout. A part whose reply is being placed ends with that reply; the parts not yet sent never go (start).
  std::vector<OpPtr> parts;  // a part with several requests in flight comes once per request: failOp ends it once
  for (auto& entry : requests_.all()) {
    const OpPtr& part = entry.second.op;
    if (part->batch != batch) continue;
    uint64_t placing = part->link != nullptr ? part->link->placing() : 0;
    if (placing == 0 || std::find(part->requests.begin(), part->requests.end(), placing) == part->requests.end()) {
      parts.push_back(part);
    }
  }
  for (auto& part : parts) {
    failOp(part, {ErrorKind::kClosed, 0, "abandoned: another part of its batch failed (" + describe(*part) + ")"});
  }
}

void Dispatcher::finishOp(const OpPtr& op) {
  op->done = true;
  if (op->rehello) {
    // Ours, not a caller's: the link stays down. A server that is there but slow to answer is asked again (after
    // a link that does not reconnect by itself dropped, nothing else would ask); a lost connection asks again
    // when it comes back (onReconnect).
    if (op->error.kind == ErrorKind::kTimeout && !stopping_) onReconnect(op->server);
    return;
  }
  pushEnded(op, false);
  if (op->kind == kHello) {
    hello_.ended(op->server, op->error);
    return;
  }
  if (op->holdsKey) {
    OpPtr next = scheduler_.releaseKey(*op, !stopping_);
    if (next) start(next);
  }
  if (op->batch) {
    endPart(op);
    return;
  }
  // The op (and its tensor references) dies on the pool thread, after its completion ran.
  pool_.post([this, op] { onComplete_(op->token, op->error); });
}

void Dispatcher::failEverything(const std::string& why) {
  stopping_ = true;  // finishing an op starts no waiting one any more
  std::vector<OpPtr> ops;
  std::vector<std::pair<size_t, std::string>> abandons;
  submissions_.take(ops, abandons);
  for (auto& op : scheduler_.drain()) ops.push_back(std::move(op));
  for (auto& entry : requests_.all()) ops.push_back(entry.second.op);
  bool failed = !submissions_.failure().empty();
  for (auto& op : ops) {
    if (op->done) continue;
    std::string pending = op->requests.empty()
                              ? std::string("before it was sent")
                              : formatText("before the %s reply from server %s",
                                           transport::commandName(requests_.at(op->requests.front()).command),
                                           links_.address(op->server).c_str());
    failOp(op, {failed ? ErrorKind::kTransport : ErrorKind::kClosed, 0,
                formatText("%s %s (%s)", why.c_str(), pending.c_str(), describe(*op).c_str())});
  }
}

}  // namespace bps::client
