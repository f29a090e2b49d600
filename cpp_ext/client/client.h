// The push/pull client: one IO thread drives one DEALER per server (ZmqLink); callers enqueue
// operations under a mutex and wake it through an eventfd. Finished operations are handed to a
// CompletionPool, so completion handlers never run on the IO thread.
//
// An operation is HELLO (connect), STATS, or push_pull of one key: INIT on the key's first use, then
// PUSH and PULL of the key's next round, all sent without waiting. A key's next push_pull is held back
// until the previous round's PULL reply arrived (the protocol keeps at most two rounds alive per key).
// Every wire request carries the operation's deadline, counted from when it was sent.
//
// With ClientOptions::stream, a server's operations go on its stream (StreamLink, client_stream.cpp) when it
// was ready as the operation started, else on the DEALER; HELLO always goes on the DEALER.
#pragma once

#include <ATen/core/Tensor.h>

#include <atomic>
#include <chrono>
#include <condition_variable>
#include <deque>
#include <functional>
#include <memory>
#include <mutex>
#include <set>
#include <string>
#include <thread>
#include <unordered_map>
#include <utility>
#include <vector>

#include "client/completion_pool.h"
#include "client/credit_queue.h"
#include "client/credit_sizer.h"
#include "common/errors.h"
#include "common/trace.h"
#include "transport/auth_keys.h"
#include "transport/stream_link.h"
#include "transport/wire.h"
#include "transport/zmq_link.h"

namespace bps::client {

// The client is built on the transport layer (layers point one way: transport <- client).
using namespace bps::transport;


struct ClientOptions {
  std::vector<std::string> servers;  // "host:port"
  uint64_t jobId = 0;
  uint32_t worker = 0;
  uint32_t numWorkers = 1;
  double timeoutSeconds = 300.0;  // per request, from when it is sent
  // ZeroMQ heartbeats: a server silent this long after a PING (stopped, cut off) counts as lost. A killed
  // server closes TCP and is known at once.
  double heartbeatIntervalSeconds = 1.0;
  double heartbeatTimeoutSeconds = 10.0;
  ClientAuth auth;  // no tokens and no server keys: no authentication
  // Bytes of batch pushes in flight (sent, not yet acknowledged); the rest wait in priority order.
  int64_t creditBytes = 2 << 20;
  // creditBytes is where the credit starts: the IO thread then sizes it from the pushes (credit_sizer.h).
  bool autoCredit = false;
  // Bytes of batch pushes in flight toward any one server; 0: no limit but creditBytes. One partition may
  // always be in flight per server, however big.
  int64_t serverCreditBytes = 0;
  // SO_SNDBUF and SO_RCVBUF of every server connection; 0: the kernel's (autotuned). A TCP connection never
  // has more unacknowledged bytes in flight than these allow, in either direction, whatever sits in
  // ZeroMQ's queues: it is what bounds the bytes n connections can pile into one link's queue.
  int socketBufferBytes = 0;
  // SO_RCVBUF of each server's stream, one per server (empty: socketBufferBytes for all). Each bounds what that
  // server's replies may have in flight toward this worker: weighted by the server's share of the bytes, the
  // links carry each connection at its share's rate instead of all at an equal one (docs/issue15.md, "Receive
  // windows by share").
  std::vector<int> receiveBufferBytes;
  // Failover (docs/protocol.md): batches go on past a lost server, each part's outcome is reported, and per
  // key the client counts completed rounds and keeps what its last completed round may still owe the other
  // workers (a copy of its whole result when it pulled the whole key, else of the bytes it pushed).
  bool failover = false;
  // Streams (docs/protocol.md, "The stream transport"): beside each DEALER, a plain TCP connection to the
  // stream port a server offers in its HELLO reply, read and written by the IO thread itself (ZeroMQ's
  // I/O thread and wake-ups cost 70-130 us of CPU per message). Never under CURVE (a stream is not encrypted).
  bool stream = false;
  // Where a server offers its local stream (stream_conn.h: an abstract unix socket, reachable from its own
  // machine only), try it first: no TCP stack on the bytes a colocated server sums.
  bool localStream = true;
  // There, big frames go through shared memory (shared_ring.h) if the server takes it.
  bool sharedMemory = true;
};

// One received message as onReply reads it, whichever connection it came on.
struct ReplyView {
  const uint8_t* header = nullptr;
  size_t headerSize = 0;
  const uint8_t* payload = nullptr;  // the second frame, if any
  size_t payloadSize = 0;
  size_t frames = 0;
};

// A batch part's outcome (pushPullBatch's `outcomes`).
enum PartOutcome : uint8_t { kPartOk = 0, kPartServerLost = 1, kPartFailed = 2, kPartNotRun = 3 };

// Per key, what failover needs (see ClientOptions::failover).
struct KeptRound {
  uint64_t completed = 0;  // rounds of the key this client completed
  bool whole = false;  // the kept bytes are the last completed round's whole result; else its pushed bytes
  uint64_t pushOffset = 0;  // where those pushed bytes go in the key
};

// One partition of a batch: the arguments of one pushPull().
struct PartSpec {
  size_t server = 0;
  uint64_t key = 0;
  uint16_t dtype = 0;
  Mode mode = kModeSum;
  uint64_t keyBytes = 0;
  at::Tensor src;
  uint64_t pushOffset = 0;
  at::Tensor dst;
  uint64_t pullOffset = 0;
};

// The batch scheduler's counters (see pushPullBatch), readable from any thread.
struct SchedulerStats {
  int64_t creditBytes = 0;
  int64_t creditInFlight = 0;  // credit taken by partitions not yet acknowledged: 0 when idle
  int64_t peakCreditInFlight = 0;
  size_t queued = 0;  // partitions waiting for credit
  // Counted apart from the credit, from the PUSH leaving to its acknowledgement (or failure), so that a
  // credit returned twice shows up here as more bytes in flight than the credit allows.
  int64_t pushBytesInFlight = 0;
  int64_t peakPushBytesInFlight = 0;
  uint64_t partsSent = 0;  // batch PUSHes sent
  uint64_t partsAcknowledged = 0;  // batch PUSHes the server acknowledged
  int64_t serverCreditBytes = 0;
  int64_t peakServerCreditInFlight = 0;  // the most credit one server's partitions held at once
  // Counted apart from the credit, per server, like pushBytesInFlight: the most bytes of batch PUSHes in
  // flight toward one server at once.
  int64_t peakServerPushBytesInFlight = 0;
  uint64_t ioWakeups = 0;  // the IO thread's waits that returned something to do
};

// Runs on a CompletionPool thread once per pushPull()/pushPullBatch()/stats(), with the token given there.
using CompletionHandler = std::function<void(uint64_t token, const ErrorInfo& error)>;
// Runs on a CompletionPool thread each time a server's link goes down (connection lost, or it came back as
// another incarnation), with the server's index and why.
using LinkDownHandler = std::function<void(size_t server, const std::string& why)>;

class Client {
 public:
  // Connects (asynchronously) to every server; throws Error(kTransport) for an address ZeroMQ refuses.
  Client(ClientOptions options, CompletionHandler onComplete, LinkDownHandler onLinkDown = {});
  ~Client();
  Client(const Client&) = delete;
  Client& operator=(const Client&) = delete;

