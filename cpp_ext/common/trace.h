// A timeline recorder for one thread's events (BPS_TRACE; torch_bps/timeline/ writes the Chrome-trace JSON).
//
// The client's IO thread records its partitions' steps (queued, sent, acknowledged, pulled, failed), the server's
// loop thread its sums and wake-ups, into a fixed-size buffer of plain structs. Off (the default), mark() is one
// relaxed load and a branch. On, it stamps CLOCK_REALTIME (Python's time.time_ns(), so files of one host line up)
// and appends under a mutex nobody else holds but take(); when the buffer is full further events are counted as
// dropped, never allocated for.
//
// Thread contract: mark() from one recording thread; take() from any thread.
#pragma once

#include <ATen/core/Tensor.h>

#include <atomic>
#include <cstdint>
#include <mutex>
#include <vector>

namespace bps {

// What an event is. The numbers are part of the interface with torch_bps/timeline/events.py.
enum TraceKind : uint16_t {
  // Client, per partition (id: the operation, alive from kQueued to its end; peer: the server's index).
  kTraceQueued = 1,  // handed to the IO thread, waiting for credit (and for its key's previous round)
  kTraceSent = 2,  // its PUSH left: it took its credit
  kTraceAcked = 3,  // the server acknowledged the PUSH: the credit is back
  kTracePulled = 4,  // the sum arrived in the destination tensor
  kTraceFailed = 5,
  // Server (id: the job; peer: the worker).
  kTraceSum = 16,  // a push added into its round (durNs: the add); bytes: the push's
  kTraceStore = 17,  // a push kept or copied without adding (a round's first push, a COPY key's range)
  kTraceWake = 18,  // one wake-up of the loop: bytes = requests read (the queue it found), key = keys with pulls waiting
};

struct TraceEvent {
  int64_t tNs;  // CLOCK_REALTIME
  int64_t durNs;
  uint64_t id;
  uint64_t key;
  uint64_t round;
  uint64_t bytes;
  uint32_t peer;
  uint16_t kind;
};

// Nanoseconds of CLOCK_REALTIME.
int64_t realtimeNs();

// An event's id for an object alive across its events (a client's operation).
inline uint64_t traceId(const void* p) { return reinterpret_cast<uintptr_t>(p); }

class TraceBuffer {
 public:
  bool on() const { return on_.load(std::memory_order_relaxed); }

  // Record an event stamped now, if recording.
  void mark(uint16_t kind, uint64_t id, uint64_t key, uint64_t round, uint64_t bytes, uint32_t peer) {
    if (on()) record(TraceEvent{realtimeNs(), 0, id, key, round, bytes, peer, kind});
  }
  void record(const TraceEvent& event);

  // Return the events recorded since the last take() as an int64 tensor [n, 8] (columns: TraceEvent's fields in
  // order; u64s as their bit patterns) and start again with room for `capacity` events (0: stop recording).
  // *dropped: how many were not recorded because the buffer was full.
  at::Tensor take(size_t capacity, uint64_t* dropped);

 private:
  std::atomic<bool> on_{false};
  std::mutex mutex_;
  std::vector<TraceEvent> events_;  // reserved to capacity_: never reallocated while recording
  size_t capacity_ = 0;
  uint64_t dropped_ = 0;
};

}  // namespace bps
