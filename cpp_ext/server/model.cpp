// KeyRounds of a MODEL key (see rounds.h): asynchronous training's running total, each worker's pushes added in
// its round order and exactly once. torch_bps/_reference/model.py states the same rules; the error texts are its
// texts, character for character.
#include <algorithm>
#include <cstring>
#include <ctime>
#include <limits>

#include "server/rounds.h"
#include "server/sums.h"

namespace bps::server {

uint64_t KeyRounds::slowest() const {
  uint64_t least = std::numeric_limits<uint64_t>::max();  // every worker lost: nobody holds anyone back
  for (uint32_t w = 0; w < applied_.size(); ++w) {
    if (!job_.isLost(w)) least = std::min(least, applied_[w]);
  }
  return least;
}

bool KeyRounds::modelReady(uint64_t rnd, uint32_t worker) const {
  // The worker's own push of rnd is in, and every other worker's push of rnd - s (rnd + 1 - s rounds each).
  uint64_t s = job_.staleness;
  return applied_[worker] > rnd && (s > rnd || slowest() >= rnd + 1 - s);
}

Answer KeyRounds::snapshot(Pull&& pull) const {
  // A copy: the total changes with the next push, while this answer may wait in a queue.
  const Header& h = pull.header;
  Answer answer{std::move(pull), kOk, "", Message()};
  if (!h.length) return answer;
  answer.data = Message::ofSize(h.length);
  if (total_.size()) {
    std::memcpy(answer.data.data(), total_.data() + h.offset, h.length);
  } else {
    std::memset(answer.data.data(), 0, h.length);
  }
  return answer;
}

std::vector<Answer> KeyRounds::pushModel(uint32_t worker, uint64_t rnd, Message&& data) {
  uint64_t next = applied_[worker];
  if (rnd < next) return {};  // a resent push: acknowledged, never added twice
  if (rnd > next) {
    throw RoundError{kBadRound, what("push", rnd, worker) +
                                    formatText(": its round %llu was never pushed (a worker's pushes are added in "
                                               "order, each once)",
                                               static_cast<unsigned long long>(next))};
  }
  timespec start, end;
  clock_gettime(CLOCK_MONOTONIC, &start);
  if (!total_.size()) {
    total_ = std::move(data);  // the first push as it arrived: the total starts at zero
  } else {
    addInPlace(dtype_, total_.data(), data.data(), data.size());
    clock_gettime(CLOCK_MONOTONIC, &end);
    counters_.sumNs +=
        static_cast<uint64_t>((end.tv_sec - start.tv_sec) * 1000000000LL + (end.tv_nsec - start.tv_nsec));
    counters_.bytesSummed += data.size();
  }
  ++applied_[worker];
  refused_.erase(worker);
  releaseModel();
  return std::move(released_);
}

bool KeyRounds::pullModel(Pull&& pull, double deadline, Answer* answer) {
  uint32_t worker = pull.header.worker;
  uint64_t rnd = pull.header.round;
  auto refused = refused_.find(worker);
  if (refused != refused_.end() && refused->second.first == rnd) {
    throw RoundError{kKeyMismatch, what("pull", rnd, worker) + ": " + refused->second.second};
  }
  if (rnd > applied_[worker]) {
    throw RoundError{kBadRound, what("pull", rnd, worker) +
                                    formatText(": this worker pushed only rounds below %llu (a pull follows its own "
                                               "push)",
                                               static_cast<unsigned long long>(applied_[worker]))};
  }
  if (modelReady(rnd, worker)) {
    *answer = snapshot(std::move(pull));
    return true;
  }
  for (const auto& w : waiting_) {
    if (w.pull.header.worker == worker) {  // keeps waiting pulls <= workers
      throw RoundError{kBadRound, what("pull", rnd, worker) + ": this worker's pull of it already waits"};
    }
  }
  waiting_.push_back(Waiting{std::move(pull), deadline});
  return false;
}

void KeyRounds::releaseModel() {
  std::vector<Waiting> keep;
  for (auto& w : waiting_) {
    if (modelReady(w.pull.header.round, w.pull.header.worker)) {
      released_.push_back(snapshot(std::move(w.pull)));
    } else {
      keep.push_back(std::move(w));
    }
  }
  waiting_ = std::move(keep);
}

std::vector<Answer> KeyRounds::refuseModel(uint32_t worker, uint64_t rnd, const std::string& reason) {
  // Only that worker's update is refused: the others' go on. Its pull of that round reports why.
  refused_[worker] = {rnd, reason};
  std::vector<Answer> failed;
  std::vector<Waiting> keep;
  for (auto& w : waiting_) {
    if (w.pull.header.worker == worker && w.pull.header.round == rnd) {
      std::string message = what("pull", rnd, worker) + ": " + reason;
      failed.push_back(Answer{std::move(w.pull), kKeyMismatch, std::move(message), Message()});
    } else {
      keep.push_back(std::move(w));
    }
  }
  waiting_ = std::move(keep);
  return failed;
}

std::vector<Answer> KeyRounds::expireModel(double now) {
  std::vector<Answer> expired;
  std::vector<Waiting> keep;
  for (auto& w : waiting_) {
    if (w.deadline > now) {
      keep.push_back(std::move(w));
      continue;
    }
    uint32_t worker = w.pull.header.worker;
    uint64_t rnd = w.pull.header.round, s = job_.staleness;
    std::string message = what("pull", rnd, worker);
    if (applied_[worker] <= rnd) {
      message += ": this worker's own push of it never arrived";
    } else {  // s <= rnd here: the bound holds it
      uint64_t need = rnd - s;
      std::string who;
      uint32_t missing = 0;
      for (uint32_t v = 0; v < applied_.size(); ++v) {
        if (job_.isLost(v) || applied_[v] > need) continue;
        who += (missing++ ? "; " : "") + job_.describe(v, now);
      }
      message += formatText(": it waits until every worker pushed round %llu (staleness %llu): %u have not (stalled "
                            "or hung?): ",
                            static_cast<unsigned long long>(need), static_cast<unsigned long long>(s), missing) +
                 who;
    }
    expired.push_back(Answer{std::move(w.pull), kRoundTimeout, std::move(message), Message()});
  }
  waiting_ = std::move(keep);
  return expired;
}

}  // namespace bps::server
