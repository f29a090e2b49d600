// One operation of the client as the IO thread carries it: HELLO, STATS, or push_pull of one key (INIT on the
// key's first use, then PUSH and PULL of its next round), with the wire requests still awaiting their reply.
//
// Threading: built on a caller's thread, handed over under Submissions' mutex, then touched by the IO thread
// only, until its completion runs on a CompletionPool thread (which only reads it).
#pragma once

#include <ATen/core/Tensor.h>

#include <chrono>
#include <cstdint>
#include <deque>
#include <memory>
#include <vector>

#include "common/errors.h"
#include "transport/link.h"
#include "transport/wire.h"

namespace bps::client {

using Clock = std::chrono::steady_clock;

struct Op;
using OpPtr = std::shared_ptr<Op>;

// The parts of one pushPullBatch() still to end, and its first error.
struct Batch {
  uint64_t token = 0;
  size_t remaining = 0;
  ErrorInfo error;
  std::vector<OpPtr> ended;  // released on a pool thread, with the completion
  at::Tensor outcomes;  // uint8 per part, or undefined
};

struct Op {
  transport::Command kind = transport::kPush;  // kHello, kStats, or kPush for a push_pull
  uint64_t token = 0;
  uint64_t pushedToken = 0;  // completed when the PUSH is acknowledged; 0: nobody asked
  size_t server = 0;
  uint64_t key = 0;
  uint64_t round = 0;
  uint16_t dtype = 0;
  transport::Mode mode = transport::kModeSum;
  uint64_t nbytes = 0;  // the key's size
  at::Tensor src;  // pushed at pushOffset
  at::Tensor dst;  // pulled from pullOffset
  uint64_t pushOffset = 0;
  uint64_t pullOffset = 0;
  uint32_t codec = 0;  // PartSpec's
  uint64_t denseBytes = 0;
  Clock::duration timeout{};
  std::deque<uint64_t> requests;  // ids of wire requests still awaiting their reply, in send order
  bool holdsKey = false;  // this push_pull is its key's round in flight
  bool rehello = false;  // a HELLO the IO thread sent on its own after a reconnection
  bool done = false;
  ErrorInfo error;
  std::shared_ptr<Batch> batch;  // set for a batch's part: it completes through the batch
  int64_t priority = 0;  // a batch part's
  int64_t credit = 0;  // credit bytes this part holds (taken when it left the queue, returned once)
  bool pushInFlight = false;  // its PUSH was sent and is not yet acknowledged
  size_t partIndex = 0;  // a batch part's index in its batch
  // The link all of its requests go on, in order (ServerLinks::route, when it started); null before.
  transport::Link* link = nullptr;
};

}  // namespace bps::client
