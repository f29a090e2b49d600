// The client's links to its servers, and each server's health.
//
// Per server, two links (transport/link.h): its ZeroMQ DEALER, always there (it reconnects by itself), and
// the stream the server may offer in its HELLO reply (docs/protocol.md, "The stream transport"), opened beside
// it: over the server's local unix socket when it runs on this machine, else TCP. route() is the one place that
// chooses between them: an operation goes on the stream if it was ready as the operation started, else on the
// DEALER; a HELLO always goes on the DEALER.
//
// A stream opens after every HELLO reply from the incarnation we know (hello() waits for it to be ready or to
// fail, so a job's traffic takes one road from its first request on), and after every re-HELLO that found the
// server back. Failing before ready (refused, AUTH refused, no answer within 10 s): one line on stderr, and the
// server's requests stay on ZeroMQ until its next re-HELLO. Dropping once ready: the server's connection dropped.
//
// Health: a server whose connection dropped is down: every request to it fails at once, naming it, until it
// reconnects and answers HELLO as the same incarnation (a restarted server has lost the job's sums).
//
// Threading: the IO thread only, but the byte counters and the streams' state may be read from any thread.
#pragma once

#include <memory>
#include <string>
#include <vector>

#include "client/options.h"
#include "client/requests.h"
#include "transport/stream_link.h"
#include "transport/zmq_link.h"

namespace bps::client {

using transport::Link;

// A server's health.
struct LinkState {
  bool down = false;
  bool abandoned = false;  // failed over: down for good
  std::string why;
  Clock::time_point since;
};

class ServerLinks {
 public:
  // Connects (asynchronously) a DEALER to every server; throws Error(kTransport) for an address ZeroMQ refuses.
  // `placement` places a PULL reply's payload on a stream (transport::StreamConn::Placement), per server.
  ServerLinks(const ClientOptions& options, void* context, const void* owner,
              const std::function<transport::StreamConn::Placement(size_t server)>& placement);

  size_t size() const { return zmq_.size(); }
  const std::string& address(size_t server) const { return zmq_[server]->address(); }
  bool everConnected(size_t server) const { return zmq_[server]->everConnected(); }
  // Every link, in the order the IO loop serves them: the DEALERs, then the streams.
  const std::vector<Link*>& all() const { return all_; }

  // The link an operation's requests go on (all of them, in order), chosen as it starts.
  Link* route(size_t server, transport::Command kind) const;

  // Open the stream a HELLO reply offered (`offer`: the reply's length field); a stream already open closes first
  // (closeStream()). Returns true if one is now opening; false if none was offered, none may be used (CURVE,
  // ClientOptions::stream off, `stopping`), or it failed at once (said on stderr).
  bool openStream(size_t server, uint64_t offer, Requests& requests, bool stopping);
  // The stream that was opening for hello() (countForHello) settled: true once, then false.
  void countForHello(size_t server) { forHello_[server] = true; }
  bool settled(size_t server);
  // Close the server's stream without reporting; returns settled(server).
  bool closeStream(size_t server, const std::string& why);
  // A stream failed before it was ready: say so (its requests stay on the DEALER).
  void notOpened(const Link& link, const std::string& why) const;

  // The incarnation the server's HELLO reply gave (0 before).
  uint64_t incarnation(size_t server) const { return incarnations_[server]; }
  void setIncarnation(size_t server, uint64_t incarnation) { incarnations_[server] = incarnation; }

  LinkState& state(size_t server) { return states_[server]; }
  // Mark the server down (if it is not): false if it already was.
  bool markDown(size_t server, const std::string& why);
  // "; server Y had gone N s earlier (why)" for the first other server down before this one went down (or, if
  // it is up, down now), else "": a server lost first is usually the cause (its rank fails, and takes its own
  // embedded server with it).
  std::string earlierLoss(size_t server) const;

  // Close every link (the client is closing).
  void closeAll(const std::string& why);

  // Bytes each server's links carried (message frames), and its stream's share.
  std::vector<uint64_t> bytesSent() const;
  std::vector<uint64_t> bytesReceived() const;
  const transport::StreamLink& stream(size_t server) const { return *streams_[server]; }

 private:
  const ClientOptions& options_;
  std::vector<std::unique_ptr<transport::ZmqLink>> zmq_;
  std::vector<std::unique_ptr<transport::StreamLink>> streams_;  // one per server, active only while open
  std::vector<Link*> all_;
  std::vector<bool> forHello_;  // this server's opening stream is one hello() waits for
  std::vector<uint64_t> incarnations_;
  std::vector<LinkState> states_;
};

}  // namespace bps::client
