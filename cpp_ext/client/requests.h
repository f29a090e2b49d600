// The wire requests in flight: by request id, the op each belongs to, its command and its deadline, and the
// deadlines in order. Request ids count up from 1 per client, on every link alike.
//
// Threading: the client's IO thread only.
#pragma once

#include <cstdint>
#include <set>
#include <unordered_map>
#include <utility>

#include "client/op.h"
#include "transport/message.h"
#include "transport/stream_link.h"

namespace bps::client {

struct Request {
  OpPtr op;
  uint16_t command = 0;
  Clock::time_point deadline;
};

class Requests {
 public:
  uint64_t nextId() { return nextId_++; }

  void add(uint64_t id, Request request) {
    deadlines_.emplace(request.deadline, id);
    inflight_.emplace(id, std::move(request));
  }
  // The request `id`, or null if it is not in flight (answered, failed, never sent).
  const Request* find(uint64_t id) const {
    auto it = inflight_.find(id);
    return it == inflight_.end() ? nullptr : &it->second;
  }
  const Request& at(uint64_t id) const { return inflight_.at(id); }
  void forget(uint64_t id) {
    auto it = inflight_.find(id);
    if (it == inflight_.end()) return;
    deadlines_.erase({it->second.deadline, id});
    inflight_.erase(it);
  }

  // The request whose deadline comes first, if it is due by `now`; null otherwise.
  const Request* firstDue(Clock::time_point now) const {
    if (deadlines_.empty() || deadlines_.begin()->first > now) return nullptr;
    return &inflight_.at(deadlines_.begin()->second);
  }
  Clock::time_point nextDeadline() const {
    return deadlines_.empty() ? Clock::time_point::max() : deadlines_.begin()->first;
  }

  // Where a reply's payload may go as it is read (a link's placement): a successful PULL reply of the size its
  // request asked, to a PULL in flight to this server, goes straight into the op's destination tensor. Not with
  // failover for a partial pull: its pushed bytes are kept after the reply arrived, and must not be overwritten.
  bool placePull(size_t server, const transport::Message& head, uint64_t length, bool failover,
                 transport::Message& into) const {
    if (head.size() != transport::kHeaderSize) return false;
    uint16_t command = transport::detail::load<uint16_t>(head.data(), 6);
    uint16_t status = transport::detail::load<uint16_t>(head.data(), 8);
    if (command != (transport::kPull | transport::kReplyFlag) || status != transport::kOk) return false;
    const Request* request = find(transport::detail::load<uint64_t>(head.data(), 64));
    if (request == nullptr || request->command != transport::kPull) return false;
    const Op& op = *request->op;
    if (op.server != server || op.dst.nbytes() != length) return false;
    if (failover && !(op.pullOffset == 0 && length == op.nbytes)) return false;
    into = transport::tensorFrame(op.dst);
    return true;
  }

  // Every request in flight (for failing them all: copy what you need before failing any).
  const std::unordered_map<uint64_t, Request>& all() const { return inflight_; }

 private:
  uint64_t nextId_ = 1;
  std::unordered_map<uint64_t, Request> inflight_;
  std::set<std::pair<Clock::time_point, uint64_t>> deadlines_;
};

}  // namespace bps::client
