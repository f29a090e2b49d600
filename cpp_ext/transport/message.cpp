// See message.h.
#include "transport/message.h"

#include <cstring>
#include <string>

#include "common/errors.h"

namespace bps::transport {

Message Message::ofSize(size_t n) {
  Message m;
  if (zmq_msg_init_size(m.get(), n) != 0) {
    throw Error(ErrorKind::kTransport, formatText("out of memory for a message of %zu bytes", n));
  }
  return m;
}

Message Message::copyOf(const void* data, size_t n) {
  Message m = ofSize(n);
  if (n) std::memcpy(m.data(), data, n);
  return m;
}

Message Message::share() const {
  Message m;
  zmq_msg_copy(m.get(), const_cast<zmq_msg_t*>(&msg_));
  return m;
}

}  // namespace bps::transport
