// See jobs.h.
#include "server/jobs.h"

namespace bps::server {

using transport::kModeCopy;
using transport::kPush;

void JobTable::hello(uint64_t jobId, uint32_t worker, uint32_t numWorkers, uint32_t backups, uint32_t window,
                     uint64_t staleness, const std::string& peer, const std::string& identity) {
  auto& job = jobs_[jobId];
  if (!job) {
    job = std::make_unique<Job>();
    job->numWorkers = numWorkers;
    job->backups = backups;
    job->window = window;
    job->staleness = staleness;
    job->owner = identity;  // the job belongs to the identity of its first HELLO
  }
  job->peers[worker] = peer;
  job->lastSeen[worker] = monotonicSeconds();
  job->clearLost(worker);  // a lost worker that says HELLO again is back
}

void JobTable::touch(uint64_t jobId, uint32_t worker) {
  auto job = jobs_.find(jobId);
  if (job != jobs_.end()) job->second->lastSeen[worker] = monotonicSeconds();
}

void JobTable::declare(uint64_t jobId, uint64_t key, uint64_t nbytes, uint16_t dtype, uint32_t mode, uint32_t codec,
                       uint64_t denseBytes) {
  auto job = jobs_.find(jobId);
  if (job == jobs_.end() || keys_.count({jobId, key})) return;
  CodecSpec spec = codec ? CodecSpec::fromWord(codec, denseBytes, nbytes, key) : CodecSpec{};
  keys_.emplace(JobKey{jobId, key}, std::unique_ptr<KeyState>(new KeyState{
                                        nbytes, dtype, mode, codec,
                                        KeyRounds(jobKeyName(jobId, key), *job->second, sums_, mode, nbytes, dtype,
                                                  spec)}));
}

std::vector<Answer> JobTable::workerLost(uint64_t jobId, uint32_t worker, const std::string& how) {
  std::vector<Answer> answers;
  auto job = jobs_.find(jobId);
  if (job == jobs_.end()) return answers;
  job->second->setLost(worker, how);
  for (auto& [jobKey, key] : keys_) {
    if (jobKey.first != jobId) continue;
    for (auto& a : key->rounds.failLost()) answers.push_back(std::move(a));
    for (auto& a : key->rounds.takeReleased()) answers.push_back(std::move(a));
    track(key->rounds);
  }
  return answers;
}

std::vector<Answer> JobTable::refuse(uint64_t jobId, uint64_t key, uint32_t worker, uint64_t round,
                                     const std::string& reason) {
  std::vector<Answer> answers;
  auto job = jobs_.find(jobId);
  auto found = keys_.find({jobId, key});
  if (job == jobs_.end() || found == keys_.end() || worker >= job->second->numWorkers) return answers;
  KeyRounds& rounds = found->second->rounds;
  try {
    answers =
        rounds.refuse(worker, round, "the round failed because another worker's push was refused (" + reason + ")");
  } catch (const RoundError&) {  // the refused push named a round that is not alive: nothing to fail
  }
  for (auto& a : rounds.takeReleased()) answers.push_back(std::move(a));
  track(rounds);
  return answers;
}

std::vector<Answer> JobTable::forgetJob(uint64_t jobId, const std::string& message) {
  std::vector<Answer> answers;
  for (auto it = keys_.begin(); it != keys_.end();) {
    if (it->first.first != jobId) {
      ++it;
      continue;
    }
    for (auto& a : it->second->rounds.failAll(transport::kUnknownJob, message)) answers.push_back(std::move(a));
    waiting_.erase(&it->second->rounds);
    it = keys_.erase(it);
  }
  jobs_.erase(jobId);
  touched_.erase(jobId);
  return answers;
}

std::vector<Answer> JobTable::expire(double now) {
  std::vector<Answer> answers;
  std::vector<KeyRounds*> keys(waiting_.begin(), waiting_.end());
  for (KeyRounds* rounds : keys) {
    for (auto& a : rounds->expire(now)) answers.push_back(std::move(a));
    track(*rounds);
  }
  return answers;
}

bool JobTable::admit(const transport::Header& h, const std::string& userId, size_t payloadBytes, Job** job,
                     KeyState** key) {
  auto foundJob = jobs_.find(h.jobId);
  if (foundJob == jobs_.end() || foundJob->second->owner != userId || h.worker >= foundJob->second->numWorkers) {
    return false;
  }
  auto found = keys_.find({h.jobId, h.key});
  if (found == keys_.end()) return false;
  KeyState& k = *found->second;
  // A PUSH or PULL's `codec` is its codec word (0: none).
  if (h.nbytes != k.nbytes || h.dtype != k.dtype || h.mode != k.mode || h.codec != k.codec) return false;
  if (h.length > k.nbytes || h.offset > k.nbytes - h.length) return false;
  // A SUM or MODEL key's PUSH carries the whole key.
  if (h.command == kPush &&
      (payloadBytes != h.length || (k.mode != kModeCopy && (h.offset != 0 || h.length != k.nbytes)))) {
    return false;
  }
  *job = foundJob->second.get();
  *key = &k;
  return true;
}

void JobTable::ran(uint64_t jobId, Job& job, uint32_t worker, double now) {
  job.lastRequest = now;
  job.lastSeen[worker] = now;
  touched_.insert(jobId);
}

void JobTable::track(KeyRounds& rounds) {
  if (rounds.hasWaiting()) {
    waiting_.insert(&rounds);
  } else {
    waiting_.erase(&rounds);
  }
}

Job* JobTable::find(uint64_t jobId) {
  auto job = jobs_.find(jobId);
  return job == jobs_.end() ? nullptr : job->second.get();
}

std::vector<std::pair<uint64_t, double>> JobTable::takeTouched() {
  std::vector<std::pair<uint64_t, double>> touched;
  for (uint64_t jobId : touched_) {
    auto job = jobs_.find(jobId);
    if (job != jobs_.end()) touched.emplace_back(jobId, job->second->lastRequest);
  }
  touched_.clear();
  return touched;
}

std::vector<std::pair<uint64_t, JobCounters>> JobTable::jobCounters() const {
  std::vector<std::pair<uint64_t, JobCounters>> out;
  out.reserve(jobs_.size());
  for (const auto& [jobId, job] : jobs_) out.emplace_back(jobId, job->counters);
  return out;
}

}  // namespace bps::server
