// The client's public types: its options, a batch part's arguments and outcome, failover's kept round, the
// scheduler's counters, and the handlers completions run.
#pragma once

#include <ATen/core/Tensor.h>

#include <cstdint>
#include <functional>
#include <string>
#include <vector>

#include "common/errors.h"
#include "transport/credentials.h"
#include "transport/wire.h"

namespace bps::client {

using transport::ClientCredentials;
using transport::Mode;

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
  ClientCredentials credentials;  // no tokens and no server keys: no authentication
  // Bytes of batch pushes in flight (sent, not yet acknowledged); the rest wait in priority order.
  int64_t creditBytes = 2 << 20;
  // autoCredit: creditBytes is where the credit starts; the IO thread then sizes it from the pushes (credit_sizer.h).
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
  // links carry each connection at its share's rate instead of all at an equal one.
  std::vector<int> receiveBufferBytes;
  // Failover (docs/protocol.md): batches go on past a lost server, each part's outcome is reported, and per
  // key the client counts completed rounds and keeps what its last completed round may still owe the other
  // workers (a copy of its whole result when it pulled the whole key, else of the bytes it pushed).
  bool failover = false;
  // Streams (docs/protocol.md, "The stream transport"): beside each DEALER, a plain TCP connection to the
  // stream port a server offers in its HELLO reply, read and written by the IO thread itself, which saves
  // ZeroMQ's I/O thread and its wake-ups on every message. Never under CURVE (a stream is not encrypted).
  bool stream = false;
  // Where a server offers its local stream (transport/stream_conn.h: an abstract unix socket, reachable from its own
  // machine only), try it first: no TCP stack on the bytes a colocated server sums.
  bool localStream = true;
  // There, big frames go through shared memory (transport/shared_ring.h) if the server takes it.
  bool sharedMemory = true;
  // Backup workers (docs/protocol.md): a floating SUM round closes once numWorkers - backups workers pushed it;
  // `window` rounds may be alive per key. Sent in HELLO: every worker of the job must say the same.
  uint32_t backups = 0;
  uint32_t window = 2;
  // MODEL keys (asynchronous training): a pull of round r waits until every worker pushed round r - staleness
  // (transport::kUnbounded: never waits for others). Sent in HELLO.
  uint64_t staleness = 0;
};

// A batch part's outcome (pushPullBatch's `outcomes`).
enum PartOutcome : uint8_t { kPartOk = 0, kPartServerLost = 1, kPartFailed = 2, kPartNotRun = 3 };

// Per key, what failover needs (see ClientOptions::failover).
struct KeptRound {
  uint64_t completed = 0;  // rounds of the key this client completed
  bool whole = false;  // the kept bytes are the last completed round's whole result; else its pushed bytes
  uint64_t pushOffset = 0;  // where those pushed bytes go in the key
};

// One partition of a batch: torch_bps.wire.Partition's fields, in its order, by its names (in camelCase) and in its
// unit (elements of the tensor's dtype), then the dtype's wire code. Client::makePushOp checks that it fits its key,
// the one place any caller's partition is checked, and turns it into the wire's bytes.
struct PartSpec {
  at::Tensor tensor;  // pushed at `offset` (empty: a SUM part that only pulls)
  uint64_t key = 0;
  size_t server = 0;
  at::Tensor out;  // receives the key's result from `outOffset`, as many elements as it holds
  Mode mode = transport::kModeSum;
  int64_t keyNumel = 0;
  int64_t offset = 0;
  int64_t outOffset = 0;
  // A compressed key (docs/protocol.md, "Compressed keys"): its codec word, sent in INIT/PUSH/PULL's `codec`, and
  // the dense partition's fp32 elements, sent in INIT's `dense_bytes`. keyNumel then counts what travels.
  uint32_t codec = 0;
  int64_t denseNumel = 0;
  uint16_t dtype = 0;  // the wire's code of tensor's dtype (docs/protocol.md, "Dtype codes")
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

}  // namespace bps::client
