// See kept_rounds.h.
#include "client/kept_rounds.h"

#include <ATen/ops/empty.h>

#include <cstring>

namespace bps::client {

void KeptRounds::keep(uint64_t key, uint64_t pushOffset, const void* bytes, size_t nbytes, bool whole) {
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

KeptRound KeptRounds::round(uint64_t key) {
  std::lock_guard<std::mutex> lock(mutex_);
  auto it = kept_.find(key);
  return it == kept_.end() ? KeptRound{} : it->second.round;
}

at::Tensor KeptRounds::bytes(uint64_t key) {
  std::lock_guard<std::mutex> lock(mutex_);
  auto it = kept_.find(key);
  if (it == kept_.end()) return at::empty({0}, at::kByte);
  return it->second.bytes.defined() ? it->second.bytes.clone() : at::empty({0}, at::kByte);
}

}  // namespace bps::client
