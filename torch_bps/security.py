"""Credentials from a shared secret: how workers and summation servers prove who they are on the wire.

A *secret* is a string both sides hold. Two ZeroMQ mechanisms use it (BPS_AUTH; docs/protocol.md,
"Security"), both checked by libzmq and the server's ZAP handler before a single frame reaches the
server's code:
- **token** (the default, ZeroMQ's PLAIN mechanism): the client names its identity and a token, a MAC of
  the identity under the server's secret, at connect time; the connection is then trusted, and not
  encrypted. Only a holder of the secret can make a token, but a token crosses the wire in clear: someone
  who can read the network can reuse it (for that job only) and read the gradients anyway.
- **curve** (ZeroMQ's CURVE): every connection authenticated and encrypted, with nonces that make a
  replayed or altered frame fail; for networks you do not control. Costs CPU per byte (README).

Everything derives from a secret with no message exchanged (keyed BLAKE2b, a MAC):

    seed(secret, role) = blake2b(secret, key=b"torch_bps", person=role, digest_size=32)
    CURVE key pair of role "server" / "client": secret key = seed (Z85 text), public key = curve_public(it)
    token(secret, identity) = hex(blake2b(identity, key=seed(secret, "token"), digest_size=32))

A client's identity is the public key of its "client" key pair, in both mechanisms.

Two kinds of secret:
- a **job secret**, drawn by rank 0 into the job's rendezvous store: the job's embedded servers accept
  exactly the job's client identity;
- a **pool credential** (BPS_POOL_CREDENTIAL), which an operator gives a pool of dedicated servers and
  the jobs allowed on it: those servers accept any identity that proves it holds the credential; each
  job still connects with the identity of its own job secret, and a server binds a job id to the identity
  that first said HELLO for it, so jobs sharing a pool cannot touch each other's keys.

No secret is ever sent or printed; a token is sent (token mechanism only), a secret key never.
May import: the standard library and pyzmq.
"""

from __future__ import annotations

import hashlib
import secrets
from dataclasses import dataclass

import zmq
from zmq.utils import z85

_KEY = b"torch_bps"
JOB_SECRET_ENV = "BPS_SERVER_JOB_SECRET"  # how torch_bps.runtime hands its embedded server the job's secret


def new_secret() -> str:
    """Return a fresh random secret (43 URL-safe characters, 256 bits), e.g. for a job or a pool."""
    return secrets.token_urlsafe(32)


@dataclass(frozen=True)
class KeyPair:
    public: bytes  # 40 bytes of Z85 text, what ZMQ_CURVE_*KEY options take
    secret: bytes = b""

    def __repr__(self) -> str:  # never print a secret key
        return f"KeyPair(public={self.public.decode()})"


def derive(secret: str | bytes, role: str) -> KeyPair:
    """Derive the CURVE key pair of `role` ("server" or "client") from a shared secret.

    Example: `derive(job_secret, "client").public` is what the job's servers accept.
    """
    if role not in ("server", "client"):
        raise ValueError(f"role {role!r}: use 'server' or 'client'")
    secret_key = z85.encode(_seed(secret, role))
    return KeyPair(zmq.curve_public(secret_key), secret_key)


def token(secret: str | bytes, identity: bytes) -> bytes:
    """The token a server holding `secret` accepts from the client `identity` (mechanism "token")."""
    return hashlib.blake2b(identity, key=_seed(secret, "token"), digest_size=32).hexdigest().encode()


def _seed(secret: str | bytes, role: str) -> bytes:
    if not secret:
        raise ValueError("an empty secret authenticates nobody")
    raw = secret.encode() if isinstance(secret, str) else bytes(secret)
    return hashlib.blake2b(raw, key=_KEY, person=role.encode(), digest_size=32).digest()


MECHANISMS = ("token", "curve")  # what BPS_AUTH may be besides "off"


@dataclass(frozen=True)
class ClientCredentials:
    """What a client needs to connect with authentication: its identity and, per server, what proves it.

    `tokens[i]` is the token server i accepts (mechanism "token"); `server_keys[i]` server i's CURVE
    public key (mechanism "curve"), both in the order of the client's server list.
    """

    client: KeyPair
    server_keys: tuple[bytes, ...]
    tokens: tuple[bytes, ...]
    mechanism: str = "token"

    def __post_init__(self):
        if self.mechanism not in MECHANISMS:
            raise ValueError(f"mechanism {self.mechanism!r}: use one of {MECHANISMS}")

    @classmethod
    def _make(cls, client: KeyPair, servers: list[str], mechanism: str) -> ClientCredentials:
        public_keys = tuple(derive(s, "server").public for s in servers)
        return cls(client, public_keys, tuple(token(s, client.public) for s in servers), mechanism)

    @classmethod
    def for_servers(cls, job_secret: str, servers: list[str | None], mechanism: str = "token") -> ClientCredentials:
        """Credentials for a job: `servers[i]` is the secret server i holds (a job secret or a pool credential).
        Example: `ClientCredentials.for_servers(s, [s, s])` for two embedded servers of job secret s.
        """
        return cls._make(derive(job_secret, "client"), servers, mechanism)

    @classmethod
    def for_pool(cls, credential: str, job_id: int, num_servers: int, mechanism: str = "token") -> ClientCredentials:
        """Credentials for a job on a pool, with the job's identity derived from the credential and the job id.

        What `Client` uses when given no credentials: any holder of the credential who knows the job id can act
        as this job. The runtime instead draws a random job secret per job (`for_servers`).
        """
        return cls._make(derive(f"{credential}/job/{job_id:#x}", "client"), [credential] * num_servers, mechanism)

    def keywords(self) -> dict:
        """What the C++ client (`_C.Client`) takes of these credentials, as its keyword arguments."""
        if self.mechanism == "curve":
            return {"identity": self.client.public.decode(), "curve_secret": self.client.secret.decode(),
                    "curve_server_keys": [k.decode() for k in self.server_keys]}  # fmt: skip
        return {"identity": self.client.public.decode(), "tokens": [t.decode() for t in self.tokens]}


if __name__ == "__main__":  # `python -m torch_bps.security`: print a new pool credential
    print(new_secret())
