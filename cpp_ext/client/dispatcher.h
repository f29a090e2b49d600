// The client's IO thread: it owns every link and all request state. It takes what callers submitted, asks the
// Scheduler what goes next, sends each request on the link ServerLinks::route chose when its op started, matches
// replies to their requests, fails what a deadline or a lost server took, and hands finished operations to the
// CompletionPool, so that completion handlers never run on it. It never asks which transport carries a link.
//
// An operation is HELLO (connect), STATS, or push_pull of one key: INIT on the key's first use, then PUSH and
// PULL of the key's next round, all sent without waiting. Every wire request carries the operation's deadline,
// counted from when it was sent.
//
// Threading: run() is the IO thread; stats() and the links' counters may be read from any thread.
#pragma once

#include <atomic>
#include <string>
#include <vector>

#include "client/completion_pool.h"
#include "client/hello_wait.h"
#include "client/kept_rounds.h"
#include "client/op.h"
#include "client/options.h"
#include "client/requests.h"
#include "client/scheduler.h"
#include "client/server_links.h"
#include "client/submissions.h"
#include "common/trace.h"

namespace bps::client {

class Dispatcher : public transport::LinkListener {
 public:
  // The others are the Client's, and outlive this.
  Dispatcher(const ClientOptions& options, Clock::duration timeout, void* context, const void* owner,
             Submissions& submissions, HelloWait& hello, KeptRounds& kept, CompletionPool& pool,
             const CompletionHandler& onComplete, const LinkDownHandler& onLinkDown);

  // The IO thread's body: serve until the client closes (or a failure stops it), then fail everything
  // outstanding and close every link.
  void run();

  ServerLinks& links() { return links_; }
  const ServerLinks& links() const { return links_; }
  SchedulerStats stats() const { return scheduler_.stats(); }
  // The most rounds already closed past a pulled one (a PULL reply's `behind`) since the last call: how far
  // behind the others this worker is (backup workers).
  uint32_t takeBehind() { return behind_.exchange(0, std::memory_order_relaxed); }
  TraceBuffer& trace() { return trace_; }

  // transport::LinkListener: what the links report while run() drives them.
  void onReply(Link& link, const transport::Reply& reply) override;
  void onConnected(Link& link) override { onReconnect(link.server()); }
  void onReady(Link& link) override { settle(link.server()); }
  void onClosed(Link& link, const std::string& why, bool wasReady) override;

 private:
  std::atomic<uint32_t> behind_{0};
  // Sending (dispatcher.cpp).
  void takeSubmissions();
  void sendQueued();
  void start(const OpPtr& op);
  bool sendRequest(const OpPtr& op, uint16_t command, Clock::time_point deadline);
  void onReply(size_t server, const transport::Reply& message);
  void expireDeadlines();
  int pollTimeoutMs() const;

  // Ending operations (dispatcher_ops.cpp).
  void failOp(const OpPtr& op, ErrorInfo error);
  void finishOp(const OpPtr& op);
  // A push's credit returns (once); `acknowledged`: its server has it.
  void pushEnded(const OpPtr& op, bool acknowledged);
  void endPart(const OpPtr& op);
  // Whether a batch has failed for good (not only lost a server that failover replaces), and ending its parts
  // in flight once it has.
  bool batchFailed(const Batch& batch) const;
  void abandonParts(const std::shared_ptr<Batch>& batch);
  void failEverything(const std::string& why);
  // How error messages name an op: its job, its key and round (a push_pull), and this worker.
  std::string describe(const Op& op) const;

  // A server's health (dispatcher_health.cpp): a dropped connection marks it down and fails every request in
  // flight to it, naming it (and any server lost before it, the likely cause); while down, new requests fail at
  // once; when it reconnects, a re-HELLO asks whether the same incarnation answers before it is trusted again.
  void linkLost(Link& link, const std::string& why);
  void onReconnect(size_t server);
  void onRehello(const OpPtr& op, uint64_t incarnation, uint64_t streamOffer);
  void markDown(size_t server, const std::string& why);
  void failServer(size_t server, const std::string& what);
  // A reply in another protocol version: fail every request in flight to `server`, naming both versions.
  void failVersion(size_t server, const std::string& why, const transport::Reply& message);
  bool failIfDown(const OpPtr& op);
  void abandon(size_t server, const std::string& why);
  // The server's stream (the link its HELLO reply offers): opened, settled for hello(), closed.
  void openStream(size_t server, uint64_t offer, bool forHello);
  void settle(size_t server);
  void closeStream(size_t server, const std::string& why);

  const ClientOptions& options_;
  Clock::duration timeout_;
  Submissions& submissions_;
  HelloWait& hello_;
  KeptRounds& kept_;
  CompletionPool& pool_;
  const CompletionHandler& onComplete_;
  const LinkDownHandler& onLinkDown_;
  ServerLinks links_;
  Requests requests_;
  Scheduler scheduler_;
  bool stopping_ = false;
  TraceBuffer trace_;
};

}  // namespace bps::client
