// See client.h. This file holds what callers' threads run; the IO thread's side is dispatcher.cpp.
#include "client/client.h"

#include <zmq.h>

#include <cerrno>
#include <cinttypes>
#include <cstring>

#include "client/dispatcher.h"
#include "transport/buffer_cache.h"

namespace bps::client {
namespace {

std::atomic<int> openClients{0};  // the last one to close releases the cached receive buffers

// Seconds to a clock duration; absurd values (inf, 1e30) are clamped so deadlines never overflow.
Clock::duration toDuration(double seconds) {
  constexpr double kLongest = 1e8;  // three years
  double clamped = seconds > 0 ? (seconds < kLongest ? seconds : kLongest) : 0.0;
  return std::chrono::duration_cast<Clock::duration>(std::chrono::duration<double>(clamped));
}

const char* modeName(Mode mode) {
  static const char* const kNames[] = {"SUM", "COPY", "MODEL"};
  return mode <= transport::kModeModel ? kNames[mode] : "an unknown mode";
}

// Why `part` does not fit its key, in its elements, or "" when it does: the push and the pull inside the key, and
// a SUM or MODEL push the whole key (a SUM part may push nothing: it only pulls). Sizes in bytes must fit int64.
std::string misfit(const PartSpec& part) {
  const int64_t keyNumel = part.keyNumel, pushed = part.tensor.numel(), pulled = part.out.numel();
  const int64_t itemSize = static_cast<int64_t>(part.tensor.element_size());
  if (part.mode > transport::kModeModel) return formatText("mode %u", static_cast<unsigned>(part.mode));
  if (keyNumel < 0 || part.offset < 0 || part.outOffset < 0 || part.denseNumel < 0 ||
      keyNumel > INT64_MAX / itemSize || part.denseNumel > INT64_MAX / 4) {
    return formatText("a size or offset out of range (push at %" PRId64 ", pull at %" PRId64 ", %" PRId64
                      " dense elements)",
                      part.offset, part.outOffset, part.denseNumel);
  }
  if (part.offset > keyNumel || pushed > keyNumel - part.offset) {
    return formatText("a push of %" PRId64 " elements at element %" PRId64 " ends past the key's %" PRId64, pushed,
                      part.offset, keyNumel);
  }
  if (part.outOffset > keyNumel || pulled > keyNumel - part.outOffset) {
    return formatText("a pull of %" PRId64 " elements into out at element %" PRId64 " ends past the key's %" PRId64,
                      pulled, part.outOffset, keyNumel);
  }
  bool whole = part.offset == 0 && pushed == keyNumel;
  if (part.mode != transport::kModeCopy && !whole && !(part.mode == transport::kModeSum && pushed == 0)) {
    return formatText("a push of %" PRId64 " elements at element %" PRId64 " is not the whole key of %" PRId64
                      " (a %s key is pushed whole)",
                      pushed, part.offset, keyNumel, modeName(part.mode));
  }
  return "";
}

}  // namespace

Client::Client(ClientOptions options, CompletionHandler onComplete, LinkDownHandler onLinkDown)
    : options_(std::move(options)),
      onComplete_(std::move(onComplete)),
      onLinkDown_(std::move(onLinkDown)),
      timeout_(toDuration(options_.timeoutSeconds)),
      hello_(options_.servers.size()) {
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
  transport::installBufferCache();
  context_ = zmq_ctx_new();
  if (context_ == nullptr) {
    throw Error(ErrorKind::kTransport, std::string("cannot create the client's context: ") + std::strerror(errno));
  }
  try {
    dispatcher_ = std::make_unique<Dispatcher>(options_, timeout_, context_, this, submissions_, hello_, kept_, pool_,
                                               onComplete_, onLinkDown_);
  } catch (...) {
    dispatcher_.reset();
    zmq_ctx_term(context_);
    throw;
  }
  ioThread_ = std::thread([this] { dispatcher_->run(); });
  ++openClients;
}

Client::~Client() { close(); }

void Client::close() {
  if (!submissions_.close()) return;  // closed already, or closing on another thread (maybe from a callback)
  submissions_.wake();
  ioThread_.join();  // the IO thread fails everything outstanding and closes its links on the way out
  pool_.shutdown();  // runs those completions
  zmq_ctx_term(context_);  // every socket is closed by now, so this returns at once
  if (--openClients == 0) transport::releaseCachedBuffers();
}

void Client::checkServer(size_t server) const {
  if (server >= options_.servers.size()) {
    throw Error(ErrorKind::kValue,
                formatText("server index %zu is out of range: %zu servers", server, options_.servers.size()));
  }
}

std::vector<uint64_t> Client::hello(double timeoutSeconds) {
  size_t n = options_.servers.size();
  hello_.begin();
  auto timeout = toDuration(timeoutSeconds);
  for (size_t i = 0; i < n; ++i) {
    auto op = std::make_shared<Op>();
    op->kind = transport::kHello;
    op->server = i;
    op->timeout = timeout;
    try {
      submissions_.submit({op});
    } catch (const Error&) {
      // Closed meanwhile: wait for the HELLOs already submitted (close() fails them), then report.
      hello_.cancel(n - i);
      hello_.wait(false);
      throw;
    }
  }
  // Every HELLO ends: answered, past its deadline, disconnected, or failed by close(). Every stream its reply
  // opened ends too: ready, failed, or past its own deadline (kStreamOpenTimeout), or closed with the client.
  std::vector<ErrorInfo> errors = hello_.wait();
  const ServerLinks& links = dispatcher_->links();
  std::string silent;
  for (size_t i = 0; i < n; ++i) {
    const ErrorInfo& e = errors[i];
    if (e.kind == ErrorKind::kTimeout) {
      silent += (silent.empty() ? "" : ", ") + links.address(i);
      if (!links.everConnected(i)) silent += " (never connected)";
    } else if (!e.ok()) {
      throw Error(e);
    }
  }
  if (!silent.empty()) {
    throw Error(ErrorKind::kTimeout,
                formatText("no HELLO reply within %g s from server(s) %s (job 0x%016" PRIx64 ", worker %u of %u)",
                           timeoutSeconds, silent.c_str(), options_.jobId, options_.worker, options_.numWorkers));
  }
  return hello_.incarnations();
}

OpPtr Client::makePushOp(uint64_t token, PartSpec part, size_t index, size_t parts) const {
  checkServer(part.server);
  const at::Tensor& tensor = part.tensor;
  const at::Tensor& out = part.out;
  if (!tensor.is_contiguous() || !out.is_contiguous() || !tensor.is_cpu() || !out.is_cpu()) {
    throw Error(ErrorKind::kValue, "push_pull needs contiguous CPU tensors");
  }
  if (out.scalar_type() != tensor.scalar_type()) {  // one element size turns both into bytes
    throw Error(ErrorKind::kValue, formatText("out has dtype %s, tensor %s", c10::toString(out.scalar_type()),
                                              c10::toString(tensor.scalar_type())));
  }
  // The server refuses these too; refusing here names the caller's mistake, in its elements, before anything is sent.
  std::string problem = misfit(part);
  if (!problem.empty()) {
    throw Error(ErrorKind::kValue, formatText("push_pull of key %" PRIu64 " (part %zu of %zu, %s, %" PRId64
                                              " elements): %s",
                                              part.key, index, parts, modeName(part.mode), part.keyNumel,
                                              problem.c_str()));
  }
  const int64_t itemSize = static_cast<int64_t>(part.tensor.element_size());
  auto op = std::make_shared<Op>();
  op->kind = transport::kPush;
  op->token = token;
  op->server = part.server;
  op->key = part.key;
  op->dtype = part.dtype;
  op->mode = part.mode;
  // The wire speaks bytes; the conversion is this one.
  op->nbytes = static_cast<uint64_t>(part.keyNumel * itemSize);
  op->pushOffset = static_cast<uint64_t>(part.offset * itemSize);
  op->pullOffset = static_cast<uint64_t>(part.outOffset * itemSize);
  op->denseBytes = static_cast<uint64_t>(part.denseNumel) * sizeof(float);
  op->src = std::move(part.tensor);
  op->dst = std::move(part.out);
  op->codec = part.codec;
  op->timeout = timeout_;
  return op;
}

void Client::pushPull(uint64_t token, PartSpec part, uint64_t pushedToken) {
  OpPtr op = makePushOp(token, std::move(part), 0, 1);
  op->pushedToken = pushedToken;
  submissions_.submit({std::move(op)});
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
    OpPtr op = makePushOp(0, std::move(part), ops.size(), parts.size());
    op->batch = batch;
    op->partIndex = ops.size();
    op->priority = priority;
    ops.push_back(std::move(op));
  }
  submissions_.submit(std::move(ops));
}

