// See shared_ring.h.
#include "transport/shared_ring.h"

#include <fcntl.h>
#include <sys/mman.h>
#include <sys/stat.h>
#include <unistd.h>

#include <atomic>
#include <cerrno>
#include <cinttypes>
#include <cstring>

#include "common/errors.h"

namespace bps::transport {
namespace {

// The control page: the worker-to-server ring's consumed position, then (a cache line on) the other's.
constexpr size_t kControlBytes = 4096;
constexpr size_t kTotalBytes = kControlBytes + 2 * kSharedRingBytes;
constexpr uint64_t kRing = kSharedRingBytes;

uint64_t loadAcquire(uint64_t* at) { return std::atomic_ref<uint64_t>(*at).load(std::memory_order_acquire); }
void storeRelease(uint64_t* at, uint64_t value) { std::atomic_ref<uint64_t>(*at).store(value, std::memory_order_release); }

// Where a frame of n bytes starts when the previous one ended at `end`: there, or at the ring's next start if it
// would not fit before the ring's end. Both sides apply it to the same sequence of frames.
uint64_t frameStart(uint64_t end, size_t n) {
  uint64_t offset = end % kRing;
  return offset + n > kRing ? end + (kRing - offset) : end;
}

uint8_t* mapShared(int fd, std::string* why) {
  void* base = mmap(nullptr, kTotalBytes, PROT_READ | PROT_WRITE, MAP_SHARED, fd, 0);
  if (base == MAP_FAILED) {
    *why = std::string("cannot map the shared rings: ") + std::strerror(errno);
    return nullptr;
  }
  madvise(base, kTotalBytes, MADV_DONTFORK);  // a forked child (a DataLoader worker) does not need them
  return static_cast<uint8_t*>(base);
}

}  // namespace

SharedRings::SharedRings(int fd, uint8_t* base, bool creator) : fd_(fd), base_(base) {
  uint8_t* toServer = base + kControlBytes;
  uint8_t* toWorker = toServer + kSharedRingBytes;
  auto* toServerConsumed = reinterpret_cast<uint64_t*>(base);
  auto* toWorkerConsumed = reinterpret_cast<uint64_t*>(base + 64);
  out_ = creator ? toServer : toWorker;
  in_ = creator ? toWorker : toServer;
  outConsumed_ = creator ? toServerConsumed : toWorkerConsumed;
  inConsumed_ = creator ? toWorkerConsumed : toServerConsumed;
}

SharedRings::~SharedRings() {
  munmap(base_, kTotalBytes);
  ::close(fd_);
}

std::unique_ptr<SharedRings> SharedRings::create(std::string* why) {
  int fd = memfd_create("torch_bps-stream", MFD_CLOEXEC | MFD_ALLOW_SEALING);
  if (fd < 0) {
    *why = std::string("memfd_create: ") + std::strerror(errno);
    return nullptr;
  }
  if (ftruncate(fd, kTotalBytes) != 0 || fcntl(fd, F_ADD_SEALS, F_SEAL_SHRINK | F_SEAL_GROW | F_SEAL_SEAL) != 0) {
    *why = std::string("cannot size and seal the shared rings: ") + std::strerror(errno);
    return own(fd, nullptr, true);
  }
  return own(fd, mapShared(fd, why), true);
}

std::unique_ptr<SharedRings> SharedRings::adopt(int fd, std::string* why) {
  struct stat st{};
  int seals = fcntl(fd, F_GET_SEALS);
  if (seals < 0 || !(seals & F_SEAL_SHRINK)) {
    *why = "the peer's shared memory is not sealed against shrinking";
    return own(fd, nullptr, false);
  }
  if (fstat(fd, &st) != 0 || static_cast<uint64_t>(st.st_size) != kTotalBytes) {
    *why = formatText("the peer's shared memory is %lld bytes, not %zu", static_cast<long long>(st.st_size), kTotalBytes);
    return own(fd, nullptr, false);
  }
  return own(fd, mapShared(fd, why), false);
}

std::unique_ptr<SharedRings> SharedRings::own(int fd, uint8_t* base, bool creator) {
  if (!base) {
    ::close(fd);
    return nullptr;
  }
  return std::unique_ptr<SharedRings>(new SharedRings(fd, base, creator));
}

SharedRings::Put SharedRings::put(const void* data, size_t n, std::string* why) {
  uint64_t consumed = loadAcquire(outConsumed_);
  if (consumed > tail_ || tail_ - consumed > kRing) {
    *why = formatText("the peer says it consumed its shared ring to %" PRIu64 ", but %" PRIu64 " were written",
                      consumed, tail_);
    return Put::kBroken;
  }
  // Room: the frame must not reach the oldest byte the peer has not consumed, one ring on. With nothing
  // unconsumed, the bytes skipped to start at the ring's beginning are free as well.
  uint64_t start = frameStart(tail_, n);
  if (n > kRing || (consumed < tail_ && start + n - consumed > kRing)) return Put::kFull;
  std::memcpy(out_ + start % kRing, data, n);
  tail_ = start + n;  // the length word goes out after this, by a system call: the bytes are there before it
  return Put::kDone;
}

bool SharedRings::take(void* into, size_t n, std::string* why) {
  if (n > kRing) {
    *why = formatText("a shared frame of %zu bytes, longer than the ring (%zu)", n, kSharedRingBytes);
    return false;
  }
  uint64_t start = frameStart(head_, n);
  std::atomic_thread_fence(std::memory_order_acquire);
  std::memcpy(into, in_ + start % kRing, n);
  head_ = start + n;
  storeRelease(inConsumed_, head_);
  return true;
}

}  // namespace bps::transport
