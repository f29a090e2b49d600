// How a client proves itself to its servers: torch_bps.security.ClientCredentials, the same record under the same
// name, built by torch_bps/client.py from a job's secret or a pool credential. Two ZeroMQ mechanisms, chosen per
// connection:
// - token (ZMQ PLAIN): the client's identity and a token only holders of the server's secret can make;
//   checked by the server's ZAP handler at connect time, the connection is then trusted, not encrypted;
// - CURVE (CurveZMQ): keys (Z85 text, 40 characters); every frame authenticated and encrypted.
#pragma once

#include <string>
#include <vector>

namespace bps::transport {

// The credentials of one connection. Neither token nor server key: no authentication (--auth off).
struct LinkCredentials {
  std::string identity;  // this client's public key: its identity in both mechanisms
  std::string curveSecret;  // this client's CURVE secret key
  std::string curveServerKey;  // CURVE: the server's public key; the handshake fails unless the server holds its secret
  std::string token;  // token: the PLAIN password the server accepts for identity
  bool usesToken() const { return !token.empty(); }
  bool usesCurve() const { return token.empty() && !curveServerKey.empty(); }
};

// A client's credentials for all of its servers (torch_bps.security.ClientCredentials: `client.public`,
// `client.secret`, `server_keys`, `tokens`): one identity, and per server a token or a CURVE key.
struct ClientCredentials {
  std::string identity;
  std::string curveSecret;
  std::vector<std::string> curveServerKeys;  // CURVE, or empty
  std::vector<std::string> tokens;  // token, or empty

  LinkCredentials forServer(size_t i) const {
    return LinkCredentials{identity, curveSecret, i < curveServerKeys.size() ? curveServerKeys[i] : "",
                           i < tokens.size() ? tokens[i] : ""};
  }
};

}  // namespace bps::transport
