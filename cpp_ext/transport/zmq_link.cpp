// See zmq_link.h.
#include "transport/zmq_link.h"

#include <cerrno>
#include <cstring>
#include <utility>
#include <vector>

#include "transport/zmq_fd.h"

namespace bps::transport {
namespace {

// zmq free function of a zero-copy payload: drops the tensor reference that kept the memory alive.
void releaseTensor(void* /*data*/, void* hint) { delete static_cast<at::Tensor*>(hint); }

void setInt(void* socket, int option, int value) { zmq_setsockopt(socket, option, &value, sizeof(value)); }

std::string zmqError(const std::string& what) { return what + ": " + zmq_strerror(zmq_errno()); }

}  // namespace

ZmqLink::ZmqLink(size_t server, void* context, const std::string& address, const std::string& monitorEndpoint,
                 double heartbeatInterval, double heartbeatTimeout, const LinkCredentials& keys, int socketBufferBytes)
    : Link(server, address) {
  socket_ = zmq_socket(context, ZMQ_DEALER);
  if (socket_ == nullptr) throw Error(ErrorKind::kTransport, zmqError("cannot create a socket for " + address));
  setInt(socket_, ZMQ_LINGER, 0);
  // No high-water mark: a send must never block the IO thread; memory is bounded by what callers queue.
  setInt(socket_, ZMQ_SNDHWM, 0);
  setInt(socket_, ZMQ_RCVHWM, 0);
  setInt(socket_, ZMQ_HEARTBEAT_IVL, static_cast<int>(heartbeatInterval * 1000));
  setInt(socket_, ZMQ_HEARTBEAT_TIMEOUT, static_cast<int>(heartbeatTimeout * 1000));
  if (socketBufferBytes > 0) {
    // Applied to every TCP connection this socket opens (reconnections too), so set before connecting.
    setInt(socket_, ZMQ_SNDBUF, socketBufferBytes);
    setInt(socket_, ZMQ_RCVBUF, socketBufferBytes);
  }
  // Before connecting: the handshake of the very first connection must already use the mechanism.
  std::vector<std::pair<int, const std::string*>> options;
  if (keys.usesToken()) {
    options = {{ZMQ_PLAIN_USERNAME, &keys.identity}, {ZMQ_PLAIN_PASSWORD, &keys.token}};
  } else if (keys.usesCurve()) {
    options = {{ZMQ_CURVE_SERVERKEY, &keys.curveServerKey},
               {ZMQ_CURVE_PUBLICKEY, &keys.identity},
               {ZMQ_CURVE_SECRETKEY, &keys.curveSecret}};
  }
  for (const auto& [option, value] : options) {
    if (zmq_setsockopt(socket_, option, value->data(), value->size()) != 0) {
      std::string message = zmqError("cannot set the credentials for " + address);
      close();
      throw Error(ErrorKind::kTransport, message);
    }
  }
  bool ipv6 = address.find('[') != std::string::npos;
  if (ipv6) setInt(socket_, ZMQ_IPV6, 1);

  // The monitor must be attached before connecting, or the first CONNECTED event could be missed.
  if (zmq_socket_monitor(socket_, monitorEndpoint.c_str(), ZMQ_EVENT_CONNECTED | ZMQ_EVENT_DISCONNECTED) != 0) {
    std::string message = zmqError("cannot monitor the socket for " + address);
    close();
    throw Error(ErrorKind::kTransport, message);
  }
  monitor_ = zmq_socket(context, ZMQ_PAIR);
  if (monitor_ != nullptr) setInt(monitor_, ZMQ_LINGER, 0);
  if (monitor_ == nullptr || zmq_connect(monitor_, monitorEndpoint.c_str()) != 0) {
    std::string message = zmqError("cannot read the monitor of " + address);
    close();
    throw Error(ErrorKind::kTransport, message);
  }
  std::string endpoint = "tcp://" + address;
  if (zmq_connect(socket_, endpoint.c_str()) != 0) {
    std::string message = zmqError("cannot connect to server " + address);
    close();
    throw Error(ErrorKind::kTransport, message);
  }
  try {
    socketFd_ = zmqSignalFd(socket_, address.c_str());
    monitorFd_ = zmqSignalFd(monitor_, address.c_str());
  } catch (...) {
    close();
    throw;
  }
}

ZmqLink::~ZmqLink() { close(); }

void ZmqLink::close(const std::string& /*why*/) {
  if (socket_ != nullptr) {
    zmq_socket_monitor(socket_, nullptr, 0);
    zmq_close(socket_);
    socket_ = nullptr;
  }
  if (monitor_ != nullptr) {
    zmq_close(monitor_);
    monitor_ = nullptr;
  }
}

bool ZmqLink::sendFrames(const Header& header, const at::Tensor* payload) {
  sentSinceRead_ = true;
  zmq_msg_t head;
  zmq_msg_init_size(&head, kHeaderSize);
  packHeader(header, static_cast<uint8_t*>(zmq_msg_data(&head)));
  if (zmq_msg_send(&head, socket_, ZMQ_DONTWAIT | (payload != nullptr ? ZMQ_SNDMORE : 0)) < 0) {
    zmq_msg_close(&head);
    return false;
  }
  size_t n = 0;
  if (payload != nullptr) {
    n = payload->nbytes();
    zmq_msg_t body;
    if (n == 0) {
      zmq_msg_init(&body);
    } else {
      auto* holder = new at::Tensor(*payload);
      zmq_msg_init_data(&body, holder->data_ptr(), n, releaseTensor, holder);
    }
    // The tail of a multipart message whose first part was accepted is always accepted too.
    if (zmq_msg_send(&body, socket_, ZMQ_DONTWAIT) < 0) {
      zmq_msg_close(&body);
      return false;
    }
  }
  bytesSent_.fetch_add(kHeaderSize + n, std::memory_order_relaxed);
  return true;
}

bool ZmqLink::receive(LinkMessage& out) {
  if (zmq_msg_recv(out.header.get(), socket_, ZMQ_DONTWAIT) < 0) {
    sentSinceRead_ = false;  // that EAGAIN processed the socket's commands: its fd signals what comes next
    return false;
  }
  out.frames = 1;
  uint64_t bytes = out.header.size();
  bool more = zmq_msg_more(out.header.get());
  while (more) {
    // The rest of a multipart message is already here: ZeroMQ delivers messages whole.
    Frame part;
    if (zmq_msg_recv(part.get(), socket_, 0) < 0) break;
    ++out.frames;
    bytes += part.size();
    more = zmq_msg_more(part.get());
    if (out.frames == 2) out.payload = std::move(part);
  }
  bytesReceived_.fetch_add(bytes, std::memory_order_relaxed);
  return true;
}

LinkEvent ZmqLink::readMonitor() {
  // A monitor event is two frames: 6 bytes (u16 event, u32 value), then the endpoint.
  Frame event;
  if (zmq_msg_recv(event.get(), monitor_, ZMQ_DONTWAIT) < 0) return LinkEvent::kNothing;
  uint16_t id = 0;
  if (event.size() >= sizeof(id)) std::memcpy(&id, event.data(), sizeof(id));
  bool more = zmq_msg_more(event.get());
  while (more) {
    Frame rest;
    if (zmq_msg_recv(rest.get(), monitor_, 0) < 0) break;
    more = zmq_msg_more(rest.get());
  }
  if (id == ZMQ_EVENT_CONNECTED) {
    everConnected_.store(true);
    return LinkEvent::kConnected;
  }
  if (id == ZMQ_EVENT_DISCONNECTED) return LinkEvent::kDisconnected;
  return LinkEvent::kOther;
}

std::string ZmqLink::send(const Header& header, const at::Tensor* payload) {
  if (socket_ == nullptr) return "its link is closed";
  return sendFrames(header, payload) ? "" : zmq_strerror(zmq_errno());
}

void ZmqLink::watch(EpollSet& epoll, uint64_t kind, uint32_t slot, LinkListener& /*listener*/) {
  if (watched_ || socket_ == nullptr) return;
  epoll.add(socketFd_, linkTag(kind, slot, 0), "a DEALER's signal fd");
  epoll.add(monitorFd_, linkTag(kind, slot, 1), "a monitor's signal fd");
  watched_ = true;
}

void ZmqLink::notify(uint32_t bits, uint32_t /*events*/) {
  if (bits == 0) {
    socketSignalled_ = true;
  } else {
    monitorSignalled_ = true;
  }
}

void ZmqLink::poll(LinkListener& listener) {
  if (socket_ == nullptr) return;
  // Replies first: those that arrived before a disconnect still count. Each read runs to EAGAIN.
  if (first_ || sentSinceRead_ || socketSignalled_) {
    for (;;) {
      LinkMessage message;
      if (!receive(message)) break;
      listener.onReply(*this, Reply{message.header.data(), message.header.size(), message.payload.data(),
                                    message.payload.size(), message.frames});
    }
  }
  if (first_ || monitorSignalled_) {
    LinkEvent event;
    while ((event = readMonitor()) != LinkEvent::kNothing) {
      if (event == LinkEvent::kDisconnected) listener.onClosed(*this, "", true);
      if (event == LinkEvent::kConnected) listener.onConnected(*this);
    }
  }
  first_ = socketSignalled_ = monitorSignalled_ = false;
}

}  // namespace bps::transport