  // Send HELLO to every server and wait for all replies; returns the servers' incarnations. Throws
  // Error(kServer) if a server refuses, Error(kTimeout) naming every silent server.
  std::vector<uint64_t> hello(double timeoutSeconds);

  // One round of `key` (keyBytes long, `mode`): push `src` at byte `pushOffset` of the key, then pull the
  // round's bytes [pullOffset, pullOffset + dst.nbytes()) into `dst` (both contiguous CPU, either may be empty,
  // may share memory). A SUM key takes whole-key pushes only; a COPY key's pushes of all workers tile it.
  // pushedToken (if not 0) completes once, when the server acknowledged the PUSH (or the op ended first):
  // the push's bytes have left this worker, which is what a sender's flow control waits for.
  void pushPull(uint64_t token, size_t server, uint64_t key, uint16_t dtype, Mode mode, uint64_t keyBytes,
                at::Tensor src, uint64_t pushOffset, at::Tensor dst, uint64_t pullOffset, uint64_t pushedToken = 0);

  // Run pushPull() for every part, scheduled on the IO thread under the credit (ClientOptions::creditBytes):
  // all batches' partitions wait in one priority queue (higher `priority` first, then submission order); a
  // partition is sent when its bytes fit in the credit or nothing is in flight, and its credit returns when
  // the server acknowledges its PUSH (or it fails), never later: see client_io.cpp. `token` completes once,
  // when every part has ended, with the first part's error or OK; after a part failed, the batch's parts not
  // yet sent are not sent. Throws Error(kValue) for a part that does not fit, before anything is queued.
  // With ClientOptions::failover, every part runs whatever the others do, and `outcomes` (a uint8 tensor of
  // one byte per part, or undefined) receives each part's PartOutcome before the batch completes.
  void pushPullBatch(uint64_t token, std::vector<PartSpec> parts, int64_t priority, at::Tensor outcomes = {});

  // Failover: the key's completed rounds (0 for a key never completed), and a copy of what its last completed
  // round kept (uint8; empty if nothing).
  KeptRound kept(uint64_t key);
  at::Tensor keptBytes(uint64_t key);

