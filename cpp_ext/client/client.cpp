// See client.h. This file holds what callers' threads run: construction, close, submissions, hello().
// The IO thread's side is client_io.cpp.
#include "client/client.h"

#include <ATen/ops/empty.h>

#include <sys/eventfd.h>
#include <unistd.h>

#include <cerrno>
#include <cinttypes>
#include <cstring>

#include "transport/buffer_cache.h"

namespace bps::client {
namespace {

std::atomic<int> openClients{0};  // the last one to close releases the cached receive buffers

// Seconds to a clock duration; absurd values (inf, 1e30) are clamped so deadlines never overflow.
std::chrono::steady_clock::duration toDuration(double seconds) {
  constexpr double kLongest = 1e8;  // three years
  double clamped = seconds > 0 ? (seconds < kLongest ? seconds : kLongest) : 0.0;
  return std::chrono::duration_cast<std::chrono::steady_clock::duration>(std::chrono::duration<double>(clamped));
}

// The automatic credit's bounds and the sender's scheduling jitter it covers (credit_sizer.h). 8 ms: at 2 Gbit/s on
// the emulated cluster a 1 MiB credit (4 ms of the link) starved k = 4 and 2 MiB (8 ms) did not.
constexpr int64_t kMinAutoCredit = 256 << 10, kMaxAutoCredit = 64 << 20;
constexpr double kAutoCreditJitterSeconds = 0.008;

}  // namespace

Client::Client(ClientOptions options, CompletionHandler onComplete, LinkDownHandler onLinkDown)
    : options_(std::move(options)),
      onComplete_(std::move(onComplete)),
      onLinkDown_(std::move(onLinkDown)),
      timeout_(toDuration(options_.timeoutSeconds)),
      credit_(options_.creditBytes, options_.serverCreditBytes),
      creditSizer_(kMinAutoCredit, kMaxAutoCredit, kAutoCreditJitterSeconds) {
  size_t n = options_.servers.size();
  if (n == 0) throw Error(ErrorKind::kValue, "no servers given");
  if (options_.creditBytes <= 0) {
    throw Error(ErrorKind::kValue, formatText("credit_bytes must be positive, got %" PRId64, options_.creditBytes));
  }
  if (options_.serverCreditBytes < 0 || options_.socketBufferBytes < 0) {
    throw Error(ErrorKind::kValue, formatText("server_credit_bytes (%" PRId64 ") and socket_buffer_bytes (%d) must not "
                                              "be negative (0: no limit, the kernel's buffers)",
                                              options_.serverCreditBytes, options_.socketBufferBytes));
  }
  if (!options_.receiveBufferBytes.empty() && options_.receiveBufferBytes.size() != n) {
    throw Error(ErrorKind::kValue, formatText("receive_buffer_bytes has %zu entries for %zu servers",
                                              options_.receiveBufferBytes.size(), n));
  }
  for (int bytes : options_.receiveBufferBytes) {
    if (bytes < 0) throw Error(ErrorKind::kValue, formatText("receive_buffer_bytes has %d: must not be negative", bytes));
  }
  if (options_.worker >= options_.numWorkers) {
    throw Error(ErrorKind::kValue,
                formatText("worker %u is not below num_workers %u", options_.worker, options_.numWorkers));
  }
  // Big pulls would otherwise fault in fresh pages for every reply (see buffer_cache.h). If the patch
  // cannot be installed the client still works, only slower for big messages.
  installBufferCache();
  context_ = zmq_ctx_new();
  wakeFd_ = eventfd(0, EFD_NONBLOCK | EFD_CLOEXEC);
  if (context_ == nullptr || wakeFd_ < 0) {
    if (context_ != nullptr) zmq_ctx_term(context_);
    throw Error(ErrorKind::kTransport, std::string("cannot create the client's context: ") + std::strerror(errno));
  }
  try {
    for (size_t i = 0; i < n; ++i) {
      std::string monitor = formatText("inproc://bps-monitor-%p-%zu", static_cast<void*>(this), i);
      links_.push_back(std::make_unique<ZmqLink>(context_, options_.servers[i], monitor,
                                                    options_.heartbeatIntervalSeconds,
                                                    options_.heartbeatTimeoutSeconds, options_.auth.forServer(i),
                                                    options_.socketBufferBytes));
    }
  } catch (...) {
    links_.clear();
    zmq_ctx_term(context_);
    ::close(wakeFd_);
    throw;
  }
  for (size_t i = 0; i < n; ++i) {
    streams_.push_back(std::make_unique<StreamLink>(options_.servers[i]));
    streams_[i]->setPlacement([this, i](const Message& head, uint64_t length, Message& into) {
      return placePull(i, head, length, into);
    });
  }
  placingRequest_.assign(n, 0);
  streamForHello_.assign(n, false);
  incarnations_.assign(n, 0);
  ioIncarnations_.assign(n, 0);
  linkStates_.assign(n, LinkState{});
  serverPushBytesInFlight_.assign(n, 0);
  ioThread_ = std::thread([this] { ioLoop(); });
  ++openClients;
}

Client::~Client() { close(); }

void Client::close() {
  {
    std::lock_guard<std::mutex> lock(submitMutex_);
    if (closing_) return;  // closed already, or closing on another thread (maybe from a callback)
    closing_ = true;
  }
  wake();
  ioThread_.join();  // the IO thread fails everything outstanding and closes its sockets on the way out
  pool_.shutdown();  // runs those completions
  zmq_ctx_term(context_);  // every socket is closed by now, so this returns at once
  ::close(wakeFd_);
  if (--openClients == 0) releaseCachedBuffers();
}

void Client::submit(std::vector<OpPtr> ops) {
  bool wasEmpty;
  {
    std::lock_guard<std::mutex> lock(submitMutex_);
    if (closing_) throw Error(ErrorKind::kClosed, "the torch_bps client is closed");
    if (!ioFailure_.empty()) throw Error(ErrorKind::kTransport, "the torch_bps client failed: " + ioFailure_);
    wasEmpty = submitted_.empty();
    for (auto& op : ops) submitted_.push_back(std::move(op));
  }
  // The IO thread takes the whole queue per wake-up: only the first submission needs to wake it.
  if (wasEmpty) wake();
}

void Client::wake() {
  uint64_t one = 1;
  ssize_t written = ::write(wakeFd_, &one, sizeof(one));
  (void)written;  // EAGAIN means the counter is already non-zero: the IO thread wakes anyway
}

std::vector<uint64_t> Client::hello(double timeoutSeconds) {
  size_t n = links_.size();
  {
    std::lock_guard<std::mutex> lock(stateMutex_);
    if (helloPending_ != 0) throw Error(ErrorKind::kValue, "hello() is already running on another thread");
    helloPending_ = n;
    helloErrors_.assign(n, ErrorInfo{});
  }
  auto timeout = toDuration(timeoutSeconds);
  for (size_t i = 0; i < n; ++i) {
    auto op = std::make_shared<Op>();
    op->kind = kHello;
    op->server = i;
    op->timeout = timeout;
    try {
      submit({op});
    } catch (const Error&) {
      // Closed meanwhile: wait for the HELLOs already submitted (close() fails them), then report.
      std::unique_lock<std::mutex> lock(stateMutex_);
      helloPending_ -= n - i;
      helloDone_.wait(lock, [this] { return helloPending_ == 0; });
      throw;
    }
  }
  std::unique_lock<std::mutex> lock(stateMutex_);
  // Every HELLO ends: answered, past its deadline, disconnected, or failed by close(). Every stream its reply
  // opened ends too: ready, failed, or past its own deadline (kStreamOpenTimeout), or closed with the client.
  helloDone_.wait(lock, [this] { return helloPending_ == 0 && streamsOpening_ == 0; });
  std::string silent;
  for (size_t i = 0; i < n; ++i) {
    const ErrorInfo& e = helloErrors_[i];
    if (e.kind == ErrorKind::kTimeout) {
      silent += (silent.empty() ? "" : ", ") + links_[i]->address();
      if (!links_[i]->everConnected()) silent += " (never connected)";
    } else if (!e.ok()) {
      throw Error(e);
    }
  }
  if (!silent.empty()) {
    throw Error(ErrorKind::kTimeout,
                formatText("no HELLO reply within %g s from server(s) %s (job 0x%016" PRIx64 ", worker %u of %u)",
                       timeoutSeconds, silent.c_str(), options_.jobId, options_.worker, options_.numWorkers));
  }
  return incarnations_;
}

Client::OpPtr Client::makePushOp(uint64_t token, PartSpec part) const {
  if (part.server >= links_.size()) {
    throw Error(ErrorKind::kValue,
                formatText("server index %zu is out of range: %zu servers", part.server, links_.size()));
  }
  const at::Tensor& src = part.src;
  const at::Tensor& dst = part.dst;
  if (!src.is_contiguous() || !dst.is_contiguous() || !src.is_cpu() || !dst.is_cpu()) {
    throw Error(ErrorKind::kValue, "push_pull needs contiguous CPU tensors");
  }
  // The server refuses these too; refusing here names the caller's mistake before anything is sent.
  uint64_t keyBytes = part.keyBytes;
  bool fits = part.pushOffset <= keyBytes && src.nbytes() <= keyBytes - part.pushOffset &&
              part.pullOffset <= keyBytes && dst.nbytes() <= keyBytes - part.pullOffset;
  if (!fits || (part.mode == kModeSum && (part.pushOffset != 0 || src.nbytes() != keyBytes)) ||
      (part.mode != kModeSum && part.mode != kModeCopy)) {
    throw Error(ErrorKind::kValue,
                formatText("push_pull of key %" PRIu64 " (%" PRIu64 " bytes, mode %u): push of %zu bytes at %" PRIu64
                           ", pull of %zu bytes at %" PRIu64 " do not fit (a SUM key takes whole-key pushes)",
                           part.key, keyBytes, static_cast<unsigned>(part.mode), src.nbytes(), part.pushOffset,
                           dst.nbytes(), part.pullOffset));
  }
  auto op = std::make_shared<Op>();
  op->kind = kPush;
  op->token = token;
  op->server = part.server;
  op->key = part.key;
  op->dtype = part.dtype;
  op->mode = part.mode;
  op->nbytes = keyBytes;
  op->src = std::move(part.src);
  op->dst = std::move(part.dst);
  op->pushOffset = part.pushOffset;
  op->pullOffset = part.pullOffset;
  op->timeout = timeout_;
  return op;
}

void Client::pushPull(uint64_t token, size_t server, uint64_t key, uint16_t dtype, Mode mode, uint64_t keyBytes,
                      at::Tensor src, uint64_t pushOffset, at::Tensor dst, uint64_t pullOffset,
                      uint64_t pushedToken) {
  OpPtr op = makePushOp(
      token, PartSpec{server, key, dtype, mode, keyBytes, std::move(src), pushOffset, std::move(dst), pullOffset});
  op->pushedToken = pushedToken;
  submit({std::move(op)});
}

void Client::pushPullBatch(uint64_t token, std::vector<PartSpec> parts, int64_t priority, at::Tensor outcomes) {
  if (outcomes.defined() &&
      (outcomes.scalar_type() != at::kByte || !outcomes.is_contiguous() || outcomes.numel() != int64_t(parts.size()))) {
    throw Error(ErrorKind::kValue, formatText("outcomes must be a contiguous uint8 tensor of %zu elements, one per part",
                                              parts.size()));
  }
  auto batch = std::make_shared<Batch>();
  batch->token = token;
  batch->remaining = parts.size();
  batch->outcomes = std::move(outcomes);
  if (parts.empty()) {
    pool_.post([this, token] { onComplete_(token, ErrorInfo{}); });
    return;
  }
  std::vector<OpPtr> ops;
  ops.reserve(parts.size());
  for (auto& part : parts) {
    OpPtr op = makePushOp(0, std::move(part));
    op->batch = batch;
    op->partIndex = ops.size();
    op->priority = priority;
    ops.push_back(std::move(op));
  }
  submit(std::move(ops));
}

KeptRound Client::kept(uint64_t key) {
  std::lock_guard<std::mutex> lock(keptMutex_);
  auto it = kept_.find(key);
  return it == kept_.end() ? KeptRound{} : it->second.round;
}

at::Tensor Client::keptBytes(uint64_t key) {
  std::lock_guard<std::mutex> lock(keptMutex_);
  auto it = kept_.find(key);
  if (it == kept_.end()) return at::empty({0}, at::kByte);
  return it->second.bytes.defined() ? it->second.bytes.clone() : at::empty({0}, at::kByte);
}

void Client::abandon(size_t server, const std::string& why) {
  if (server >= links_.size()) {
    throw Error(ErrorKind::kValue, formatText("server index %zu is out of range: %zu servers", server, links_.size()));
  }
  uint64_t ticket;
  {
    std::lock_guard<std::mutex> lock(submitMutex_);
    if (closing_ || !ioFailure_.empty()) return;  // nothing outstanding will ever be answered anyway
    abandons_.emplace_back(server, why);
    std::lock_guard<std::mutex> done(abandonMutex_);
    ticket = ++abandonsAsked_;
  }
  wake();
  std::unique_lock<std::mutex> lock(abandonMutex_);
  abandonDone_.wait(lock, [&] { return abandonsDone_ >= ticket; });
}

SchedulerStats Client::schedulerStats() const {
  SchedulerStats s;
  s.creditBytes = credit_.creditBytes();
  s.creditInFlight = credit_.inFlight();
  s.peakCreditInFlight = credit_.peakInFlight();
  s.queued = credit_.queued();
  s.pushBytesInFlight = pushBytesInFlight_.load();
  s.peakPushBytesInFlight = peakPushBytesInFlight_.load();
  s.partsSent = partsSent_.load();
  s.partsAcknowledged = partsAcknowledged_.load();
  s.serverCreditBytes = credit_.destinationCreditBytes();
  s.peakServerCreditInFlight = credit_.peakDestinationInFlight();
  s.peakServerPushBytesInFlight = peakServerPushBytesInFlight_.load();
  s.ioWakeups = ioWakeups_.load();
  return s;
}

void Client::stats(uint64_t token, size_t server, at::Tensor dst) {
  if (server >= links_.size()) {
    throw Error(ErrorKind::kValue, formatText("server index %zu is out of range: %zu servers", server, links_.size()));
  }
  if (dst.nbytes() != kStatsCounters * sizeof(uint64_t) || !dst.is_contiguous() || !dst.is_cpu()) {
    throw Error(ErrorKind::kValue, "stats needs a contiguous CPU tensor of 7 int64");
  }
  auto op = std::make_shared<Op>();
  op->kind = kStats;
  op->token = token;
  op->server = server;
  op->dst = std::move(dst);
  op->timeout = timeout_;
  submit({std::move(op)});
}

std::vector<uint64_t> Client::incarnations() {
  std::lock_guard<std::mutex> lock(stateMutex_);
  return incarnations_;
}

std::vector<uint64_t> Client::bytesSent() const {
  std::vector<uint64_t> out;
  for (size_t i = 0; i < links_.size(); ++i) out.push_back(links_[i]->bytesSent() + streams_[i]->bytesSent());
  return out;
}

std::vector<uint64_t> Client::bytesReceived() const {
  std::vector<uint64_t> out;
  for (size_t i = 0; i < links_.size(); ++i) out.push_back(links_[i]->bytesReceived() + streams_[i]->bytesReceived());
  return out;
}

}  // namespace bps::client
