// The rounds of one key on the summation server, natively: torch_bps/_reference/rounds.py (KeyRounds) is the
// reference, and tests/server/test_server_rounds.py drives both with the same random sequences and compares.
//
// Rules (docs/protocol.md): round r closes when every worker of the job pushed it (with b backup workers, a
// floating SUM round closes at n - b pushes, its sum scaled by n / contributors, and later pushes are dropped); a
// duplicate push is acknowledged and ignored; a pull of r is answered once r closed (a worker's second pull of r
// while its first waits is refused); r is freed once every worker pulled it (with backups: or is lost); at most
// two rounds are alive (floor, floor + 1), with backups the job's window W, and a pull of r waits until
// r <= floor + W - 2, so that the worker's next push lands inside the window.
// A compressed SUM key (codec.id != kCodecNone, server/codecs.h) decodes each push into an fp32 accumulator and
// encodes the sum once, at close, into the result.
// A SUM round adds whole-key pushes into the first push's received message, in the key's dtype (fp16 and bf16:
// in fp32, scaled and rounded once into that message by the round's last push; server/sums.h); a COPY round
// writes each push's bytes at its offset and, at close, the non-empty pushes must tile the key.
//
// Buffer lifetime: a round's result is a zmq message (the first push as received, or one allocated for a COPY
// round). Once the round closed it is never written again, so answers share it by reference count
// (zmq_msg_copy): a reply may still be in libzmq's queue after the round is freed.
//
// A MODEL key (model.cpp) has no rounds to close: every worker's pushes are added, in its round order and once
// each, into one running total, and a pull of round r answers a copy of the total as soon as the worker's own push
// of r and every other (not lost) worker's push of r - s are in it (s: the job's staleness bound).
//
// Used by one thread only (the server's loop thread): nothing here locks.
#pragma once

#include <zmq.h>

#include <cstdint>
#include <map>
#include <memory>
#include <string>
#include <unordered_map>
#include <vector>

#include "server/codecs.h"
#include "transport/message.h"
#include "transport/wire.h"

namespace bps::server {

// The server is built on the transport layer (layers point one way: transport <- server).
using namespace bps::transport;


// A request the server refuses: its status and the message of the error reply.
struct RoundError {
  uint16_t status;
  std::string message;
};

// A waiting pull: who asked (the ROUTER identity) and what (the request's header).
struct Pull {
  std::string peer;
  Header header;
};

// The answer to a pull: OK with `data` (bytes [offset, offset + length) of the result), or an error.
struct Answer {
  Pull pull;
  uint16_t status = kOk;
  std::string message;
  Message data;
};

// One job's share of the server's traffic (bps-server --metrics-port), counted by the core's loop.
struct JobCounters {
  uint64_t pushes = 0, pulls = 0, bytesIn = 0, bytesOut = 0, errors = 0, sums = 0, bytesSummed = 0, sumNs = 0;
  uint64_t latePushes = 0;  // pushes of a backup round that had already closed: dropped
};

// What a server knows of one job's workers (the hot path's copy; the control plane keeps its own).
struct Job {
  uint32_t numWorkers = 0;
  uint32_t backups = 0;  // b: a floating SUM round closes once n - b workers pushed it
  uint32_t window = 2;  // rounds alive per key
  uint64_t staleness = 0;  // s: a MODEL key's pull of round r waits until every worker pushed round r - s
  std::string owner;  // the identity (ZAP user id) of the job's first HELLO
  std::unordered_map<uint32_t, std::string> peers;  // worker -> address of its last HELLO
  std::unordered_map<uint32_t, double> lastSeen;  // worker -> monotonic seconds of its last request
  std::vector<std::pair<uint32_t, std::string>> lost;  // (worker, how it was lost), in the order lost
  double lastRequest = 0;  // monotonic seconds of the job's last request handled natively
  JobCounters counters;

  // Name a worker the way an operator finds it: index, address, when it was last heard from.
  std::string describe(uint32_t worker, double now) const;
  void setLost(uint32_t worker, std::string how);
  void clearLost(uint32_t worker);
  bool isLost(uint32_t worker) const;
};

struct SumCounters {
  uint64_t bytesSummed = 0;
  uint64_t sumNs = 0;
  uint64_t latePushes = 0;
};

// Monotonic seconds (CLOCK_MONOTONIC: Python's time.monotonic()).
double monotonicSeconds();

class KeyRounds {
 public:
  // name: "job 0x.. key K", for error messages. job and counters must outlive this.
  KeyRounds(std::string name, const Job& job, SumCounters& counters, uint32_t mode, uint64_t nbytes, uint16_t dtype,
            CodecSpec codec = {});