  // Failover: treat `server` as lost for good: fail everything outstanding on it at once (kTransport, `why`),
  // never reconnect to it. Returns once the IO thread has done so.
  void abandon(size_t server, const std::string& why);

  SchedulerStats schedulerStats() const;

  // Read the server's counters into `dst` (kStatsCounters little-endian u64, i.e. an int64 tensor).
  void stats(uint64_t token, size_t server, at::Tensor dst);

  std::vector<uint64_t> incarnations();
  std::vector<uint64_t> bytesSent() const;
  std::vector<uint64_t> bytesReceived() const;
  // Streams: whether server's stream is ready now (its operations' requests go on it), and the bytes (message
  // frames, as in bytesSent) each stream carried; both also count in bytesSent()/bytesReceived().
  bool streamReady(size_t server) const;
  bool streamLocal(size_t server) const;  // ready, on the server's local stream (not TCP)
  bool streamShared(size_t server) const;  // ready, and its big frames go through shared memory
  std::vector<uint64_t> streamSharedBytes() const;  // frame bytes each stream moved through shared memory
  std::vector<uint64_t> streamBytesSent() const;
  std::vector<uint64_t> streamBytesReceived() const;
  size_t completionThreadsPeak() { return pool_.peakThreadCount(); }
  // The timeline of the partitions' steps (BPS_TRACE), recorded by the IO thread while on.
  TraceBuffer& trace() { return trace_; }
  // Run `task` on a completion thread.
  void post(CompletionPool::Task task) { pool_.post(std::move(task)); }

  // Fail everything outstanding, run its completions, join every thread. Idempotent; never hangs.
  void close();

 private:
  using Clock = std::chrono::steady_clock;

  struct Op;
  // The parts of one pushPullBatch() still to end, and its first error.
  struct Batch {
    uint64_t token = 0;
    size_t remaining = 0;
    ErrorInfo error;
    std::vector<std::shared_ptr<Op>> ended;  // released on a pool thread, with the completion
    at::Tensor outcomes;  // uint8 per part, or undefined
  };

  struct Op {
    Command kind = kPush;  // kHello, kStats, or kPush for a push_pull
    uint64_t token = 0;
    uint64_t pushedToken = 0;  // completed when the PUSH is acknowledged; 0: nobody asked
    size_t server = 0;
    uint64_t key = 0;
    uint64_t round = 0;
    uint16_t dtype = 0;
    Mode mode = kModeSum;
    uint64_t nbytes = 0;  // the key's size
    at::Tensor src;  // pushed at pushOffset
    at::Tensor dst;  // pulled from pullOffset
    uint64_t pushOffset = 0;
    uint64_t pullOffset = 0;
    Clock::duration timeout{};
    std::deque<uint64_t> requests;  // ids of wire requests still awaiting their reply, in send order
    bool holdsKey = false;  // this push_pull is its key's round in flight
    bool rehello = false;  // a HELLO the IO thread sent on its own after a reconnection
    bool done = false;
    ErrorInfo error;
    std::shared_ptr<Batch> batch;  // set for a batch's part: it completes through the batch
    int64_t priority = 0;  // a batch part's
    int64_t credit = 0;  // credit bytes this part holds (taken when it left the queue, returned once)
    bool pushInFlight = false;  // its PUSH was sent and is not yet acknowledged
    size_t partIndex = 0;  // a batch part's index in its batch
    bool stream = false;  // its requests go on the server's stream (ready when the op started), else on ZeroMQ
  };
  using OpPtr = std::shared_ptr<Op>;

  struct Request {
    OpPtr op;
    uint16_t command = 0;
    Clock::time_point deadline;
  };

  // A server whose connection dropped is down: every request to it fails at once, naming it, until it
  // reconnects and answers HELLO as the same incarnation (a restarted server has lost the job's sums).
  struct LinkState {
    bool down = false;
    bool abandoned = false;  // failed over: down for good
    std::string why;
    Clock::time_point since;
  };

  struct KeyState {
    uint64_t nextRound = 0;
    bool initSent = false;
    bool busy = false;  // a round is in flight
    std::deque<OpPtr> waiting;
  };

  // A push_pull's op, its arguments checked (throws Error(kValue)).
  OpPtr makePushOp(uint64_t token, PartSpec part) const;
  void submit(std::vector<OpPtr> ops);
  void wake();

