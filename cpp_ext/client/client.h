// The push/pull client: what callers' threads call. One IO thread (Dispatcher) drives every server's links;
// callers submit operations (Submissions) and wake it. Finished operations are handed to a CompletionPool, so
// completion handlers never run on the IO thread.
//
// The rooms: options.h (the public types), dispatcher.* (the IO thread), scheduler.* (which push_pull goes
// next: per-key rounds and the credit), server_links.* (each server's links and health), requests.h (the
// wire requests in flight), kept_rounds.h (failover's memory), submissions.* and hello_wait.h (what callers and
// the IO thread hand each other).
#pragma once

#include <ATen/core/Tensor.h>

#include <memory>
#include <string>
#include <thread>
#include <vector>

#include "client/completion_pool.h"
#include "client/hello_wait.h"
#include "client/kept_rounds.h"
#include "client/op.h"
#include "client/options.h"
#include "client/submissions.h"
#include "common/trace.h"

namespace bps::client {

class Dispatcher;

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

  // One round of `part.key` (`part.keyNumel` elements, `part.mode`): push `part.tensor` at element `part.offset`
  // of the key, then pull the round's elements [outOffset, outOffset + out.numel()) into `part.out` (both contiguous
  // CPU of one dtype, either may be empty, may share memory). A SUM or MODEL key takes whole-key pushes only (a SUM
  // part may also push nothing: it only pulls); a COPY key's pushes of all workers tile it.
  // pushedToken (if not 0) completes once, when the server acknowledged the PUSH (or the op ended first):
  // the push's bytes have left this worker, which is what a sender's flow control waits for.
  void pushPull(uint64_t token, PartSpec part, uint64_t pushedToken = 0);

  // Run pushPull() for every part, scheduled on the IO thread under the credit (ClientOptions::creditBytes):
  // all batches' partitions wait in one priority queue (higher `priority` first, then submission order); a
  // partition is sent when its bytes fit in the credit or nothing is in flight, and its credit returns when
  // the server acknowledges its PUSH (or it fails), never later: see scheduler.h. `token` completes once,
  // when every part has ended, with the first part's error or OK; after a part failed, the batch's parts not
  // yet sent are not sent. Throws Error(kValue) for a part that does not fit its key, before anything is queued.
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
  // Backup workers: how many rounds past a pulled one had already closed, at most, since the last call.
  uint32_t takeBehind();

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
  TraceBuffer& trace();
  // Run `task` on a completion thread.
  void post(CompletionPool::Task task) { pool_.post(std::move(task)); }

  // Fail everything outstanding, run its completions, join every thread. Idempotent; never hangs.
  void close();

 private:
  // A push_pull's op, in the wire's bytes, once `part` (part `index` of a batch of `parts`) is checked: the one
  // check of a partition against its key (throws Error(kValue) naming the key, the part and the bound).
  OpPtr makePushOp(uint64_t token, PartSpec part, size_t index, size_t parts) const;
  void checkServer(size_t server) const;  // throws Error(kValue) for an index out of range

  ClientOptions options_;
  CompletionHandler onComplete_;
  LinkDownHandler onLinkDown_;
  Clock::duration timeout_;
  void* context_ = nullptr;
  Submissions submissions_;
  HelloWait hello_;
  KeptRounds kept_;
  CompletionPool pool_;
  std::unique_ptr<Dispatcher> dispatcher_;
  std::thread ioThread_;
};

}  // namespace bps::client
