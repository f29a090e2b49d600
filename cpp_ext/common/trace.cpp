// TraceBuffer: see trace.h.
#include "common/trace.h"

#include <ATen/ATen.h>

#include <ctime>
#include <utility>

namespace bps {

int64_t realtimeNs() {
  timespec ts;
  clock_gettime(CLOCK_REALTIME, &ts);
  return static_cast<int64_t>(ts.tv_sec) * 1000000000LL + ts.tv_nsec;
}

void TraceBuffer::record(const TraceEvent& event) {
  std::lock_guard<std::mutex> lock(mutex_);
  if (events_.size() < capacity_) {
    events_.push_back(event);
  } else {
    ++dropped_;
  }
}

at::Tensor TraceBuffer::take(size_t capacity, uint64_t* dropped) {
  std::vector<TraceEvent> taken;
  {
    std::lock_guard<std::mutex> lock(mutex_);
    taken.swap(events_);
    events_.reserve(capacity);  // allocated here, off the recording thread's path
    capacity_ = capacity;
    *dropped = std::exchange(dropped_, 0);
    on_.store(capacity > 0, std::memory_order_relaxed);
  }
  constexpr int64_t kColumns = 8;
  at::Tensor out = at::empty({static_cast<int64_t>(taken.size()), kColumns}, at::kLong);
  int64_t* row = out.data_ptr<int64_t>();
  for (const TraceEvent& e : taken) {
    row[0] = e.tNs;
    row[1] = e.durNs;
    row[2] = static_cast<int64_t>(e.id);
    row[3] = static_cast<int64_t>(e.key);
    row[4] = static_cast<int64_t>(e.round);
    row[5] = static_cast<int64_t>(e.bytes);
    row[6] = e.peer;
    row[7] = e.kind;
    row += kColumns;
  }
  return out;
}

}  // namespace bps
