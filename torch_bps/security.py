"""CURVE keys from a shared secret: how workers and summation servers prove who they are on the wire.

The wire uses ZeroMQ's own CURVE mechanism (CurveZMQ: every connection authenticated and encrypted,
with nonces that make a replayed or altered frame fail). A *secret* is a string both sides hold; from it
each side derives, with no message exchanged, the server's key pair and the client's key pair:

    seed = blake2b(secret, key=b"torch_bps", person=role, digest_size=32)   role: b"server" or b"client"
    secret key = seed (Z85 text), public key = curve_public(secret key)

Two kinds of secret (docs/protocol.md, "Security"):
- a **job secret**, drawn by rank 0 into the job's rendezvous store: the job's embedded servers accept
  exactly the job's client key;
- a **pool credential** (BPS_POOL_CREDENTIAL), which an operator gives a pool of dedicated servers and
  the jobs allowed on it: those servers accept a client only if it knows their key, which needs the
  credential; each job still connects with the client key of its own job secret, and a server binds a
  job id to the key that first said HELLO for it, so jobs sharing a pool cannot touch each other's keys.

Neither derived key is ever sent or printed: CurveZMQ never sends the server's public key on the wire.
May import: the standard library and pyzmq.
"""

from __future__ import annotations

import hashlib
import os
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
    if not secret:
        raise ValueError("an empty secret authenticates nobody")
    raw = secret.encode() if isinstance(secret, str) else bytes(secret)
    seed = hashlib.blake2b(raw, key=_KEY, person=role.encode(), digest_size=32).digest()
    secret_key = z85.encode(seed)
    return KeyPair(zmq.curve_public(secret_key), secret_key)


@dataclass(frozen=True)
class ClientKeys:
    """What a client needs to connect under CURVE: its own key pair and each server's public key.

    `server_keys[i]` is the public key of server i (the order of the client's server list).
    """

    client: KeyPair
    server_keys: tuple[bytes, ...]

    @classmethod
    def for_servers(cls, job_secret: str, servers: list[str | None]) -> ClientKeys:
        """Keys for a job: `servers[i]` is the secret server i's key derives from (a job secret or a pool
        credential). Example: `ClientKeys.for_servers(s, [s, s])` for two embedded servers of job secret s.
        """
        return cls(derive(job_secret, "client"), tuple(derive(s, "server").public for s in servers))

    @classmethod
    def for_pool(cls, credential: str, job_id: int, num_servers: int) -> ClientKeys:
        """Keys for a job on a pool, with the job's identity derived from the credential and the job id.

        What `Client` uses when given no keys: any holder of the credential who knows the job id can act
        as this job. The runtime instead draws a random job secret per job (`for_servers`).
        """
        server = derive(credential, "server").public
        return cls(derive(f"{credential}/job/{job_id:#x}", "client"), (server,) * num_servers)

    @classmethod
    def from_environment(cls, job_id: int, num_servers: int) -> ClientKeys | None:
        """`for_pool` with BPS_POOL_CREDENTIAL, or None (plain connections) if it is unset or BPS_AUTH=off."""
        credential = os.environ.get("BPS_POOL_CREDENTIAL", "")
        if not credential or os.environ.get("BPS_AUTH", "curve") == "off":
            return None
        return cls.for_pool(credential, job_id, num_servers)


if __name__ == "__main__":  # `python -m torch_bps.security`: print a new pool credential
    print(new_secret())
