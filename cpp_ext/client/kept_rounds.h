// Failover's memory (ClientOptions::failover): per key, the rounds this client completed and what its last
// completed round may still owe the other workers (a copy of its whole result when it pulled the whole key,
// else of the bytes it pushed).
//
// Threading: keep() on the IO thread when a round completes; the rest from any thread; one mutex.
#pragma once

#include <ATen/core/Tensor.h>

#include <cstdint>
#include <mutex>
#include <unordered_map>

#include "client/options.h"

namespace bps::client {

class KeptRounds {
 public:
  // A round of `key` completed: keep nbytes at `bytes` (whole: its whole result; else its pushed bytes, which go
  // at pushOffset in the key).
  void keep(uint64_t key, uint64_t pushOffset, const void* bytes, size_t nbytes, bool whole);
  // The key's completed rounds (0 for a key never completed).
  KeptRound round(uint64_t key);
  // A copy of what its last completed round kept (uint8; empty if nothing).
  at::Tensor bytes(uint64_t key);

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
