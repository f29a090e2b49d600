// The summation server's native core: one loop thread that owns the ROUTER and answers PUSH and PULL of
// declared keys without entering Python; everything else goes to the control plane (torch_bps/server/server.py)
// synchronously, on the same thread, through the ControlPlane interface below.
//
// The core owns its own ZeroMQ context, the ROUTER, the ROUTER's monitor and (with authentication) the ZAP
// socket: libzmq is linked into this extension separately from pyzmq's bundled copy, so no socket may cross
// between the two. Python configures the ROUTER through setOption/bind before run().
//
// What the loop handles natively: a request whose header parses, whose command is PUSH or PULL with the right
// number of frames, of the current incarnation, of a job registered here whose bound identity is the message's
// "User-Id", of a worker in range, of a declared key, matching its declaration (keys.py's check_request). Every
// other message (HELLO, INIT, STATS, garbage, refusals) goes to ControlPlane::onRequest, which answers it and
// tells the core what changed by calling hello/declare/workerLost/refuse/forgetJob right there. Every peer's
// messages are therefore handled in the order they arrived, and nothing here locks.
//
// Thread contract: every method but the constructor, setOption, enableZap, bind and listenStream runs on the
// thread in run() (from inside a ControlPlane callback, or before run()).
//
// The rooms: the jobs and their declared keys are a JobTable (jobs.h), each key's rounds a KeyRounds (rounds.h);
// streams (streams.h) are served by the same loop, their requests taking the same path as the ROUTER's.
#pragma once

#include <cstdint>
#include <memory>
#include <string>
#include <vector>

#include "common/trace.h"
#include "server/jobs.h"
#include "server/rounds.h"
#include "server/streams.h"

namespace bps::server {

// What a request carries beside its frames, for the control plane.
struct RequestMeta {
  int fd = -1;  // ZMQ_SRCFD: the connection it came on
  std::string peerAddress;  // "Peer-Address"
  std::string userId;  // "User-Id": the ZAP identity ("" without authentication)
};

// The Python side: called on the loop thread only.
class ControlPlane {
 public:
  virtual ~ControlPlane() = default;
  // Answer a message the core does not handle: frames[0] is the ROUTER identity. Return the reply's frames
  // (identity first), or none to drop the message.
  virtual std::vector<std::string> onRequest(const std::vector<std::string>& frames, const RequestMeta& meta) = 0;
  // The connection on fd dropped.
  virtual void onDisconnect(int fd) = 0;
  // Answer a ZAP request (RFC 27 frames).
  virtual std::vector<std::string> onZap(const std::vector<std::string>& frames) = 0;
  // Every tick: return false to end run().
  virtual bool tick() = 0;
};

struct CoreCounters {
  uint64_t pushes = 0, pulls = 0, bytesIn = 0, bytesOut = 0, errors = 0;
  SumCounters sums;
  uint64_t sumCount = 0;  // pushes added into a round (the first push of a round is kept, not added)
  // Messages read, and the loop's wake-ups that read them: requests / wakeups is the queue it finds on waking.
  uint64_t requests = 0, wakeups = 0;
};

class ServerCore {
 public:
  explicit ServerCore(uint64_t incarnation);
  ~ServerCore();
  ServerCore(const ServerCore&) = delete;
  ServerCore& operator=(const ServerCore&) = delete;

  void setOption(int option, int64_t value);  // ZMQ_MAXMSGSIZE as int64, the others as int
  void setOption(int option, const std::string& value);
  // Bind the ZAP handler's socket (inproc://zeromq.zap.01): before bind(), so no connection goes unchecked.
  void enableZap();
  // Bind the ROUTER (e.g. "tcp://127.0.0.1:0"); return the endpoint bound.
  std::string bind(const std::string& endpoint);
  // Listen for streams (docs/protocol.md, "The stream transport") on host, any free port; returns the port.
  // Their AUTH goes to the same ZAP handler as the ROUTER's connections (mechanism PLAIN; NULL without it).
  // receiveBufferBytes > 0: each stream's SO_RCVBUF, which bounds the pushes in flight toward this server.
  uint16_t listenStream(const std::string& host, int receiveBufferBytes = 0);
  // listenStream also listens on the local stream (stream_conn.h), to be offered in HELLO replies.
  bool localStream() const { return streams_.listeningLocal(); }
  // Serve until control.tick() returns false (called every tickSeconds) or a callback throws (rethrown here,
  // after the sockets are closed).
  void run(ControlPlane& control, double tickSeconds);

