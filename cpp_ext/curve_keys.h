// CURVE keys of a client (ZeroMQ's CurveZMQ: every connection authenticated and encrypted). Keys are
// Z85 text, 40 characters; torch_bps/security.py derives them from the job's secret or a pool credential.
#pragma once

#include <string>
#include <vector>

namespace bps {

// The keys of one connection. serverKey empty: no CURVE (the server must run with --auth off).
struct LinkKeys {
  std::string publicKey;  // this client's
  std::string secretKey;  // this client's
  std::string serverKey;  // the server's public key: the handshake fails unless the server holds its secret
  bool enabled() const { return !serverKey.empty(); }
};

// A client's keys for all of its servers: one key pair, one server key per server (empty: no CURVE).
struct CurveKeys {
  std::string publicKey;
  std::string secretKey;
  std::vector<std::string> serverKeys;

  LinkKeys forServer(size_t i) const {
    return i < serverKeys.size() ? LinkKeys{publicKey, secretKey, serverKeys[i]} : LinkKeys{};
  }
};

}  // namespace bps
