// The client's streams (docs/protocol.md, "The stream transport"), run by the IO thread: when to open one,
// what its closing means, and sending a request on it. StreamLink (stream_link.h) is one stream's state machine.
//
// A server offers a stream in its HELLO reply (the `length` field: its stream port). The stream opens after
// every HELLO reply from the incarnation we know (hello() waits for it to be ready or to fail, so a job's
// traffic takes one road from its first request on), and after every re-HELLO that found the server back.
// - Failing before ready (refused, AUTH refused, no answer within 10 s): one line on stderr, and the server's
//   requests stay on ZeroMQ until its next re-HELLO.
// - Dropping once ready: the server's connection dropped, as on ZeroMQ (the server has lost this worker
//   too): down, every request in flight to it fails naming it, and a re-HELLO goes out on ZeroMQ at once.
#include <cinttypes>
#include <cstdio>

#include "client/client.h"

namespace bps::client {

void Client::openStream(size_t server, uint64_t port, bool forHello) {
  closeStream(server, "a new stream replaces it");
  LinkKeys keys = options_.auth.forServer(server);
  if (!options_.stream || port == 0 || keys.usesCurve() || stopping_) return;  // never a stream under CURVE
  const std::string& address = links_[server]->address();
  std::string why;
  // The offer: the TCP port, and whether the server also listens on its local stream (wire.h, kStreamLocal).
  bool local = options_.localStream && (port & kStreamLocal);
  port &= ~kStreamLocal;
  if (port > 0xffff) {
    why = formatText("the server offered port %" PRIu64, port);
  } else {
    // The same HELLO as on ZeroMQ (job, worker, num_workers; incarnation 0): on the stream it registers this
    // worker's connection, so that the stream dropping loses the worker at the server as ZeroMQ's would.
    Header h;
    h.command = kHello;
    h.worker = options_.worker;
    h.numWorkers = options_.numWorkers;
    h.jobId = options_.jobId;
    h.requestId = nextRequestId_++;
    uint8_t packed[kHeaderSize];
    packHeader(h, packed);
    std::string host = address.substr(0, address.rfind(':'));
    int receiveBytes = options_.receiveBufferBytes.empty() ? options_.socketBufferBytes
                                                           : options_.receiveBufferBytes[server];
    uint64_t incarnation = ioIncarnations_[server];
    why = streams_[server]->open(host, static_cast<uint16_t>(port), options_.socketBufferBytes, receiveBytes, keys,
                                 copyFrame(packed, kHeaderSize), h.requestId, incarnation,
                                 local ? localStreamName(incarnation) : "", options_.sharedMemory);
  }
  if (!why.empty()) {
    std::fprintf(stderr, "torch_bps: no stream to server %s (%s); its requests stay on ZeroMQ\n", address.c_str(),
                 why.c_str());
    return;
  }
  if (forHello) {
    streamForHello_[server] = true;
    std::lock_guard<std::mutex> lock(stateMutex_);
    ++streamsOpening_;
  }
}

void Client::stepStream(size_t server, short revents) {
  StreamStep step;
  streams_[server]->step(revents, step);
  for (auto& frames : step.replies) {
    ReplyView view;
    view.frames = frames.size();
    view.header = frames[0].data();
    view.headerSize = frames[0].size();
    if (frames.size() > 1) {
      view.payload = frames[1].data();
      view.payloadSize = frames[1].size();
    }
    onReply(server, view);
  }
  if (step.becameReady) streamSettled(server);
  if (!step.closed) return;
  streamSettled(server);
  const std::string& address = links_[server]->address();
  if (!step.wasReady) {
    std::fprintf(stderr, "torch_bps: no stream to server %s (%s); its requests stay on ZeroMQ\n", address.c_str(),
                 step.why.c_str());
    return;
  }
  streamLost(server, step.why);
}

void Client::streamLost(size_t server, const std::string& why) {
  // Worded as ZeroMQ's drop (callers and tests match "lost the connection"), saying it was the stream.
  markDown(server, "lost the connection (its stream closed: " + why + ")");
  failServer(server, "lost the connection to server " + links_[server]->address() + " (its stream closed: " + why + ")");
  // Ask at once whether it is still there (onReconnect acts on a link that is down, as this one now is): if its
  // ZeroMQ connection stayed up, nothing else would ever bring it back.
  onReconnect(server);
}

bool Client::placePull(size_t server, const Message& head, uint64_t length, Message& into) {
  // Only a successful PULL reply of the size its request asked, to a request in flight on this server.
  if (head.size() != kHeaderSize) return false;
  uint16_t command = detail::load<uint16_t>(head.data(), 6), status = detail::load<uint16_t>(head.data(), 8);
  if (command != (kPull | kReplyFlag) || status != kOk) return false;
  uint64_t requestId = detail::load<uint64_t>(head.data(), 64);
  auto found = inflight_.find(requestId);
  if (found == inflight_.end() || found->second.command != kPull) return false;
  const Op& op = *found->second.op;
  if (op.server != server || op.dst.nbytes() != length) return false;
  // Failover keeps a partial pull's pushed bytes after the reply arrived: they must not be overwritten first.
  bool whole = op.pullOffset == 0 && length == op.nbytes;
  if (options_.failover && !whole) return false;
  into = tensorFrame(op.dst);
  placingRequest_[server] = requestId;
  return true;
}

void Client::stopPlacing(size_t server, uint64_t requestId) {
  // The request failed while its reply was being read into its destination: the caller may reuse that tensor at
  // once, so the rest of the reply must not land there. Only closing the stream stops it; the server's other
  // requests on it go with it, as when a stream drops.
  std::string why = formatText("request %" PRIu64 " failed while its reply was arriving", requestId);
  streams_[server]->close(why);
  if (!stopping_) streamLost(server, why);
}

void Client::closeStream(size_t server, const std::string& why) {
  streams_[server]->close(why);
  streamSettled(server);
}

void Client::streamSettled(size_t server) {
  if (!streamForHello_[server]) return;
  streamForHello_[server] = false;
  std::lock_guard<std::mutex> lock(stateMutex_);
  --streamsOpening_;
  helloDone_.notify_all();
}

bool Client::sendOnStream(const OpPtr& op, const Header& h, uint16_t command) {
  StreamLink& stream = *streams_[op->server];
  if (!stream.ready()) {  // it closed after the op started on it: the op's earlier requests went with it
    failOp(op, {ErrorKind::kTransport, 0,
                formatText("cannot send %s to server %s: its stream closed (%s)", commandName(command),
                           links_[op->server]->address().c_str(), describe(*op).c_str())});
    return false;
  }
  uint8_t packed[kHeaderSize];
  packHeader(h, packed);
  std::vector<Message> frames;
  frames.push_back(copyFrame(packed, kHeaderSize));
  if (command == kPush) frames.push_back(tensorFrame(op->src));  // zero-copy, as on ZeroMQ
  stream.send(frames);  // written by the IO loop's next stepStream(), with whatever else was queued by then
  return true;
}

bool Client::streamReady(size_t server) const {
  if (server >= streams_.size()) {
    throw Error(ErrorKind::kValue, formatText("server index %zu is out of range: %zu servers", server, streams_.size()));
  }
  return streams_[server]->ready();
}

bool Client::streamLocal(size_t server) const {
  return streamReady(server) && streams_[server]->local();
}

bool Client::streamShared(size_t server) const {
  return streamReady(server) && streams_[server]->shared();
}

std::vector<uint64_t> Client::streamSharedBytes() const {
  std::vector<uint64_t> out;
  for (const auto& s : streams_) out.push_back(s->sharedBytes());
  return out;
}

std::vector<uint64_t> Client::streamBytesSent() const {
  std::vector<uint64_t> out;
  for (const auto& s : streams_) out.push_back(s->bytesSent());
  return out;
}

std::vector<uint64_t> Client::streamBytesReceived() const {
  std::vector<uint64_t> out;
  for (const auto& s : streams_) out.push_back(s->bytesReceived());
  return out;
}

}  // namespace bps::client
