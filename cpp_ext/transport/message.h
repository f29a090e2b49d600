// Message: a zmq_msg_t owned by value, the unit of bytes the server's rounds and both ends of a stream
// (stream_conn.h) hold. Its bytes may be shared by reference count (share()), never copied.
//
#pragma once

#include <zmq.h>

#include <cstddef>
#include <cstdint>
#include <cstring>

#include "common/errors.h"

namespace bps::transport {

// A zmq_msg_t owned by value: closed on destruction, moved without copying bytes.
class Message {
 public:
  Message() { zmq_msg_init(&msg_); }
  ~Message() { zmq_msg_close(&msg_); }
  Message(Message&& other) noexcept {
    zmq_msg_init(&msg_);
    zmq_msg_move(&msg_, &other.msg_);
  }
  Message& operator=(Message&& other) noexcept {
    if (this != &other) zmq_msg_move(&msg_, &other.msg_);  // releases what this held
    return *this;
  }
  Message(const Message&) = delete;
  Message& operator=(const Message&) = delete;

  // A message of n bytes, uninitialized; throws Error(kTransport) when out of memory.
  static Message ofSize(size_t n) {
    Message m;
    if (zmq_msg_init_size(m.get(), n) != 0) {
      throw Error(ErrorKind::kTransport, formatText("out of memory for a message of %zu bytes", n));
    }
    return m;
  }
  // A message holding a copy of [data, data + n).
  static Message copyOf(const void* data, size_t n) {
    Message m = ofSize(n);
    if (n) std::memcpy(m.data(), data, n);
    return m;
  }
  // Another handle on the same bytes (zmq_msg_copy: shared by reference count, nothing copied).
  Message share() const {
    Message m;
    zmq_msg_copy(m.get(), const_cast<zmq_msg_t*>(&msg_));
    return m;
  }

  uint8_t* data() { return static_cast<uint8_t*>(zmq_msg_data(&msg_)); }
  const uint8_t* data() const { return static_cast<const uint8_t*>(zmq_msg_data(const_cast<zmq_msg_t*>(&msg_))); }
  size_t size() const { return zmq_msg_size(const_cast<zmq_msg_t*>(&msg_)); }
  zmq_msg_t* get() { return &msg_; }

 private:
  zmq_msg_t msg_;
};

}  // namespace bps::transport
