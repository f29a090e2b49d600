// The error kinds of the C++ client. Each maps to one type in torch_bps/errors.py; python/module.cpp does the
// mapping, so nothing below this header knows about Python.
#pragma once

#include <cstdarg>
#include <cstdint>
#include <cstdio>
#include <stdexcept>
#include <string>
#include <utility>

namespace bps {

enum class ErrorKind : int {
  kNone = 0,
  kTransport = 1,  // -> TransportError: a peer is unreachable or the connection dropped
  kTimeout = 2,    // -> BpsTimeoutError: a deadline passed
  kServer = 3,     // -> ServerError(status, message): the server answered with an error status
  kProtocol = 4,   // -> ProtocolError(status, message): a reply broke the wire protocol
  kValue = 5,      // -> ValueError: bad arguments
  kClosed = 6,     // -> BpsError: the client was closed
};

// What went wrong with one request: carried from the IO thread to whoever completes the future.
struct ErrorInfo {
  ErrorKind kind = ErrorKind::kNone;
  uint16_t status = 0;  // the wire status, for kServer and kProtocol
  std::string message;

  bool ok() const { return kind == ErrorKind::kNone; }
};

// Thrown by synchronous calls; python/module.cpp translates it into the matching Python type.
class Error : public std::runtime_error {
 public:
  Error(ErrorKind kind, std::string message, uint16_t status = 0)
      : std::runtime_error(message), info_{kind, status, std::move(message)} {}
  explicit Error(ErrorInfo info) : std::runtime_error(info.message), info_(std::move(info)) {}

  const ErrorInfo& info() const { return info_; }

 private:
  ErrorInfo info_;
};

// printf into a std::string, for error messages (which stay well under the buffer).
inline std::string formatText(const char* fmt, ...) __attribute__((format(printf, 1, 2)));
inline std::string formatText(const char* fmt, ...) {
  char text[1024];
  va_list args;
  va_start(args, fmt);
  std::vsnprintf(text, sizeof(text), fmt, args);
  va_end(args);
  return text;
}

}  // namespace bps
