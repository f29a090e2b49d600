// A server's health and its links' events, run by the IO thread (see dispatcher.h).
#include <chrono>
#include <cinttypes>

#include "client/dispatcher.h"

namespace bps::client {

using transport::kHello;
using transport::kPush;

void Dispatcher::onClosed(Link& link, const std::string& why, bool wasReady) {
  size_t server = link.server();
  settle(server);
  if (!wasReady) {
    links_.notOpened(link, why);
    return;
  }
  if (!stopping_) linkLost(link, why);
}

void Dispatcher::linkLost(Link& link, const std::string& why) {
  size_t server = link.server();
  std::string detail = why.empty() ? "" : " (" + why + ")";
  markDown(server, "lost the connection" + detail);
  failServer(server, "lost the connection to server " + link.address() + detail);
  // A link that does not come back by itself: ask at once whether the server is still there (onReconnect acts on
  // a server that is down, as this one now is): if its other link stayed up, nothing else would ever ask.
  if (!link.reconnects()) onReconnect(server);
}

void Dispatcher::markDown(size_t server, const std::string& why) {
  if (!links_.markDown(server, why)) return;
  // Down means no stream either: the server lost this worker with the connection; a re-HELLO opens a new one.
  closeStream(server, why);
  if (onLinkDown_) pool_.post([this, server, why] { onLinkDown_(server, why); });
}

void Dispatcher::failServer(size_t server, const std::string& what) {
  std::vector<OpPtr> lost;
  for (auto& entry : requests_.all()) {
    if (entry.second.op->server == server) lost.push_back(entry.second.op);
  }
  std::string earlier = links_.earlierLoss(server);
  for (auto& op : lost) {
    if (op->done) continue;
    uint16_t command = requests_.at(op->requests.front()).command;
    failOp(op, {ErrorKind::kTransport, 0,
                formatText("%s while waiting for the %s reply (%s)%s", what.c_str(), transport::commandName(command),
                           describe(*op).c_str(), earlier.c_str())});
  }
}

void Dispatcher::onReconnect(size_t server) {
  // Reachable again: ask who answers before trusting it (a restarted server has lost the job's sums).
  const LinkState& state = links_.state(server);
  if (!state.down || state.abandoned || links_.incarnation(server) == 0) return;
  auto op = std::make_shared<Op>();
  op->kind = kHello;
  op->server = server;
  op->rehello = true;
  op->timeout = timeout_;
  op->link = links_.route(server, kHello);
  sendRequest(op, kHello, Clock::now() + op->timeout);
}

void Dispatcher::onRehello(const OpPtr& op, uint64_t incarnation, uint64_t streamOffer) {
  op->done = true;
  LinkState& state = links_.state(op->server);
  if (state.abandoned) return;
  if (incarnation == links_.incarnation(op->server)) {
    state = LinkState{};
    openStream(op->server, streamOffer, false);
  } else {
    state.why = formatText("restarted (incarnation 0x%016" PRIx64 ", now 0x%016" PRIx64 ") and lost this job's sums",
                           links_.incarnation(op->server), incarnation);
    if (onLinkDown_) pool_.post([this, server = op->server, why = state.why] { onLinkDown_(server, why); });
  }
}

bool Dispatcher::failIfDown(const OpPtr& op) {
  const LinkState& state = links_.state(op->server);
  if (!state.down) return false;
  double ago = std::chrono::duration<double>(Clock::now() - state.since).count();
  if (op->kind == kPush) op->round = scheduler_.nextRound(op->key);  // the round it would have been, for the message
  failOp(op, {ErrorKind::kTransport, 0,
              formatText("server %s is unreachable: %s %.1f s ago (%s)", links_.address(op->server).c_str(),
                         state.why.c_str(), ago, describe(*op).c_str())});
  return true;
}

void Dispatcher::abandon(size_t server, const std::string& why) {
  markDown(server, why);
  links_.state(server).abandoned = true;
  closeStream(server, "failed over");  // markDown did if the link was up; never reopened once abandoned
  failServer(server, "server " + links_.address(server) + " was failed over (" + why + ")");
}

void Dispatcher::openStream(size_t server, uint64_t offer, bool forHello) {
  closeStream(server, "a new stream replaces it");
  if (!links_.openStream(server, offer, requests_, stopping_)) return;
  if (forHello) {
    links_.countForHello(server);
    hello_.streamOpening();
  }
}

void Dispatcher::settle(size_t server) {
  if (links_.settled(server)) hello_.streamSettled();
}

void Dispatcher::closeStream(size_t server, const std::string& why) {
  if (links_.closeStream(server, why)) hello_.streamSettled();
}

}  // namespace bps::client