  // Fold a push of `worker` into round `rnd`; return the answers to pulls it completes. Throws RoundError.
  std::vector<Answer> push(uint32_t worker, uint64_t rnd, Message&& data, uint64_t offset);
  // Answer `pull` now (the round closed and the window allows: the returned answer's status OK) or queue it until
  // `deadline` (monotonic seconds) and return false. Throws RoundError.
  bool pull(Pull&& pull, double deadline, Answer* answer);
  // The answers to pulls that freeing a round released (backups: the window moved), since the last call.
  std::vector<Answer> takeReleased() { return std::move(released_); }
  // Record that worker's push of rnd was refused: the round fails for everyone; return the waiting pulls' answers.
  std::vector<Answer> refuse(uint32_t worker, uint64_t rnd, const std::string& reason);
  // Answer every waiting pull of a round that a lost worker has not pushed (WORKER_LOST).
  std::vector<Answer> failLost();
  // Answer every pull waiting past its deadline (ROUND_TIMEOUT, naming who has not pushed).
  std::vector<Answer> expire(double now);
  // Answer every waiting pull with `status` and `message` (the key is being dropped).
  std::vector<Answer> failAll(uint16_t status, const std::string& message);
  bool hasWaiting() const;
  uint64_t floor() const { return floor_; }
  // A MODEL key: the rounds of `worker` in the total (its next round to push).
  uint64_t applied(uint32_t worker) const { return worker < applied_.size() ? applied_[worker] : 0; }

 private:
  struct Waiting {
    Pull pull;
    double deadline;
  };
  struct Piece {
    uint64_t offset, length;
    uint32_t worker;
    bool operator<(const Piece& o) const {
      return offset != o.offset ? offset < o.offset : length != o.length ? length < o.length : worker < o.worker;
    }
  };
  struct Round {
    std::vector<uint8_t> pushed, pulled;  // per worker
    uint32_t numPushed = 0, numPulled = 0;
    std::vector<Waiting> waiting;
    bool failed = false;
    std::string failure;
    bool hasTotal = false;
    bool closed = false;
    uint32_t contributors = 0;  // how many pushes the result holds
    Message total;
    std::vector<Piece> pieces;  // COPY
    std::vector<float> wide;  // fp16/bf16 SUM of 3+ workers: the sum so far in fp32; a compressed key: CodecKey::add
  };

  Round& live(uint64_t rnd, uint32_t worker, const char* what);
  uint32_t needed() const;  // pushes that close a round
  uint32_t window() const { return job_.backups ? job_.window : 2; }
  bool released(uint64_t rnd) const { return !job_.backups || rnd + 2 <= floor_ + job_.window; }
  void close(Round& r, uint64_t rnd);
  Answer release(Waiting& w, Round& r);
  void markPushed(Round& r, uint32_t worker);
  void markPulled(Round& r, uint32_t worker);
  std::string lostBefore(const Round& r) const;  // "" if none
  std::string what(const char* verb, uint64_t rnd, uint32_t worker) const;
  void add(Round& r, Message&& data, uint32_t contributors);  // the round's pushes with this one
  // Accumulators go back to the key when their round closes: at most a window of rounds is alive, so a key holds at
  // most that many, allocated once (fresh big buffers page-fault on every round).
  std::vector<float> takeAccumulator();
  void giveAccumulator(std::vector<float>&& wide);
  void write(Round& r, Message&& data, uint64_t offset, uint32_t worker);
  std::string untiled(const Round& r, uint64_t rnd) const;
  Answer result(Pull&& pull, const Round& r) const;
  void freeDone();
  std::string behind(uint64_t rnd) const;  // why a closed round's pull waits: who has not pulled the floor

  // A MODEL key's rules (model.cpp).
  std::vector<Answer> pushModel(uint32_t worker, uint64_t rnd, Message&& data);
  bool pullModel(Pull&& pull, double deadline, Answer* answer);
  std::vector<Answer> refuseModel(uint32_t worker, uint64_t rnd, const std::string& reason);
  std::vector<Answer> expireModel(double now);
  void releaseModel();  // answer the waiting pulls whose rounds the total now holds
  bool modelReady(uint64_t rnd, uint32_t worker) const;
  uint64_t slowest() const;  // the fewest rounds a worker that is not lost has in the total
  Answer snapshot(Pull&& pull) const;

  std::string name_;
  const Job& job_;
  SumCounters& counters_;
  uint32_t mode_;
  uint64_t nbytes_;
  uint16_t dtype_;
  bool widened_;  // a SUM key of fp16 or bf16
  uint64_t floor_ = 0;
  std::vector<std::vector<float>> spare_;
  std::map<uint64_t, Round> rounds_;
  std::vector<Answer> released_;
  // MODEL: the running total (zeros until the first push), each worker's rounds in it, the waiting pulls, and each
  // worker's refused push (round, why) that its pull of that round reports.
  Message total_;
  std::vector<uint64_t> applied_;
  std::vector<Waiting> waiting_;
  std::unordered_map<uint32_t, std::pair<uint64_t, std::string>> refused_;
  std::unique_ptr<CodecKey> codec_;  // a compressed key's
};

// "job 0x.. key K": how error messages name a key.
std::string jobKeyName(uint64_t jobId, uint64_t key);

}  // namespace bps::server
