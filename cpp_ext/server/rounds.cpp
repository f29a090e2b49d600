// KeyRounds: the native rounds of one key (see rounds.h; torch_bps/_reference/rounds.py is the reference,
// and the error texts are its texts, character for character).
#include "server/rounds.h"

#include <ATen/ATen.h>

#include <algorithm>
#include <cstring>
#include <ctime>
#include <utility>

#include "server/sums.h"

namespace bps::server {

namespace {

std::string hex(uint64_t value) { return formatText("0x%llx", static_cast<unsigned long long>(value)); }

uint64_t monotonicNs() {
  timespec ts;
  clock_gettime(CLOCK_MONOTONIC, &ts);
  return static_cast<uint64_t>(ts.tv_sec) * 1000000000ULL + static_cast<uint64_t>(ts.tv_nsec);
}

}  // namespace

double monotonicSeconds() {
  timespec ts;
  clock_gettime(CLOCK_MONOTONIC, &ts);
  return static_cast<double>(ts.tv_sec) + static_cast<double>(ts.tv_nsec) * 1e-9;
}

std::string Job::describe(uint32_t worker, double now) const {
  for (const auto& [w, how] : lost) {
    if (w == worker) return how;
  }
  auto peer = peers.find(worker);
  if (peer == peers.end()) return formatText("worker %u (never said HELLO to this server)", worker);
  auto seen = lastSeen.find(worker);
  double ago = seen == lastSeen.end() ? 0.0 : now - seen->second;
  return formatText("worker %u (at %s, last request %.1f s ago)", worker, peer->second.c_str(), ago);
}

void Job::setLost(uint32_t worker, std::string how) {
  for (auto& item : lost) {
    if (item.first == worker) {  // keeps its place, as the reference's dict does
      item.second = std::move(how);
      return;
    }
  }
  lost.emplace_back(worker, std::move(how));
}

void Job::clearLost(uint32_t worker) {
  lost.erase(std::remove_if(lost.begin(), lost.end(), [&](const auto& item) { return item.first == worker; }),
             lost.end());
}

bool Job::isLost(uint32_t worker) const {
  return std::any_of(lost.begin(), lost.end(), [&](const auto& item) { return item.first == worker; });
}

KeyRounds::KeyRounds(std::string name, const Job& job, SumCounters& counters, uint32_t mode, uint64_t nbytes,
                     uint16_t dtype, CodecSpec codec)
    : name_(std::move(name)),
      job_(job),
      counters_(counters),
      mode_(mode),
      nbytes_(nbytes),
      dtype_(dtype),
      widened_(mode == kModeSum && sumsWidened(dtype)),
      codec_(codec.id != kCodecNone ? std::make_unique<CodecKey>(codec) : nullptr) {
  if (mode == kModeModel) applied_.assign(job.numWorkers, 0);
}

std::string KeyRounds::what(const char* verb, uint64_t rnd, uint32_t worker) const {
  return formatText("%s of %s round %llu by worker %u", verb, name_.c_str(), static_cast<unsigned long long>(rnd),
                    worker);
}

KeyRounds::Round& KeyRounds::live(uint64_t rnd, uint32_t worker, const char* verb) {
  if (rnd < floor_) {
    throw RoundError{kBadRound, what(verb, rnd, worker) +
                                    formatText(": round already completed and freed (oldest live round is %llu)",
                                               static_cast<unsigned long long>(floor_))};
  }
  if (rnd - floor_ >= window()) {
    auto f = static_cast<unsigned long long>(floor_);
    std::string most = window() == 2 ? "two" : std::to_string(window());
    throw RoundError{kBadRound, what(verb, rnd, worker) +
                                    formatText(": at most %s rounds may be alive and the oldest live round is %llu "
                                               "(every worker must pull round %llu first)",
                                               most.c_str(), f, f)};
  }
  auto it = rounds_.find(rnd);
  if (it == rounds_.end()) {
    it = rounds_.emplace(rnd, Round{}).first;
    it->second.pushed.assign(job_.numWorkers, 0);
    it->second.pulled.assign(job_.numWorkers, 0);
  }
  return it->second;
}

void KeyRounds::markPushed(Round& r, uint32_t worker) {
  if (!r.pushed[worker]) {
    r.pushed[worker] = 1;
    ++r.numPushed;
  }
  if (r.failed && r.numPushed >= needed()) r.closed = true;  // a failed round closes (and frees) as usual
}

void KeyRounds::markPulled(Round& r, uint32_t worker) {
  if (!r.pulled[worker]) {
    r.pulled[worker] = 1;
    ++r.numPulled;
  }
}

uint32_t KeyRounds::needed() const {
  bool floating = dtype_ >= 1 && dtype_ <= 4;  // float32, float64, float16, bfloat16: a mean can be rescaled
  return mode_ == kModeSum && floating ? job_.numWorkers - job_.backups : job_.numWorkers;
}

std::string KeyRounds::lostBefore(const Round& r) const {
  // It can never close once more workers are lost before pushing it than it may do without.
  uint32_t spare = job_.numWorkers - needed(), lost = 0;
  const std::string* first = nullptr;
  for (const auto& [w, how] : job_.lost) {
    if (w < r.pushed.size() && r.pushed[w]) continue;
    if (!first) first = &how;
    if (++lost > spare) return "the round can never close: " + *first + " before pushing it";
  }
  return "";
}

void KeyRounds::close(Round& r, uint64_t rnd) {
  r.closed = true;
  r.contributors = r.numPushed;
  if (mode_ == kModeCopy) {
    r.failure = untiled(r, rnd);
    r.failed = !r.failure.empty();
  } else if (codec_) {  // --- compressed key: the sum (scaled for a backup round) encoded once
    float scale = static_cast<float>(static_cast<double>(job_.numWorkers) / r.contributors);
    uint64_t start = monotonicNs();
    r.total = codec_->close(std::move(r.wide), rnd, scale);
    counters_.sumNs += monotonicNs() - start;  // onebit and top-k decode their pushes here (CodecKey::add)
    r.hasTotal = true;
  } else if (r.contributors < job_.numWorkers && r.hasTotal && !(widened_ && r.contributors > 1)) {
    // A backup round: the sum of c pushes, scaled to stand for n (every reader divides by n for a mean). A widened
    // sum of two or more was scaled before its rounding (add).
    at::ScalarType type = dtype_ == 1 ? at::kFloat : dtype_ == 2 ? at::kDouble : dtype_ == 3 ? at::kHalf : at::kBFloat16;
    int64_t count = static_cast<int64_t>(r.total.size() / at::elementSize(type));
    at::from_blob(r.total.data(), {count}, at::TensorOptions().dtype(type))
        .mul_(static_cast<double>(job_.numWorkers) / r.contributors);
  }
}

Answer KeyRounds::release(Waiting& w, Round& r) {
  markPulled(r, w.pull.header.worker);
  if (!r.failed) return result(std::move(w.pull), r);
  std::string message = what("pull", w.pull.header.round, w.pull.header.worker) + ": " + r.failure;
  return Answer{std::move(w.pull), kKeyMismatch, std::move(message), Message()};
}

std::vector<Answer> KeyRounds::push(uint32_t worker, uint64_t rnd, Message&& data, uint64_t offset) {
  if (mode_ == kModeModel) return pushModel(worker, rnd, std::move(data));
  Round& r = live(rnd, worker, "push");
  if (r.failed) {
    markPushed(r, worker);
    std::string message = what("push", rnd, worker) + ": " + r.failure;
    freeDone();
    throw RoundError{kKeyMismatch, std::move(message)};
  }
  if (r.pushed[worker]) return {};  // a resent push: acknowledged, never added twice
  if (r.closed) {  // a backup round closed without it: dropped, never half-added
    markPushed(r, worker);
    ++counters_.latePushes;
    return {};
  }
  if (mode_ == kModeCopy) {
    write(r, std::move(data), offset, worker);
  } else if (codec_) {  // --- compressed key: a malformed push fails its round for everyone, naming why
    std::string bad = checkPayload(codec_->spec(), data.data(), data.size());
    if (!bad.empty()) {
      std::string message = what("push", rnd, worker) + ": " + bad;
      for (auto& a : refuse(worker, rnd, message)) released_.push_back(std::move(a));
      throw RoundError{kKeyMismatch, std::move(message)};
    }
    uint64_t start = monotonicNs();
    codec_->add(r.wide, rnd, data.data());
    counters_.sumNs += monotonicNs() - start;
    counters_.bytesSummed += data.size();
  } else {
    add(r, std::move(data), r.numPushed + 1);  // this worker has not pushed it yet
  }
  markPushed(r, worker);
  if (r.numPushed < needed()) return {};
  close(r, rnd);
  std::vector<Answer> ready;
  ready.reserve(r.waiting.size());
  if (r.failed || released(rnd)) {  // else its pulls wait for the window (freeDone releases them)
    for (auto& w : r.waiting) ready.push_back(release(w, r));
    r.waiting.clear();
  }
  freeDone();  // may free r: every answer above holds its own reference to the result
  return ready;
}

bool KeyRounds::pull(Pull&& pull, double deadline, Answer* answer) {
  if (mode_ == kModeModel) return pullModel(std::move(pull), deadline, answer);
  uint32_t worker = pull.header.worker;
  uint64_t rnd = pull.header.round;
  Round& r = live(rnd, worker, "pull");
  if (r.failed) {
    markPulled(r, worker);
    std::string message = what("pull", rnd, worker) + ": " + r.failure;
    freeDone();
    throw RoundError{kKeyMismatch, std::move(message)};
  }
  if (!r.closed || !released(rnd)) {
    std::string lost = r.closed ? "" : lostBefore(r);
    if (!lost.empty()) throw RoundError{kWorkerLost, what("pull", rnd, worker) + ": " + lost};
    for (const auto& w : r.waiting) {
      if (w.pull.header.worker == worker) {  // keeps waiting pulls <= workers per round
        throw RoundError{kBadRound, what("pull", rnd, worker) + ": this worker's pull of it already waits"};
      }
    }
    r.waiting.push_back(Waiting{std::move(pull), deadline});
    return false;
  }
  markPulled(r, worker);
  *answer = result(std::move(pull), r);
  freeDone();
  return true;
}

std::vector<Answer> KeyRounds::refuse(uint32_t worker, uint64_t rnd, const std::string& reason) {
  if (mode_ == kModeModel) return refuseModel(worker, rnd, reason);
  Round& r = live(rnd, worker, "push");
  if (!r.failed) {
    r.failed = true;
    r.failure = reason;
  }
  markPushed(r, worker);
  std::vector<Answer> failed;
  for (auto& w : r.waiting) {
    markPulled(r, w.pull.header.worker);
    std::string message = what("pull", w.pull.header.round, w.pull.header.worker) + ": " + reason;
    failed.push_back(Answer{std::move(w.pull), kKeyMismatch, std::move(message), Message()});
  }
  r.waiting.clear();
  freeDone();
  return failed;
}

std::vector<Answer> KeyRounds::failLost() {
  std::vector<Answer> failed;
  if (mode_ == kModeModel) {  // a lost worker no longer holds the others back
    releaseModel();
    return failed;
  }
  if (job_.backups) freeDone();  // a lost worker's pulls are no longer awaited
  for (auto& [rnd, r] : rounds_) {
    if (r.waiting.empty() || r.closed) continue;
    std::string lost = lostBefore(r);
    if (lost.empty()) continue;
    for (auto& w : r.waiting) {
      std::string message = what("pull", rnd, w.pull.header.worker) + ": " + lost;
      failed.push_back(Answer{std::move(w.pull), kWorkerLost, std::move(message), Message()});
    }
    r.waiting.clear();
  }
  return failed;
}

std::vector<Answer> KeyRounds::expire(double now) {
  if (mode_ == kModeModel) return expireModel(now);
  std::vector<Answer> expired;
  for (auto& [rnd, r] : rounds_) {
    bool due = std::any_of(r.waiting.begin(), r.waiting.end(), [&](const Waiting& w) { return w.deadline <= now; });
    if (!due) continue;
    if (r.closed) {  // waiting for the window: name who holds the oldest round
      std::vector<Waiting> keep;
      for (auto& w : r.waiting) {
        if (w.deadline > now) {
          keep.push_back(std::move(w));
          continue;
        }
        std::string message = what("pull", rnd, w.pull.header.worker) + ": " + behind(rnd);
        expired.push_back(Answer{std::move(w.pull), kRoundTimeout, std::move(message), Message()});
      }
      r.waiting = std::move(keep);
      continue;
    }
    std::string who;
    uint32_t missing = 0;
    for (uint32_t w = 0; w < job_.numWorkers; ++w) {
      if (r.pushed[w]) continue;
      who += (missing++ ? "; " : "") + job_.describe(w, now);
    }
    std::vector<Waiting> keep;
    for (auto& w : r.waiting) {
      if (w.deadline > now) {
        keep.push_back(std::move(w));
        continue;
      }
      std::string message = what("pull", rnd, w.pull.header.worker) +
                            formatText(": the round is still waiting for %u of %u workers to push it (stalled or "
                                       "hung?): ",
                                       missing, job_.numWorkers) +
                            who;
      expired.push_back(Answer{std::move(w.pull), kRoundTimeout, std::move(message), Message()});
    }
    r.waiting = std::move(keep);
  }
  return expired;
}

std::vector<Answer> KeyRounds::failAll(uint16_t status, const std::string& message) {
  std::vector<Answer> failed;
  for (auto& [rnd, r] : rounds_) {
    for (auto& w : r.waiting) failed.push_back(Answer{std::move(w.pull), status, message, Message()});
    r.waiting.clear();
  }
  for (auto& w : waiting_) failed.push_back(Answer{std::move(w.pull), status, message, Message()});
  waiting_.clear();
  return failed;
}

bool KeyRounds::hasWaiting() const {
  return !waiting_.empty() || std::any_of(rounds_.begin(), rounds_.end(), [](const auto& item) { return !item.second.waiting.empty(); });
}

void KeyRounds::add(Round& r, Message&& data, uint32_t contributors) {
  if (!r.hasTotal) {  // the first push as it arrived: later ones are added into it, no allocation
    r.total = std::move(data);
    r.hasTotal = true;
    return;
  }
  uint64_t start = monotonicNs();
  uint8_t* total = r.total.data();
  bool closing = contributors >= needed();
  // A backup round's sum stands for n pushes (close); a widened one is scaled here, in fp32, before its rounding.
  float scale = contributors < job_.numWorkers ? static_cast<float>(static_cast<double>(job_.numWorkers) / contributors)
                                               : 1.0f;
  if (!widened_) {
    addInPlace(dtype_, total, data.data(), data.size());
  } else if (r.wide.empty() && closing) {  // two pushes: added and rounded in one pass
    sumPair(dtype_, total, data.data(), nbytes_ / 2, scale);
  } else if (r.wide.empty()) {  // the second of three or more: with the first, it makes the accumulator
    r.wide = takeAccumulator();
    widenSum(dtype_, r.wide.data(), total, data.data(), r.wide.size());
  } else if (closing) {  // the last: added, and the sum rounded into the first push's bytes, the result
    finishSum(dtype_, total, r.wide.data(), data.data(), r.wide.size(), scale);
    giveAccumulator(std::move(r.wide));
  } else {
    addWidened(dtype_, r.wide.data(), data.data(), r.wide.size());
  }
  counters_.sumNs += monotonicNs() - start;
  counters_.bytesSummed += data.size();
}

std::vector<float> KeyRounds::takeAccumulator() {
  if (spare_.empty()) return std::vector<float>(nbytes_ / 2);
  std::vector<float> wide = std::move(spare_.back());
  spare_.pop_back();
  return wide;
}

void KeyRounds::giveAccumulator(std::vector<float>&& wide) {
  if (codec_) {
    codec_->giveBack(std::move(wide));
    return;
  }
  if (!wide.empty()) spare_.push_back(std::move(wide));
  wide = {};
}

void KeyRounds::write(Round& r, Message&& data, uint64_t offset, uint32_t worker) {
  uint64_t length = data.size();
  r.pieces.push_back(Piece{offset, length, worker});
  if (!r.hasTotal && offset == 0 && length == nbytes_) {  // a broadcast's one push: kept as it arrived
    r.total = std::move(data);
    r.hasTotal = true;
    return;
  }
  if (!r.hasTotal) {
    r.total = Message::ofSize(nbytes_);  // every byte is written, or the round fails
    r.hasTotal = true;
  }
  if (length) std::memcpy(r.total.data() + offset, data.data(), length);
}

std::string KeyRounds::untiled(const Round& r, uint64_t rnd) const {
  std::vector<Piece> pieces = r.pieces;
  std::sort(pieces.begin(), pieces.end());
  uint64_t end = 0;
  bool tiled = true;
  for (const auto& p : pieces) {
    if (!p.length) continue;
    if (p.offset != end) {
      tiled = false;
      break;
    }
    end += p.length;
  }
  if (tiled && end == nbytes_) return "";
  std::string list;
  for (const auto& p : pieces) {
    if (!list.empty()) list += ", ";
    list += formatText("worker %u: [%llu, %llu)", p.worker, static_cast<unsigned long long>(p.offset),
                       static_cast<unsigned long long>(p.offset + p.length));
  }
  return formatText("the pushes of %s round %llu do not tile its %llu bytes (each byte written by exactly one "
                    "worker): ",
                    name_.c_str(), static_cast<unsigned long long>(rnd), static_cast<unsigned long long>(nbytes_)) +
         list;
}

std::string KeyRounds::behind(uint64_t rnd) const {
  auto oldest = rounds_.find(floor_);
  std::string who;
  uint32_t missing = 0;
  double now = monotonicSeconds();
  for (uint32_t w = 0; w < job_.numWorkers; ++w) {
    if (job_.isLost(w) || (oldest != rounds_.end() && oldest->second.pulled[w])) continue;
    who += (missing++ ? "; " : "") + job_.describe(w, now);
  }
  auto f = static_cast<unsigned long long>(floor_);
  return formatText("the round closed, but its result waits until every worker pulled round %llu (a worker may fall "
                    "at most %u rounds behind): %u have not: ",
                    f, job_.window - 1, missing) +
         who + formatText(" (round %llu)", static_cast<unsigned long long>(rnd));
}

Answer KeyRounds::result(Pull&& pull, const Round& r) const {
  uint64_t rnd = pull.header.round;
  uint32_t ahead = 0;
  for (auto it = rounds_.upper_bound(rnd); it != rounds_.end(); ++it) ahead += it->second.closed ? 1 : 0;
  pull.header.behind = ahead;  // the reply tells the worker how far behind it is
  const Header& h = pull.header;
  Answer answer{std::move(pull), kOk, "", Message()};
  if (!r.hasTotal) return answer;
  size_t size = r.total.size();
  if (h.offset == 0 && h.length == size) {
    answer.data = r.total.share();  // the whole result: the same bytes, shared by reference count
  } else if (h.length && h.offset <= size && h.length <= size - h.offset) {
    answer.data = Message::copyOf(r.total.data() + h.offset, h.length);
  }
  return answer;
}

void KeyRounds::freeDone() {
  // Rounds free in order: a later round fully pulled waits until the ones before it are freed.
  for (auto it = rounds_.find(floor_); it != rounds_.end() && it->second.closed; it = rounds_.find(floor_)) {
    uint32_t done = it->second.numPulled;
    if (job_.backups) {  // a lost worker will not pull: with backups the job goes on without it
      for (const auto& [w, how] : job_.lost) done += it->second.pulled[w] ? 0 : 1;
    }
    if (done < job_.numWorkers) break;
    giveAccumulator(std::move(it->second.wide));  // a failed round's
    rounds_.erase(it);
    ++floor_;
    // The window moved: pulls of closed rounds now inside it are answered.
    for (auto& [rnd, r] : rounds_) {
      if (!r.closed || r.waiting.empty() || !released(rnd)) continue;
      for (auto& w : r.waiting) released_.push_back(release(w, r));
      r.waiting.clear();
    }
  }
}

std::string jobKeyName(uint64_t jobId, uint64_t key) {
  return "job " + hex(jobId) + " key " + std::to_string(key);
}

}  // namespace bps::server
