// How a client proves itself to its servers; torch_bps/security.py derives every value from the job's
// secret or a pool credential. Two ZeroMQ mechanisms, chosen per connection:
// - token (ZMQ PLAIN): the client's identity and a token only holders of the server's secret can make;
//   checked by the server's ZAP handler at connect time, the connection is then trusted, not encrypted;
// - CURVE (CurveZMQ): keys (Z85 text, 40 characters); every frame authenticated and encrypted.
#pragma once

#include <string>
#include <vector>

namespace bps::transport {

// The credentials of one connection. Neither token nor server key: no authentication (--auth off).
struct LinkKeys {
  std::string publicKey;  // this client's: its identity in both mechanisms
  std::string secretKey;  // this client's CURVE secret key
  std::string serverKey;  // CURVE: the server's public key; the handshake fails unless the server holds its secret
  std::string token;      // token: the PLAIN password the server accepts for publicKey
  bool usesToken() const { return !token.empty(); }
  bool usesCurve() const { return token.empty() && !serverKey.empty(); }
};

// A client's credentials for all of its servers: one identity, and per server a token or a CURVE key.
struct ClientAuth {
  std::string publicKey;
  std::string secretKey;
  std::vector<std::string> serverKeys;  // CURVE, or empty
  std::vector<std::string> tokens;      // token, or empty

  LinkKeys forServer(size_t i) const {
    return LinkKeys{publicKey, secretKey, i < serverKeys.size() ? serverKeys[i] : "",
                    i < tokens.size() ? tokens[i] : ""};
  }
};

}  // namespace bps::transport