  // Everything below runs on the IO thread only.
  void ioLoop();
  void takeSubmissions();
  void start(const OpPtr& op);
  void sendQueued();
  // A push's credit returns (once); `acknowledged`: its server has it (a failed push is not counted by the sizer).
  void pushEnded(const OpPtr& op, bool acknowledged);
  void endPart(const OpPtr& op);
  bool sendRequest(const OpPtr& op, uint16_t command, Clock::time_point deadline);
  void onReply(size_t server, const ReplyView& message);
  // A server's health (client_health.cpp).
  void onDisconnect(size_t server);
  void onReconnect(size_t server);
  void onRehello(const OpPtr& op, uint64_t incarnation, uint64_t streamPort);
  void markDown(size_t server, const std::string& why);
  void failServer(size_t server, const std::string& what);
  bool failIfDown(const OpPtr& op);
  // "; server Y had gone N s earlier (why)" for the first other server already down, else "": a server lost
  // first is usually the cause (its rank fails, and takes its own embedded server with it).
  std::string earlierLoss(size_t server) const;
  // Streams (client_stream.cpp).
  void openStream(size_t server, uint64_t port, bool forHello);
  void stepStream(size_t server, short revents);
  void closeStream(size_t server, const std::string& why);
  void streamSettled(size_t server);
  bool sendOnStream(const OpPtr& op, const Header& h, uint16_t command);
  // A ready stream dropped: the server's connection did (down, its requests fail, a re-HELLO goes out).
  void streamLost(size_t server, const std::string& why);
  // The stream's Placement: a PULL reply's payload goes straight into its op's destination tensor.
  bool placePull(size_t server, const Message& head, uint64_t length, Message& into);
  void stopPlacing(size_t server, uint64_t requestId);
  // The rest of the IO thread's work (client_io.cpp).
  void expireDeadlines();
  int pollTimeoutMs() const;
  void forget(uint64_t requestId);
  void failOp(const OpPtr& op, ErrorInfo error);
  void finishOp(const OpPtr& op);
  void failEverything(const std::string& why);
  void keepRound(const Op& op, const void* bytes, size_t nbytes, bool whole);
  std::string describe(const Op& op) const;

  ClientOptions options_;
  CompletionHandler onComplete_;
  LinkDownHandler onLinkDown_;
  Clock::duration timeout_;
  void* context_ = nullptr;
  std::vector<std::unique_ptr<ZmqLink>> links_;
  std::vector<std::unique_ptr<StreamLink>> streams_;  // one per server, active only while a stream is open
  std::vector<uint64_t> placingRequest_;  // per server: the request whose reply placePull placed last
  int wakeFd_ = -1;
  std::thread ioThread_;
  CompletionPool pool_;

  // Submissions, guarded by submitMutex_.
  std::mutex submitMutex_;
  std::vector<OpPtr> submitted_;
  bool closing_ = false;
  std::string ioFailure_;  // set if the IO thread stopped on an error: nothing is accepted any more
  std::vector<std::pair<size_t, std::string>> abandons_;  // abandon() requests

  // HELLO results and incarnations, guarded by stateMutex_.
  std::mutex stateMutex_;
  std::condition_variable helloDone_;
  size_t helloPending_ = 0;
  std::vector<ErrorInfo> helloErrors_;
  std::vector<uint64_t> incarnations_;
  size_t streamsOpening_ = 0;  // streams opened by hello()'s replies and not yet ready or failed: hello() waits

  // Failover's per-key rounds (ClientOptions::failover), guarded by keptMutex_: written by the IO thread
  // when a round completes, read by failover.
  struct Kept {
    KeptRound round;
    // One buffer per key, overwritten each round: a fresh buffer per round (or keeping the reply message)
    // faulted in new pages for every pulled byte, which cost DDP ~5-10% of its step on the emulated cluster.
    at::Tensor bytes;
  };
  std::mutex keptMutex_;
  std::unordered_map<uint64_t, Kept> kept_;
  std::mutex abandonMutex_;
  std::condition_variable abandonDone_;
  uint64_t abandonsAsked_ = 0, abandonsDone_ = 0;

  // IO thread state.
  std::vector<uint64_t> ioIncarnations_;
  std::vector<LinkState> linkStates_;
  std::vector<bool> streamForHello_;  // this server's opening stream is counted in streamsOpening_
  std::unordered_map<uint64_t, Request> inflight_;
  std::set<std::pair<Clock::time_point, uint64_t>> deadlines_;
  std::unordered_map<uint64_t, KeyState> keys_;
  CreditQueue<OpPtr> credit_;
  CreditSizer creditSizer_;  // used with options_.autoCredit
  std::atomic<int64_t> pushBytesInFlight_{0};
  std::atomic<int64_t> peakPushBytesInFlight_{0};
  std::atomic<uint64_t> partsSent_{0};
  std::atomic<uint64_t> partsAcknowledged_{0};
  std::vector<int64_t> serverPushBytesInFlight_;  // IO thread only
  std::atomic<int64_t> peakServerPushBytesInFlight_{0};
  std::atomic<uint64_t> ioWakeups_{0};
  uint64_t nextRequestId_ = 1;
  bool stopping_ = false;
  TraceBuffer trace_;
};

}  // namespace bps::client
