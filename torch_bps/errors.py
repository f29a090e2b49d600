"""The error types of torch_bps: one base class, one subclass per way things go wrong.

Messages name what was waited for: server address, job, key, round, rank.
May import: the standard library only.
"""

from __future__ import annotations


class BpsError(RuntimeError):
    """Base of every torch_bps error."""


class ConfigError(BpsError, ValueError):
    """A setting (environment variable or keyword) is missing or invalid."""


class TransportError(BpsError):
    """A peer could not be reached, or the connection to it was lost."""


class BpsTimeoutError(BpsError, TimeoutError):
    """A wait ran past its timeout."""


class ProtocolError(BpsError):
    """A message breaks the wire protocol; `status` is the wire.Status an error reply carries."""

    def __init__(self, status: int, message: str):
        super().__init__(message)
        self.status = int(status)


class ServerError(BpsError):
    """A summation server answered a request with an error status."""

    def __init__(self, status: int, message: str):
        super().__init__(message)
        self.status = int(status)
