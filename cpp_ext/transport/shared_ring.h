// Shared memory beside a local stream (docs/protocol.md, "Shared memory on the local stream"): a worker and a
// server on one machine move a big frame's bytes through a ring in memory both map, and only its length word
// through the unix socket: two memcpys instead of the socket's copies, buffers and system calls on every byte.
//
// One sealed memfd per stream, made by the worker and passed to the server with the stream's first bytes
// (SCM_RIGHTS): a control page, then one ring per direction. Each ring has one producer, the side that sends on it,
// and one consumer. The producer copies a frame in where the last one ended (or at the ring's start when it would
// not fit before the end) and sends the frame's length word flagged kStreamShared; the consumer, reading that word,
// finds the frame where the same rule puts it, copies it out, and publishes how far it consumed. A frame that does
// not fit in the room left goes through the socket as before: nobody ever waits for the ring.
//
// The peer may be hostile: its positions are checked before use (a bad one closes the stream), a frame's place is
// computed from our own positions, the memfd must be sealed against shrinking (no SIGBUS) and of the expected size.
// What it writes into the rings can only change the bytes it sends itself.
#pragma once

#include <cstddef>
#include <cstdint>
#include <memory>
#include <string>

namespace bps::transport {

constexpr uint64_t kStreamShared = uint64_t{1} << 62;  // a frame's length word: its bytes are in the sender's ring
constexpr size_t kSharedRingBytes = size_t{8} << 20;  // each direction's ring
constexpr size_t kSharedFrameMin = 4096;  // smaller frames stay on the socket: a memcpy saves nothing there

class SharedRings {
 public:
  // The worker's side: a new memfd holding both rings, mapped. nullptr (and *why) if it cannot be made.
  static std::unique_ptr<SharedRings> create(std::string* why);
  // The server's side: map the peer's memfd (this takes `fd`, closing it on failure). nullptr (and *why) if it is
  // not one create() made: unsealed, or of another size.
  static std::unique_ptr<SharedRings> adopt(int fd, std::string* why);
  ~SharedRings();
  SharedRings(const SharedRings&) = delete;
  SharedRings& operator=(const SharedRings&) = delete;

  int fd() const { return fd_; }  // to pass to the peer

  enum class Put { kDone, kFull, kBroken };
  // Copy a frame of n bytes in (producer): kFull if the room left does not hold it (send it on the socket then),
  // kBroken if the peer's published position is impossible (*why set: close the stream).
  Put put(const void* data, size_t n, std::string* why);
  // Copy the next frame, of n bytes, out into `into` (consumer), in order, and publish that it was consumed; false
  // if n cannot be one (*why set: close the stream).
  bool take(void* into, size_t n, std::string* why);

 private:
  SharedRings(int fd, uint8_t* base, bool creator);
  // The rings over `base` (fd's mapping); nullptr with fd closed if there is none.
  static std::unique_ptr<SharedRings> own(int fd, uint8_t* base, bool creator);

  int fd_;
  uint8_t* base_;
  uint8_t* out_;  // the ring this side produces into
  const uint8_t* in_;  // the ring this side consumes
  uint64_t* outConsumed_;  // published by the peer: how far it consumed out_
  uint64_t* inConsumed_;  // published by us
  uint64_t tail_ = 0;  // producer: where the next frame may start (monotonic, mod kSharedRingBytes in the ring)
  uint64_t head_ = 0;  // consumer: the end of the last frame taken
};

}  // namespace bps::transport
