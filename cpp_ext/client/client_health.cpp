// A server's health, run by the IO thread (see client.h): a dropped connection marks it down and fails every
// request in flight to it, naming it (and any server lost before it, the likely cause); while down, new requests
// fail at once; when it reconnects, a re-HELLO asks whether the same incarnation answers before it is trusted again
// (a restarted server has lost the job's sums).
#include <chrono>
#include <cinttypes>

#include "client/client.h"

namespace bps::client {

void Client::onDisconnect(size_t server) {
  markDown(server, "lost the connection");
  failServer(server, "lost the connection to server " + links_[server]->address());
}

void Client::markDown(size_t server, const std::string& why) {
  LinkState& state = linkStates_[server];
  if (state.down) return;
  state.down = true;
  state.why = why;
  state.since = Clock::now();
  // Down means no stream either: the server lost this worker with the connection; a re-HELLO opens a new one.
  closeStream(server, why);
  if (onLinkDown_) pool_.post([this, server, why] { onLinkDown_(server, why); });
}

void Client::failServer(size_t server, const std::string& what) {
  std::vector<OpPtr> lost;
  for (auto& entry : inflight_) {
    if (entry.second.op->server == server) lost.push_back(entry.second.op);
  }
  std::string earlier = earlierLoss(server);
  for (auto& op : lost) {
    if (op->done) continue;
    uint16_t command = inflight_.at(op->requests.front()).command;
    failOp(op, {ErrorKind::kTransport, 0,
                formatText("%s while waiting for the %s reply (%s)%s", what.c_str(), commandName(command),
                           describe(*op).c_str(), earlier.c_str())});
  }
}

std::string Client::earlierLoss(size_t server) const {
  const LinkState& mine = linkStates_[server];
  size_t first = server;
  for (size_t i = 0; i < linkStates_.size(); ++i) {
    const LinkState& other = linkStates_[i];
    if (i != server && other.down && other.since < mine.since &&
        (first == server || other.since < linkStates_[first].since)) {
      first = i;
    }
  }
  if (first == server) return "";
  double ago = std::chrono::duration<double>(mine.since - linkStates_[first].since).count();
  return formatText("; server %s had gone %.2f s earlier (%s)", links_[first]->address().c_str(), ago,
                    linkStates_[first].why.c_str());
}

void Client::onReconnect(size_t server) {
  // Reachable again: ask who answers before trusting it (a restarted server has lost the job's sums).
  if (!linkStates_[server].down || linkStates_[server].abandoned || ioIncarnations_[server] == 0) return;
  auto op = std::make_shared<Op>();
  op->kind = kHello;
  op->server = server;
  op->rehello = true;
  op->timeout = timeout_;
  sendRequest(op, kHello, Clock::now() + op->timeout);
}

void Client::onRehello(const OpPtr& op, uint64_t incarnation, uint64_t streamPort) {
  op->done = true;
  LinkState& state = linkStates_[op->server];
  if (state.abandoned) return;
  if (incarnation == ioIncarnations_[op->server]) {
    state = LinkState{};
    openStream(op->server, streamPort, false);
  } else {
    state.why = formatText("restarted (incarnation 0x%016" PRIx64 ", now 0x%016" PRIx64 ") and lost this job's sums",
                           ioIncarnations_[op->server], incarnation);
    if (onLinkDown_) pool_.post([this, server = op->server, why = state.why] { onLinkDown_(server, why); });
  }
}

bool Client::failIfDown(const OpPtr& op) {
  const LinkState& state = linkStates_[op->server];
  if (!state.down) return false;
  double ago = std::chrono::duration<double>(Clock::now() - state.since).count();
  if (op->kind == kPush) op->round = keys_[op->key].nextRound;  // the round it would have been, for the message
  failOp(op, {ErrorKind::kTransport, 0,
              formatText("server %s is unreachable: %s %.1f s ago (%s)", links_[op->server]->address().c_str(),
                         state.why.c_str(), ago, describe(*op).c_str())});
  return true;
}

}  // namespace bps::client
