// The 128-byte message header of docs/protocol.md, packed and unpacked byte for byte as
// torch_bps/wire.py does (struct format "<IHHHHIIIII9QIIIIQ"); tests/transport/test_wire.py checks the two agree.
// Every field has one meaning: the data fields (bytes 0-103) describe a key's request, the control block (bytes
// 104-127, ps-lite's Meta.control) the job a HELLO registers and the server's stream offer; zero elsewhere.
//
// Buffer lifetime: a payload sent zero-copy must stay untouched until ZeroMQ releases it; the client
// keeps a tensor reference alive in the message's free function for exactly that.
#pragma once

#include <cstddef>
#include <cstdint>
#include <cstdio>
#include <cstring>
#include <string>

#include "common/errors.h"

namespace bps::transport {

static_assert(__BYTE_ORDER__ == __ORDER_LITTLE_ENDIAN__, "the wire is little-endian; add byte swaps here");

constexpr uint32_t kMagic = 0x31535042;  // "BPS1"
constexpr uint16_t kVersion = 3;
constexpr size_t kHeaderSize = 128;
// Bytes 0-9 (magic, version, command, status) sit where every version put them: a peer of another version is told
// so in its own framing (docs/protocol.md, "Versions").
constexpr size_t kVersionedPrefix = 10;
constexpr uint16_t kReplyFlag = 0x80;
constexpr size_t kStatsCounters = 14;  // torch_bps.wire.STATS_FIELDS

enum Command : uint16_t { kHello = 1, kInit = 2, kPush = 3, kPull = 4, kStats = 5 };

// A HELLO reply's `stream` offer: the stream port (bits 0-15), and this bit if the server also listens on its local
// stream (stream_conn.h). torch_bps.wire.STREAM_LOCAL.
constexpr uint32_t kStreamLocal = uint32_t{1} << 16;

// What a key's rounds do with pushes, fixed by its INIT: sum whole-key pushes, copy byte ranges, or add every
// worker's pushes, in order and once each, into one running total (a model trained asynchronously).
enum Mode : uint32_t { kModeSum = 0, kModeCopy = 1, kModeModel = 2 };

enum Status : uint16_t {
  kOk = 0,
  kBadFrame = 1,
  kBadVersion = 2,
  kBadCommand = 3,
  kWrongIncarnation = 4,
  kUnknownJob = 5,
  kJobMismatch = 6,
  kUnknownKey = 7,
  kKeyMismatch = 8,
  kBadRound = 9,
  kInternal = 10,
  kWorkerLost = 11,
  kRoundTimeout = 12,
  kOverQuota = 16,
};

// A HELLO's staleness bound that bounds nothing: fully asynchronous MODEL keys.
constexpr uint64_t kUnbounded = ~uint64_t{0};

// The fields in wire order; docs/protocol.md's table gives each its one meaning per command.
struct Header {
  uint16_t command = 0;
  uint16_t status = 0;
  uint16_t dtype = 0;
  uint32_t worker = 0;
  uint32_t codec = 0;  // INIT/PUSH/PULL: the key's codec word (0: uncompressed)
  uint32_t waitMs = 0;  // PULL: how long the server may hold it before answering ROUND_TIMEOUT; 0: no limit
  uint32_t mode = kModeSum;  // INIT/PUSH/PULL: the key's Mode
  uint32_t behind = 0;  // a PULL's reply: how many later rounds of the key had already closed
  uint64_t incarnation = 0;
  uint64_t jobId = 0;
  uint64_t key = 0;
  uint64_t round = 0;  // PUSH/PULL: the key's round
  uint64_t requestId = 0;
  uint64_t nbytes = 0;  // INIT/PUSH/PULL: the key's size in bytes
  uint64_t offset = 0;  // PUSH: where the payload goes in the key; PULL: first byte wanted
  uint64_t length = 0;  // PUSH: payload bytes; PULL: bytes wanted
  uint64_t denseBytes = 0;  // INIT of a compressed key: the fp32 partition's bytes its encoding stands for
  // The control block: HELLO and its reply only.
  uint32_t numWorkers = 0;  // HELLO: the job's worker count
  uint32_t backups = 0;  // HELLO: the job's backup workers b (0: none)
  uint32_t window = 0;  // HELLO: the job's live rounds per key W (0: 2)
  uint32_t stream = 0;  // HELLO reply: the stream offer (port in bits 0-15, kStreamLocal); 0: none
  uint64_t staleness = 0;  // HELLO: the job's staleness bound s for MODEL keys (kUnbounded: none)
};

namespace detail {
template <typename T>
inline void store(uint8_t* out, size_t offset, T value) {
  std::memcpy(out + offset, &value, sizeof(T));
}
template <typename T>
inline T load(const uint8_t* in, size_t offset) {
  T value;
  std::memcpy(&value, in + offset, sizeof(T));
  return value;
}
}  // namespace detail

// Write `h` into out[0..kHeaderSize).
inline void packHeader(const Header& h, uint8_t* out) {
  using detail::store;
  store<uint32_t>(out, 0, kMagic);
  store<uint16_t>(out, 4, kVersion);
  store<uint16_t>(out, 6, h.command);
  store<uint16_t>(out, 8, h.status);
  store<uint16_t>(out, 10, h.dtype);
  store<uint32_t>(out, 12, h.worker);
  store<uint32_t>(out, 16, h.codec);
  store<uint32_t>(out, 20, h.waitMs);
  store<uint32_t>(out, 24, h.mode);
  store<uint32_t>(out, 28, h.behind);
  store<uint64_t>(out, 32, h.incarnation);
  store<uint64_t>(out, 40, h.jobId);
  store<uint64_t>(out, 48, h.key);
  store<uint64_t>(out, 56, h.round);
  store<uint64_t>(out, 64, h.requestId);
  store<uint64_t>(out, 72, h.nbytes);
  store<uint64_t>(out, 80, h.offset);
  store<uint64_t>(out, 88, h.length);
  store<uint64_t>(out, 96, h.denseBytes);
  store<uint32_t>(out, 104, h.numWorkers);
  store<uint32_t>(out, 108, h.backups);
  store<uint32_t>(out, 112, h.window);
  store<uint32_t>(out, 116, h.stream);
  store<uint64_t>(out, 120, h.staleness);
}

// Parse a header frame; throw Error(kProtocol, status) with the status a server would answer. The version is read
// before the size (every version's header starts alike), so a peer of another version hears BAD_VERSION naming
// both versions, not a size.
inline Header unpackHeader(const uint8_t* in, size_t size) {
  using detail::load;
  if (size < kVersionedPrefix) {
    throw Error(ErrorKind::kProtocol,
                "header frame is " + std::to_string(size) + " bytes, expected " + std::to_string(kHeaderSize),
                kBadFrame);
  }
  uint32_t magic = load<uint32_t>(in, 0);
  if (magic != kMagic) {
    char text[48];
    std::snprintf(text, sizeof(text), "bad magic 0x%08x", magic);
    throw Error(ErrorKind::kProtocol, text, kBadFrame);
  }
  uint16_t version = load<uint16_t>(in, 4);
  if (version != kVersion) {
    throw Error(ErrorKind::kProtocol,
                "protocol version " + std::to_string(version) + ", this side speaks " + std::to_string(kVersion),
                kBadVersion);
  }
  if (size != kHeaderSize) {
    throw Error(ErrorKind::kProtocol,
                "header frame is " + std::to_string(size) + " bytes, expected " + std::to_string(kHeaderSize),
                kBadFrame);
  }
  Header h;
  h.command = load<uint16_t>(in, 6);
  h.status = load<uint16_t>(in, 8);
  h.dtype = load<uint16_t>(in, 10);
  h.worker = load<uint32_t>(in, 12);
  h.codec = load<uint32_t>(in, 16);
  h.waitMs = load<uint32_t>(in, 20);
  h.mode = load<uint32_t>(in, 24);
  h.behind = load<uint32_t>(in, 28);
  h.incarnation = load<uint64_t>(in, 32);
  h.jobId = load<uint64_t>(in, 40);
  h.key = load<uint64_t>(in, 48);
  h.round = load<uint64_t>(in, 56);
  h.requestId = load<uint64_t>(in, 64);
  h.nbytes = load<uint64_t>(in, 72);
  h.offset = load<uint64_t>(in, 80);
  h.length = load<uint64_t>(in, 88);
  h.denseBytes = load<uint64_t>(in, 96);
  h.numWorkers = load<uint32_t>(in, 104);
  h.backups = load<uint32_t>(in, 108);
  h.window = load<uint32_t>(in, 112);
  h.stream = load<uint32_t>(in, 116);
  h.staleness = load<uint64_t>(in, 120);
  return h;
}

inline const char* commandName(uint16_t command) {
  switch (command & ~kReplyFlag) {
    case kHello: return "HELLO";
    case kInit: return "INIT";
    case kPush: return "PUSH";
    case kPull: return "PULL";
    case kStats: return "STATS";
    default: return "UNKNOWN_COMMAND";
  }
}

inline const char* statusName(uint16_t status) {
  if (status == kOverQuota) return "OVER_QUOTA";
  static const char* const kNames[] = {"OK",           "BAD_FRAME",   "BAD_VERSION",  "BAD_COMMAND",
                                       "WRONG_INCARNATION", "UNKNOWN_JOB", "JOB_MISMATCH", "UNKNOWN_KEY",
                                       "KEY_MISMATCH", "BAD_ROUND",   "INTERNAL",     "WORKER_LOST",
                                       "ROUND_TIMEOUT"};
  return status < sizeof(kNames) / sizeof(kNames[0]) ? kNames[status] : "UNKNOWN_STATUS";
}

}  // namespace bps::transport
