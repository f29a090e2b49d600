"""How the workers agree on a failover (failover.py): what the Router needs from the runtime (`Agreement`), the
waits in the job's store, and the rules: pure functions, so that every rank computes the same from the same
inputs (`decide`, `place_moved`, `owner`, `recovery_part`).

May import: the standard library, torch, torch_bps.errors, wire, engine.placement.
"""

from __future__ import annotations

import hashlib
import math
from collections.abc import Callable
from dataclasses import dataclass
from datetime import timedelta

import torch

from torch_bps.engine.placement import Server
from torch_bps.errors import BpsTimeoutError
from torch_bps.wire import Mode, Partition

RECOVERY_BIT = 1 << 63  # key K's unfinished round is finished on key K | RECOVERY_BIT (KeyBook keys stay below 2**56)


# -- the rules: pure functions, so every rank computes the same from the same inputs
def decide(counts: list[dict[int, tuple[int, bool]]]) -> dict[int, tuple[int, int]]:
    """Return, per key whose round `lo` closed on a lost server, `(lo, source)`.

    counts[rank][key] = (rounds completed, whether the last one's whole result is kept) for each key the rank
    used on the lost servers. A rank pushes round r + 1 only after pulling round r, and a round closes only once
    every rank pushed it, so completed rounds differ by one at most; where they differ, round lo closed and the
    ranks at lo + 1 hold its result. source: the lowest rank at lo + 1 that kept the whole result (it broadcasts
    it), or -1: every rank pushes round lo again (those at lo + 1 from their copy of what they pushed).
    """
    seen: dict[int, list[tuple[int, bool, int]]] = {}
    for rank, mine in enumerate(counts):
        for key, (done, whole) in mine.items():
            seen.setdefault(key, []).append((done, whole, rank))
    actions = {}
    for key, entries in seen.items():
        lo, hi = min(e[0] for e in entries), max(e[0] for e in entries)
        if hi - lo > 1:
            raise RuntimeError(f"key {key:#x}: ranks completed {lo} to {hi} rounds, but they differ by one at most")
        if hi > lo:
            sources = [rank for done, whole, rank in entries if done == hi and whole]
            actions[key] = (lo, min(sources) if sources else -1)
    return actions


def place_moved(moved: dict[int, int], loads: dict[str, int], servers: list[Server]) -> dict[int, int]:
    """Where the keys of lost servers go (key -> index into `servers`): largest first, each to the server whose
    bytes (its `loads`, the keys it kept, plus what it got here) stay lowest against its weight, so that the
    whole placement comes as close to the paper's split of what remains as moving only these keys allows."""
    load = [loads.get(s.address, 0) for s in servers]
    where = {}
    for key, nbytes in sorted(moved.items(), key=lambda kv: (-kv[1], kv[0])):
        i = min(range(len(servers)), key=lambda i: ((load[i] + nbytes) / servers[i].weight, i))
        load[i] += nbytes
        where[key] = i
    return where


def owner(key: int, servers: list[Server]) -> int:
    """The server (index) a moved key no failover decision placed goes to (a key first used after it, or on
    colocated servers started during it): weighted rendezvous hashing, so every rank agrees with no message."""

    def score(i: int) -> float:
        digest = hashlib.blake2b(f"{key}/{servers[i].address}".encode(), digest_size=8).digest()
        u = (int.from_bytes(digest, "little") + 0.5) / 2**64
        return -servers[i].weight / math.log(u)

    return max(range(len(servers)), key=score)


def recovery_part(key: int, action: tuple[int, int], rank: int, completed: int, kept: torch.Tensor | None,
                  held: Partition | None, spec: tuple[int, torch.dtype, Mode],
                  push_offset: int) -> Partition:  # fmt: skip
    """This rank's part (server None) of the round that finishes `key`'s round lo, on
    key | RECOVERY_BIT. held: this rank's failed part of round lo (ranks at lo); kept: what this rank kept of
    round lo (ranks at lo + 1, uint8); spec: the key's (numel, dtype, mode); push_offset: of the kept bytes."""
    lo, source = action
    numel, dtype, mode = spec
    empty = torch.empty(0, dtype=dtype)
    if source >= 0:  # a broadcast of the kept result: a COPY round
        tensor = kept.view(dtype) if rank == source else empty
        out, out_offset = (held.out, held.out_offset) if completed == lo else (empty, 0)
        return Partition(tensor, key | RECOVERY_BIT, None, out, Mode.COPY, numel, 0, out_offset)
    if completed == lo:  # push round lo again, pull what this rank still needs
        return held._replace(key=key | RECOVERY_BIT, server=None, mode=mode, key_numel=numel)
    return Partition(kept.view(dtype), key | RECOVERY_BIT, None, empty, mode, numel, push_offset // dtype.itemsize, 0)


@dataclass
class Agreement:
    """What the router needs from the runtime to agree on a failover and act on it."""

    store: object  # the group's namespace in the job's store
    rank: int
    world_size: int
    timeout: float  # each wait of the agreement (BPS_FAILOVER_TIMEOUT)
    placement: str  # the paper's split, as configured
    own_keys: Callable[..., dict[int, tuple[int, int]]]  # (every_slice) -> {key: (epoch-0 server, bytes)}
    # (servers, job id, on_link_down[, seconds to wait for HELLO replies, default BPS_CONNECT_TIMEOUT]) -> Client
    make_client: Callable[..., object]
    standby: Callable[[int], list[str]]  # rank 0: claim up to n standby servers, return their addresses
    start_colocated: Callable[[str], list[str]]  # every rank: start fresh colocated servers under a store prefix
    available: Callable[[], tuple[list[str], list[str]]]  # rank 0: (colocated, dedicated) servers that answer now
    # whether a server takes a new job now (a draining or stalled one does not): rank 0 leaves out of a failover those
    # that do not; a rank whose client of the decided servers failed names those it cannot reach
    answers: Callable[[str], bool] = lambda address: True
    # A failover's client's wait for its servers' HELLO replies: they answered rank 0 a moment ago, and a server silent
    # for the heartbeat timeout counts as lost (BPS_HEARTBEAT_TIMEOUT)
    hello_timeout: float = 10.0


def wait_all(a: Agreement, prefix: str, what: str, timeout: float | None = None) -> list[bytes]:
    """Every rank's report under `prefix`, waiting `timeout` (default: the agreement's) for the last one."""
    keys = [f"{prefix}/{r}" for r in range(a.world_size)]
    timeout = timeout or a.timeout
    try:
        a.store.wait(keys, timedelta(seconds=timeout))
    except Exception as e:
        missing = [r for r, k in enumerate(keys) if not a.store.check([k])]
        raise BpsTimeoutError(
            f"failover: rank(s) {missing} did not report {what} within {timeout}s (BPS_FAILOVER_TIMEOUT): a rank "
            "that does not report is lost itself, or does not see the server as lost"
        ) from e
    return [a.store.get(k) for k in keys]


def wait_one(a: Agreement, key: str, what: str) -> bytes:
    try:
        a.store.wait([key], timedelta(seconds=a.timeout))
    except Exception as e:
        raise BpsTimeoutError(
            f"failover: waited {a.timeout}s (BPS_FAILOVER_TIMEOUT) for {what} (store key {key})"
        ) from e
    return a.store.get(key)
