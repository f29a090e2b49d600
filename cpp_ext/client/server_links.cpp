// See server_links.h.
#include "client/server_links.h"

#include <cinttypes>
#include <cstdio>

namespace bps::client {

using transport::Header;
using transport::kHeaderSize;

ServerLinks::ServerLinks(const ClientOptions& options, void* context, const void* owner,
                         const std::function<transport::StreamConn::Placement(size_t server)>& placement)
    : options_(options) {
  size_t n = options.servers.size();
  for (size_t i = 0; i < n; ++i) {
    std::string monitor = formatText("inproc://bps-monitor-%p-%zu", owner, i);
    zmq_.push_back(std::make_unique<transport::ZmqLink>(i, context, options.servers[i], monitor,
                                                        options.heartbeatIntervalSeconds,
                                                        options.heartbeatTimeoutSeconds, options.credentials.forServer(i),
                                                        options.socketBufferBytes));
  }
  for (size_t i = 0; i < n; ++i) {
    streams_.push_back(std::make_unique<transport::StreamLink>(i, options.servers[i]));
    streams_[i]->setPlacement(placement(i));
  }
  for (auto& link : zmq_) all_.push_back(link.get());
  for (auto& link : streams_) all_.push_back(link.get());
  forHello_.assign(n, false);
  incarnations_.assign(n, 0);
  states_.assign(n, LinkState{});
}

Link* ServerLinks::route(size_t server, transport::Command kind) const {
  if (kind != transport::kHello && streams_[server]->ready()) return streams_[server].get();
  return zmq_[server].get();
}

bool ServerLinks::openStream(size_t server, uint64_t offer, Requests& requests, bool stopping) {
  transport::LinkCredentials keys = options_.credentials.forServer(server);
  if (!options_.stream || offer == 0 || keys.usesCurve() || stopping) return false;  // never a stream under CURVE
  const std::string& where = address(server);
  std::string why;
  // The offer: the TCP port, and whether the server also listens on its local stream (wire.h, kStreamLocal).
  bool local = options_.localStream && (offer & transport::kStreamLocal);
  uint64_t port = offer & ~transport::kStreamLocal;
  if (port > 0xffff) {
    why = formatText("the server offered port %" PRIu64, port);
  } else {
    // The same HELLO as on ZeroMQ (Dispatcher::sendRequest; incarnation 0): on the stream it registers this
    // worker's connection, so that the stream dropping loses the worker at the server as ZeroMQ's would.
    Header h;
    h.command = transport::kHello;
    h.worker = options_.worker;
    h.numWorkers = options_.numWorkers;
    h.jobId = options_.jobId;
    h.backups = options_.backups;
    h.window = options_.window;
    h.staleness = options_.staleness;
    h.requestId = requests.nextId();
    uint8_t packed[kHeaderSize];
    packHeader(h, packed);
    std::string host = where.substr(0, where.rfind(':'));
    int receiveBytes = options_.receiveBufferBytes.empty() ? options_.socketBufferBytes
                                                           : options_.receiveBufferBytes[server];
    uint64_t incarnation = incarnations_[server];
    why = streams_[server]->open(host, static_cast<uint16_t>(port), options_.socketBufferBytes, receiveBytes, keys,
                                 transport::copyFrame(packed, kHeaderSize), h.requestId, incarnation,
                                 local ? transport::localStreamName(incarnation) : "", options_.sharedMemory);
  }
  if (!why.empty()) {
    notOpened(*streams_[server], why);
    return false;
  }
  return true;
}

bool ServerLinks::settled(size_t server) {
  if (!forHello_[server]) return false;
  forHello_[server] = false;
  return true;
}

bool ServerLinks::closeStream(size_t server, const std::string& why) {
  streams_[server]->close(why);
  return settled(server);
}

void ServerLinks::notOpened(const Link& link, const std::string& why) const {
  std::fprintf(stderr, "torch_bps: no stream to server %s (%s); its requests stay on ZeroMQ\n",
               link.address().c_str(), why.c_str());
}

bool ServerLinks::markDown(size_t server, const std::string& why) {
  LinkState& state = states_[server];
  if (state.down) return false;
  state.down = true;
  state.why = why;
  state.since = Clock::now();
  return true;
}

std::string ServerLinks::earlierLoss(size_t server) const {
  const LinkState& mine = states_[server];
  size_t first = server;
  for (size_t i = 0; i < states_.size(); ++i) {
    const LinkState& other = states_[i];
    if (i != server && other.down && (!mine.down || other.since < mine.since) &&
        (first == server || other.since < states_[first].since)) {
      first = i;
    }
  }
  if (first == server) return "";
  double ago = std::chrono::duration<double>((mine.down ? mine.since : Clock::now()) - states_[first].since).count();
  return formatText("; server %s had gone %.2f s earlier (%s)", address(first).c_str(), ago,
                    states_[first].why.c_str());
}

void ServerLinks::closeAll(const std::string& why) {
  for (Link* link : all_) link->close(why);
}

std::vector<uint64_t> ServerLinks::bytesSent() const {
  std::vector<uint64_t> out;
  for (size_t i = 0; i < size(); ++i) out.push_back(zmq_[i]->bytesSent() + streams_[i]->bytesSent());
  return out;
}

std::vector<uint64_t> ServerLinks::bytesReceived() const {
  std::vector<uint64_t> out;
  for (size_t i = 0; i < size(); ++i) out.push_back(zmq_[i]->bytesReceived() + streams_[i]->bytesReceived());
  return out;
}

}  // namespace bps::client
