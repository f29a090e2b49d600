// Failover's memory (ClientOptions::failover): per key, the rounds this client completed and what its last
// completed round may still owe the other workers (a copy of its whole result when it pulled the whole key,
// else of the bytes it pushed).
//
// Threading: keep() on the IO thread when a round completes; the rest from any thread; one mutex.
#pragma once

#include <ATen/core/Tensor.h>
#include <ATen/ops/empty.h>

#include <cstdint>
#include <cstring>
#include <mutex>
#include <unordered_map>

#include "client/options.h"

namespace bps::client {

class KeptRounds {
 public:
  // A round of `key` completed: keep nbytes at `bytes` (whole: its whole result; else its pushed bytes, which go
  // at pushOffset in the key).
  void keep(uint64_t key, uint64_t pushOffset, const void* bytes, size_t nbytes, bool whole) {
    std::lock_guard<std::mutex> lock(mutex_);
    Kept& kept = kept_[key];
    ++kept.round.completed;
    kept.round.whole = whole;
    kept.round.pushOffset = pushOffset;
    if (!kept.bytes.defined() || static_cast<size_t>(kept.bytes.numel()) != nbytes) {
      kept.bytes = at::empty({static_cast<int64_t>(nbytes)}, at::kByte);
    }
    if (nbytes > 0) std::memcpy(kept.bytes.data_ptr(), bytes, nbytes);
  }

  // The key's completed rounds (0 for a key never completed).
  KeptRound round(uint64_t key) {
    std::lock_guard<std::mutex> lock(mutex_);
    auto it = kept_.find(key);
    return it == kept_.end() ? KeptRound{} : it->second.round;
  }

  // A copy of what its last completed round kept (uint8; empty if nothing).
  at::Tensor bytes(uint64_t key) {
    std::lock_guard<std::mutex> lock(mutex_);
    auto it = kept_.find(key);
    if (it == kept_.end()) return at::empty({0}, at::kByte);
    return it->second.bytes.defined() ? it->second.bytes.clone() : at::empty({0}, at::kByte);
  }

 private:
  struct Kept {
    KeptRound round;
    // One buffer per key, overwritten each round: a fresh buffer per round would fault in new pages for every
    // pulled byte.
    at::Tensor bytes;
  };
  std::mutex mutex_;
  std::unordered_map<uint64_t, Kept> kept_;
};

}  // namespace bps::client
