// Polling ZeroMQ sockets with plain poll(2), beside our own fds.
//
// Why not zmq_poll: for every ZeroMQ socket in the set, each call asks the socket for its events before and
// after waiting (a getpid and a poll system call each), and it polls twice when nothing is ready at once: system
// calls per wake-up grow with the sockets in the set, and they would be most of the IO thread's CPU.
//
// The rule (zmq_getsockopt(3), ZMQ_FD): the fd is only a signal that the socket's state may have changed, and
// it is edge-triggered. It is reset when the socket processes its commands, which any send, receive or
// ZMQ_EVENTS query does. So: read a socket when its fd polled readable, and until it says EAGAIN; and after
// sending on a socket, read it again before the next blocking poll (the send may have consumed the signal of
// a message that arrived meanwhile).
#pragma once

#include <zmq.h>

#include <string>

#include "common/errors.h"

namespace bps::transport {

// The fd that signals a ZeroMQ socket's state changes; throws Error(kTransport) if ZeroMQ has none for it.
inline int zmqSignalFd(void* socket, const char* what) {
  int fd = -1;
  size_t size = sizeof(fd);
  if (zmq_getsockopt(socket, ZMQ_FD, &fd, &size) != 0 || fd < 0) {
    throw Error(ErrorKind::kTransport, std::string("no ZMQ_FD for ") + what + ": " + zmq_strerror(zmq_errno()));
  }
  return fd;
}

}  // namespace bps::transport