KeptRound Client::kept(uint64_t key) { return kept_.round(key); }

at::Tensor Client::keptBytes(uint64_t key) { return kept_.bytes(key); }

void Client::abandon(size_t server, const std::string& why) {
  checkServer(server);
  submissions_.abandon(server, why);
}

SchedulerStats Client::schedulerStats() const { return dispatcher_->stats(); }

uint32_t Client::takeBehind() { return dispatcher_->takeBehind(); }

void Client::stats(uint64_t token, size_t server, at::Tensor dst) {
  checkServer(server);
  if (dst.nbytes() != transport::kStatsCounters * sizeof(uint64_t) || !dst.is_contiguous() || !dst.is_cpu()) {
    throw Error(ErrorKind::kValue, "stats needs a contiguous CPU tensor of 7 int64");
  }
  auto op = std::make_shared<Op>();
  op->kind = transport::kStats;
  op->token = token;
  op->server = server;
  op->dst = std::move(dst);
  op->timeout = timeout_;
  submissions_.submit({std::move(op)});
}

std::vector<uint64_t> Client::incarnations() { return hello_.incarnations(); }

std::vector<uint64_t> Client::bytesSent() const { return dispatcher_->links().bytesSent(); }

std::vector<uint64_t> Client::bytesReceived() const { return dispatcher_->links().bytesReceived(); }

bool Client::streamReady(size_t server) const {
  checkServer(server);
  return dispatcher_->links().stream(server).ready();
}

bool Client::streamLocal(size_t server) const {
  return streamReady(server) && dispatcher_->links().stream(server).local();
}

bool Client::streamShared(size_t server) const {
  return streamReady(server) && dispatcher_->links().stream(server).shared();
}

std::vector<uint64_t> Client::streamSharedBytes() const {
  std::vector<uint64_t> out;
  for (size_t i = 0; i < options_.servers.size(); ++i) out.push_back(dispatcher_->links().stream(i).sharedBytes());
  return out;
}

std::vector<uint64_t> Client::streamBytesSent() const {
  std::vector<uint64_t> out;
  for (size_t i = 0; i < options_.servers.size(); ++i) out.push_back(dispatcher_->links().stream(i).bytesSent());
  return out;
}

std::vector<uint64_t> Client::streamBytesReceived() const {
  std::vector<uint64_t> out;
  for (size_t i = 0; i < options_.servers.size(); ++i) out.push_back(dispatcher_->links().stream(i).bytesReceived());
  return out;
}

TraceBuffer& Client::trace() { return dispatcher_->trace(); }

}  // namespace bps::client
