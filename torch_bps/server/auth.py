"""Who may talk to a summation server: a ZeroMQ security mechanism on the ROUTER, a ZAP handler, and jobs
bound to identities.

- `ServerSecurity.configure` makes the server's ROUTER a PLAIN server (mechanism "token": a client's identity
  and token, checked once per connection) or a CURVE server (mechanism "curve": every connection also
  encrypted) and returns a `ZapHandler`: libzmq asks the server's ZAP socket, once per connection and
  before a single frame reaches the server's code, whether the client may in, and the server's loop thread
  answers with `ZapHandler.answer`. A peer that fails gets no frame and changes nothing. Two policies
  (torch_bps/security.py): an embedded server accepts exactly its job's client identity; a pool server
  accepts any identity that proves it holds the pool credential (a token made with it; or, under CURVE,
  completing the handshake with the server key that derives from it).
- The accepted identity becomes the connection's ZAP user id, which libzmq attaches to every frame the
  connection delivers ("User-Id"). `JobGuard` binds each job id to the user id that said the job's first
  HELLO; a request of a job bound to another user id is refused as if the job did not exist, so it learns
  nothing about the job (no key sizes, no rounds). The server's native core applies the same binding to
  PUSH and PULL and hands every request that fails it to the control plane, where JobGuard answers.

May import: the standard library, pyzmq, torch_bps.wire, torch_bps.errors and torch_bps.security.
"""

from __future__ import annotations

import hmac
import logging

import zmq
from zmq.utils import z85

from torch_bps.errors import ProtocolError
from torch_bps.security import MECHANISMS, derive, token
from torch_bps.wire import Command, Header, Status

log = logging.getLogger("torch_bps.server")

ZAP_DOMAIN = b"torch_bps"


class ZapHandler:
    """Answers libzmq's ZAP requests: a client gets in if `security.admit` accepts its credentials.

    Called by the server's loop thread (the ZAP socket is one of the sockets it polls).
    """

    def __init__(self, security: ServerSecurity):
        self.security = security
        self.refused = 0

    def answer(self, request: list[bytes]) -> list[bytes]:
        """Return the ZAP reply to one request (RFC 27 frames)."""
        if len(request) < 6:
            return [b"1.0", b"", b"500", b"malformed ZAP request", b"", b""]
        version, request_id, domain, address, _identity, mechanism, *credentials = request
        identity = None
        if version == b"1.0" and domain == ZAP_DOMAIN:
            identity = self.security.admit(mechanism, credentials)
        if identity:
            return [b"1.0", request_id, b"200", b"OK", identity, b""]
        self.refused += 1
        log.info("refused a connection from %s (mechanism %s)", address.decode(errors="replace"), mechanism)
        return [b"1.0", request_id, b"400", b"not allowed", b"", b""]


class ServerSecurity:
    """How a server authenticates: from a job secret (embedded) or a pool credential (dedicated pool),
    with mechanism "token" or "curve" (torch_bps/security.py).

    Example:
        sec = ServerSecurity.for_job(job_secret); server = SummationServer("10.0.0.5", 0, security=sec)
    """

    def __init__(self, secret: str, allowed: frozenset[bytes] | None, kind: str, mechanism: str = "token"):
        if mechanism not in MECHANISMS:
            raise ValueError(f"mechanism {mechanism!r}: use one of {MECHANISMS}")
        self._secret = secret
        self._key_pair = derive(secret, "server")
        self.allowed = allowed  # the client identities that may in; None: any that proves the secret
        self.kind = kind  # "job" or "pool", for logs
        self.mechanism = mechanism

    @classmethod
    def for_job(cls, job_secret: str, mechanism: str = "token") -> ServerSecurity:
        """An embedded server: only the clients of the job with this secret get in."""
        return cls(job_secret, frozenset({derive(job_secret, "client").public}), "job", mechanism)

    @classmethod
    def for_pool(cls, credential: str, mechanism: str = "token") -> ServerSecurity:
        """A pool server: any client holding the pool credential gets in; jobs are kept apart by JobGuard."""
        return cls(credential, None, "pool", mechanism)

    def admit(self, mechanism: bytes, credentials: list[bytes]) -> bytes | None:
        """The identity (ZAP user id) of a client that proved itself with credentials, else None."""
        if mechanism == b"PLAIN" and self.mechanism == "token" and len(credentials) == 2:
            identity, proof = credentials
            if not hmac.compare_digest(proof, token(self._secret, identity)):
                return None
        elif mechanism == b"CURVE" and self.mechanism == "curve" and len(credentials) == 1:
            # libzmq completed the handshake: the client knows the server key, which derives from the secret
            identity = z85.encode(credentials[0]) if len(credentials[0]) == 32 else b""
        else:
            return None
        return identity if identity and (self.allowed is None or identity in self.allowed) else None

    def configure(self, core) -> ZapHandler:
        """Set the mechanism of the server's ROUTER and bind its ZAP socket (`core`: a torch_bps._C.ServerCore,
        before it binds); return the handler that answers the ZAP requests."""
        if self.mechanism == "curve":
            core.set_option(zmq.CURVE_SERVER, 1)
            core.set_option(zmq.CURVE_SECRETKEY, self._key_pair.secret)
        else:
            core.set_option(zmq.PLAIN_SERVER, 1)
        core.set_option(zmq.ZAP_DOMAIN, ZAP_DOMAIN)
        core.enable_zap()  # before the ROUTER binds: no connection is ever handled without it
        return ZapHandler(self)


class JobGuard:
    """Binds each job to the identity (ZAP user id) of its first HELLO; refuses the job to anyone else.

    Used by the server's loop thread only. `jobs` is the server's job table: a binding lives exactly as long as
    the job does (a forgotten job's id is free again).
    """

    def __init__(self, jobs: dict):
        self._jobs = jobs
        self._owner: dict[int, str] = {}

    def check(self, h: Header, identity: str) -> None:
        """Raise ProtocolError if h's job exists and belongs to another identity."""
        owner = self._owner.get(h.job_id)
        if owner is None or owner == identity:
            return
        if h.job_id not in self._jobs:  # forgotten: the id is free again
            del self._owner[h.job_id]
            return
        if h.command == Command.HELLO:
            raise ProtocolError(Status.UNKNOWN_JOB, f"HELLO of job {h.job_id:#x}: the job id belongs to another job")
        raise ProtocolError(Status.UNKNOWN_JOB, f"job {h.job_id:#x} has not said HELLO to this server")

    def forget(self, job_id: int) -> None:
        self._owner.pop(job_id, None)

    def bind(self, h: Header, identity: str) -> None:
        """After a successful HELLO: the job is identity's if nobody holds it."""
        if h.job_id in self._jobs and h.job_id not in self._owner:
            self._owner[h.job_id] = identity