  // The control plane's updates.
  // Register (or refresh) worker `worker` of job `jobId` said HELLO from `peer`; the job is bound to `identity`
  // if it has no owner yet.
  void hello(uint64_t jobId, uint32_t worker, uint32_t numWorkers, uint32_t backups, uint32_t window, uint64_t staleness,
             const std::string& peer, const std::string& identity) {
    jobs_.hello(jobId, worker, numWorkers, backups, window, staleness, peer, identity);
  }
  void touch(uint64_t jobId, uint32_t worker) { jobs_.touch(jobId, worker); }  // a request the control plane handled
  void declare(uint64_t jobId, uint64_t key, uint64_t nbytes, uint16_t dtype, uint32_t mode, uint32_t codec = 0,
               uint64_t denseBytes = 0) {
    jobs_.declare(jobId, key, nbytes, dtype, mode, codec, denseBytes);
  }
  // The worker's connection dropped: fail the waiting pulls of every round it has not pushed.
  void workerLost(uint64_t jobId, uint32_t worker, const std::string& how);
  // A push of the key was refused (reason: why): its round fails for every worker.
  void refuse(uint64_t jobId, uint64_t key, uint32_t worker, uint64_t round, const std::string& reason);
  // Drop the job and its keys; answer its waiting pulls with UNKNOWN_JOB and `message`.
  void forgetJob(uint64_t jobId, const std::string& message);
  // (job, monotonic seconds of its last request handled natively) for every job with one since the last call.
  std::vector<std::pair<uint64_t, double>> takeTouched() { return jobs_.takeTouched(); }
  const CoreCounters& counters() const { return counters_; }
  // (job, its counters) for every job registered here.
  std::vector<std::pair<uint64_t, JobCounters>> jobCounters() const { return jobs_.jobCounters(); }
  // Keys with pulls waiting for their round to close.
  size_t keysWaiting() const { return jobs_.keysWaiting(); }
  // The timeline of sums and wake-ups (bps-server --trace), recorded by the loop while on.
  TraceBuffer& trace() { return trace_; }

 private:
  bool receive(std::vector<Message>& frames);
  // One request: from the ROUTER (stream null) or from a stream. frames[0] is the peer's identity.
  void handle(std::vector<Message>& frames, ControlPlane& control, const StreamPeer* stream);
  bool handleNatively(std::vector<Message>& frames, const Header& h, const std::string& userId);
  void toControlPlane(std::vector<Message>& frames, ControlPlane& control, const StreamPeer* stream);
  bool admitStream(StreamPeer& peer, std::vector<Message>& frames, ControlPlane& control);
  // Send a message (frames without identity) to peer, a ROUTER identity or a stream's.
  void deliver(const std::string& peer, std::vector<Message>& frames);
  void drainMonitor(ControlPlane& control);
  void serveZap(ControlPlane& control);
  void answer(std::vector<Answer>&& answers);
  void answerOne(Answer& answer);
  void replyError(const std::string& peer, const Header& h, uint16_t status, const std::string& message);
  void sendReply(const std::string& peer, const Header& reply, Message* payload);
  void countError(uint64_t jobId);
  void close();

  uint64_t incarnation_;
  void* ctx_ = nullptr;
  void* router_ = nullptr;
  void* monitor_ = nullptr;
  void* zap_ = nullptr;
  bool routerSent_ = false;  // sent on the ROUTER since a read of it found nothing: read before blocking (zmq_fd.h)
  ServerStreams streams_;
  std::string zapDomain_;
  CoreCounters counters_;
  JobTable jobs_{counters_.sums};
  TraceBuffer trace_;
};

}  // namespace bps::server
