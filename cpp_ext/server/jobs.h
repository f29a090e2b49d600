// The jobs registered on this server and their declared keys, natively: what the control plane's updates
// (HELLO, INIT, a lost worker, a refused push, a forgotten job) change, and what the hot path checks a PUSH or
// PULL against before it runs the key's rounds (rounds.h). Answers to waiting pulls that an update completes or
// fails are returned to the caller (ServerCore), which sends them.
//
// Threading: the server's loop thread only (see core.h); nothing here locks.
#pragma once

#include <cstdint>
#include <memory>
#include <string>
#include <unordered_map>
#include <unordered_set>
#include <utility>
#include <vector>

#include "server/rounds.h"

namespace bps::server {

// A declared key: its declaration and its rounds.
struct KeyState {
  uint64_t nbytes;
  uint16_t dtype;
  uint32_t mode;
  uint32_t codec;  // the codec word of a compressed key (codecs.h), 0 otherwise
  KeyRounds rounds;
};

class JobTable {
 public:
  // `sums`: where every key's rounds count their additions; must outlive this.
  explicit JobTable(SumCounters& sums) : sums_(sums) {}

  // Register (or refresh) worker `worker` of job `jobId` said HELLO from `peer`; the job is bound to `identity`
  // if it has no owner yet.
  // `backups`, `window` and `staleness` (Job's) are fixed by the job's first HELLO (the control plane checks the
  // others agree).
  void hello(uint64_t jobId, uint32_t worker, uint32_t numWorkers, uint32_t backups, uint32_t window,
             uint64_t staleness, const std::string& peer, const std::string& identity);
  void touch(uint64_t jobId, uint32_t worker);  // a request of that worker, handled by the control plane
  // A compressed key (codec != 0): `nbytes` is what travels, `denseBytes` the fp32 partition it stands for.
  void declare(uint64_t jobId, uint64_t key, uint64_t nbytes, uint16_t dtype, uint32_t mode, uint32_t codec = 0,
               uint64_t denseBytes = 0);
  // The worker's connection dropped: fail the waiting pulls of every round it has not pushed.
  std::vector<Answer> workerLost(uint64_t jobId, uint32_t worker, const std::string& how);
  // A push of the key was refused (reason: why): its round fails for every worker.
  std::vector<Answer> refuse(uint64_t jobId, uint64_t key, uint32_t worker, uint64_t round, const std::string& reason);
  // Drop the job and its keys; its waiting pulls are answered UNKNOWN_JOB with `message`.
  std::vector<Answer> forgetJob(uint64_t jobId, const std::string& message);
  // Answer every pull waiting past its deadline.
  std::vector<Answer> expire(double now);

  // The hot path: the job and key a PUSH or PULL (header h, `payloadBytes` for a PUSH) may run on natively, or
  // false: a check failed, and the control plane answers it, with keys.py's and auth.py's words.
  bool admit(const transport::Header& h, const std::string& userId, size_t payloadBytes, Job** job, KeyState** key);
  // The request ran on the key (now: monotonic seconds): keep the job's liveness and the waiting keys up to date.
  void ran(uint64_t jobId, Job& job, uint32_t worker, double now);
  void track(KeyRounds& rounds);  // keep the keys with waiting pulls up to date after rounds changed

  Job* find(uint64_t jobId);
  // (job, monotonic seconds of its last request handled natively) for every job with one since the last call.
  std::vector<std::pair<uint64_t, double>> takeTouched();
  // (job, its counters) for every job registered here.
  std::vector<std::pair<uint64_t, JobCounters>> jobCounters() const;
  // Keys with pulls waiting for their round to close.
  size_t keysWaiting() const { return waiting_.size(); }

 private:
  using JobKey = std::pair<uint64_t, uint64_t>;
  struct JobKeyHash {
    size_t operator()(const JobKey& k) const {
      return std::hash<uint64_t>()(k.first * 0x9E3779B97F4A7C15ULL ^ k.second);
    }
  };

  SumCounters& sums_;
  std::unordered_map<uint64_t, std::unique_ptr<Job>> jobs_;
  std::unordered_map<JobKey, std::unique_ptr<KeyState>, JobKeyHash> keys_;
  std::unordered_set<KeyRounds*> waiting_;  // keys with pulls waiting, for expire
  std::unordered_set<uint64_t> touched_;
};

}  // namespace bps::server
