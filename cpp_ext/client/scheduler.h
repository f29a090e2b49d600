// The client's scheduling and credit, run by its IO thread: which push_pull goes next and when.
//
// - Per key, one round in flight: a key's next push_pull waits until the previous round's PULL reply arrived
//   (the protocol keeps at most two rounds alive per key), and the key's first round sends INIT first.
// - Batch parts wait in one priority queue (credit_queue.h: higher priority first, then submission order); a
//   part goes when its bytes fit in the credit (ClientOptions::creditBytes, and serverCreditBytes per server)
//   or nothing is in flight. Its credit returns when the server acknowledges its PUSH (or the part fails), never
//   later: a sum waits for the other workers, whose clients may have picked other partitions first, so holding
//   credit until the pull would let workers wait on each other forever.
// - With ClientOptions::autoCredit the credit is sized from the acknowledged pushes (credit_sizer.h).
//
// Threading: the IO thread only, but stats() may be read from any thread.
#pragma once

#include <atomic>
#include <deque>
#include <optional>
#include <unordered_map>
#include <vector>

#include "client/credit_queue.h"
#include "client/credit_sizer.h"
#include "client/op.h"
#include "client/options.h"

namespace bps::client {

class Scheduler {
 public:
  Scheduler(const ClientOptions& options, size_t servers);

  // A batch part waits for credit.
  void queue(const OpPtr& op);
  // Credit admits a part now.
  bool ready() const { return credit_.ready(); }
  // The next part the credit admits (holding its credit from now on), or null.
  OpPtr admit();

  // Take the op's key for its round: false if a round of the key is in flight (the op waits for it). Sets the
  // op's round; `init`: the key's first round, which sends INIT first.
  bool takeKey(const OpPtr& op, bool* init);
  // The op's round ended: the key is free; returns the op that waited for it (null if none, or if !next).
  OpPtr releaseKey(const Op& op, bool next);
  // The round a push_pull of `key` would get now (for naming it in an error).
  uint64_t nextRound(uint64_t key) { return keys_[key].nextRound; }

  // A batch part's PUSH left.
  void pushSent(Op& op);
  // The server acknowledged a batch part's PUSH.
  void pushAcknowledged() { ++partsAcknowledged_; }
  // The op's push ended (once): its credit returns; `acknowledged`: its server has it (the sizer counts only those).
  void pushEnded(Op& op, bool acknowledged);
  // One of the IO thread's waits returned something to do.
  void countWakeup() { ioWakeups_.fetch_add(1, std::memory_order_relaxed); }

  // Every op still waiting (for credit or for its key), taken out.
  std::vector<OpPtr> drain();

  SchedulerStats stats() const;

 private:
  struct KeyState {
    uint64_t nextRound = 0;
    bool initSent = false;
    bool busy = false;  // a round is in flight
    std::deque<OpPtr> waiting;
  };

  bool autoCredit_;
  std::unordered_map<uint64_t, KeyState> keys_;
  CreditQueue<OpPtr> credit_;
  CreditSizer creditSizer_;  // used with autoCredit_
  std::atomic<int64_t> pushBytesInFlight_{0};
  std::atomic<int64_t> peakPushBytesInFlight_{0};
  std::atomic<uint64_t> partsSent_{0};
  std::atomic<uint64_t> partsAcknowledged_{0};
  std::vector<int64_t> serverPushBytesInFlight_;  // IO thread only
  std::atomic<int64_t> peakServerPushBytesInFlight_{0};
  std::atomic<uint64_t> ioWakeups_{0};
};

}  // namespace bps::client
