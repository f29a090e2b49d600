"""How the workers agree on a failover (failover.py): what the Router needs from the runtime (`Agreement`), the
waits in the job's store (`wait_all`, `wait_one`, `poll_keys`, `connect`), and the rules: functions of what every
rank sees alike, so that every rank computes the same (`decide`, `place_moved`, `owner`, `recovery_part`), or that
rank 0 computes alone and writes to the store (`plan`); and what asynchronous training's keys carry where they
move (`ModelTotals`).

May import: the standard library, torch, torch_bps.errors, wire, engine.placement.
"""

from __future__ import annotations

import hashlib
import json
import logging
import math
import os
import time
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from datetime import timedelta

import torch

from torch_bps.engine.placement import Server, server_weights
from torch_bps.errors import BpsTimeoutError, ServerError, TransportError
from torch_bps.wire import Mode, Partition

log = logging.getLogger("torch_bps")
RECOVERY_BIT = 1 << 63  # key K's unfinished round is finished on key K | RECOVERY_BIT (KeyBook keys stay below 2**56)
ATTEMPTS = 3  # agreements of one failover before it fails: each drops the servers some rank's client could not reach


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


def weights(colocated: list[str], dedicated: list[str], placement: str) -> list[Server]:
    """`server_weights`, but with every dedicated server lost the colocated fallback takes every byte whatever the
    placement (BPS_PLACEMENT=dedicated has no colocated share to give it)."""
    return server_weights(colocated, dedicated, placement if dedicated else "colocated")


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


CARRIED = (0, -1)  # the order (collective, part) of a MODEL key's carried sum and zero rounds


class ModelTotals:
    """Asynchronous training's MODEL keys through failovers and rebalances (docs/protocol.md, "Failover"), under
    the Router's lock: per key, the epoch its total lives on and the sum of this rank's updates that came back, and
    the update of its part in flight (a copy: the pull writes the total over the part's tensor). A key's first part
    on another epoch goes after that sum, then after `fill[key]` zero rounds, so that a round on the new server is
    the same step on every rank whatever step each was at (the staleness bound counts rounds)."""

    def __init__(self) -> None:
        self._totals: dict[int, tuple[int, torch.Tensor]] = {}
        self._updates: dict[int, torch.Tensor] = {}
        self.fill: dict[int, int] = {}

    def __contains__(self, key: int) -> bool:
        return key in self._totals

    def carry(self, epoch: int, group: list) -> list:
        """A batch's (order, part)s for `epoch`, each MODEL part's update kept, its carried rounds put before it."""
        out = []
        for order, part in group:
            if part.mode != Mode.MODEL or order == CARRIED:
                out.append((order, part))
                continue
            where, mine = self._totals.get(part.key) or (epoch, torch.zeros_like(part.tensor))
            if where != epoch:  # every rank's first round there is its sum, then zeros up to its own round
                out.append((CARRIED, part._replace(tensor=mine.clone(), out=torch.empty_like(mine))))
                for _ in range(self.fill.pop(part.key, 0)):
                    out.append((CARRIED, part._replace(tensor=torch.zeros_like(mine), out=torch.empty_like(mine))))
            self._totals[part.key] = (epoch, mine)
            self._updates[part.key] = part.tensor.clone()
            out.append((order, part))
        return out

    def acknowledged(self, group: list, ok: list[bool]) -> None:
        """A batch came back (`ok`: per part, whether it succeeded): each MODEL update acknowledged joins its sum."""
        for (order, part), done in zip(group, ok, strict=True):
            if done and part.mode == Mode.MODEL and order != CARRIED:
                self._totals[part.key][1].add_(self._updates.pop(part.key))


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
    # every rank: start colocated servers under a store prefix (each machine's, started ahead if it was)
    start_colocated: Callable[[str], list[str]]
    available: Callable[[], tuple[list[str], list[str]]]  # rank 0: (colocated, dedicated) servers that answer now
    # whether a server takes a new job now (a draining or stalled one does not): rank 0 leaves out of a failover those
    # that do not; a rank whose client of the decided servers failed names those it cannot reach
    answers: Callable[[str], bool] = lambda address: True
    # A failover's client's wait for its servers' HELLO replies: they answered rank 0 a moment ago, and a server silent
    # for the heartbeat timeout counts as lost (BPS_HEARTBEAT_TIMEOUT)
    hello_timeout: float = 10.0
    # Start, in the background, the colocated server `start_colocated` would start on this machine, if the job has
    # none: losing every dedicated server then costs no server start-up (tens of seconds on a loaded machine).
    colocated_ahead: Callable[[], None] = lambda: None
    release: Callable[[list[str]], None] = lambda addresses: None  # rank 0: give back claimed standbys not used


def answering(answers: Callable[[str], bool], addresses: list[str]) -> list[str]:
    """Those of `addresses` that answer, asked at once: one that does not costs its HELLO's whole timeout, and a
    registry collects many (servers killed, stopped or cut off since they registered), which asked one by one kept a
    rebalance's decision past the other ranks' wait (found by benchmarks/chaos.py)."""
    if len(addresses) < 2:
        return [address for address in addresses if answers(address)]
    with ThreadPoolExecutor(min(len(addresses), 32), thread_name_prefix="bps-answers") as pool:
        return [address for address, ok in zip(addresses, pool.map(answers, addresses), strict=True) if ok]


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


def poll_keys(a: Agreement, keys: list[str], what: str, meanwhile: Callable[[], bool]) -> None:
    """Wait for every key as `wait_all` does, but polling: between polls the store client is free for another
    agreement, and `meanwhile()` runs (True: it did something that took time, and the wait starts again)."""
    deadline = time.monotonic() + a.timeout
    while not a.store.check(keys):
        if meanwhile():
            deadline = time.monotonic() + a.timeout
        elif time.monotonic() > deadline:
            raise BpsTimeoutError(f"failover: waited {a.timeout}s (BPS_FAILOVER_TIMEOUT) for {what} (keys {keys})")
        time.sleep(0.01)


def wait_one(a: Agreement, key: str, what: str) -> bytes:
    try:
        a.store.wait([key], timedelta(seconds=a.timeout))
    except Exception as e:
        raise BpsTimeoutError(
            f"failover: waited {a.timeout}s (BPS_FAILOVER_TIMEOUT) for {what} (store key {key})"
        ) from e
    return a.store.get(key)


def plan(a: Agreement, current: list[Server], lost: set[str], spare: list[str], reports: list[dict],
         loads: dict[str, int], size: int = 0) -> dict:  # fmt: skip
    """Rank 0: a failover's decision. The servers: of those some key may live on now (`current`), the dedicated ones
    that remain and answer, standbys for the rest (`spare` first: those an agreement redone claimed already), and the
    colocated ones; a fresh job id; who finishes which open round (`decide`); where each moved key goes
    (`place_moved`) and each server's share of the bytes then. reports: every rank's counts (JSON: key ->
    [completed, whole, bytes]); loads: per server, the bytes of the keys that stay; size: the dedicated servers the
    job started with (standbys are claimed up to it: a failover that found too few leaves the next one to make up)."""
    remaining = [s.address for s in current if s.dedicated and s.address not in lost]
    gone = [s.address for s in current if s.dedicated and s.address in lost]
    # A server that remains but takes no new job (draining after a SIGTERM, or stalled and not yet noticed) would
    # fail the new epoch's client on every rank: leave it out. Its keys stay where they are until it is lost.
    dedicated = answering(a.answers, remaining)
    colocated = [s.address for s in current if not s.dedicated]
    wanted = max(len(gone) + len(remaining), size) - len(dedicated)
    spare = [address for address in spare if address not in lost][:wanted]
    claimed = spare + (a.standby(wanted - len(spare)) if wanted > len(spare) else [])
    # A standby may have died since it registered, or be stalled or still starting: one that does not answer is
    # left out, and given back for a later failover to ask again.
    standby = answering(a.answers, [address for address in dict.fromkeys(claimed) if address not in dedicated])
    a.release([address for address in claimed if address not in standby and address not in dedicated])
    dedicated += standby
    counts = [{int(k): (v[0], v[1]) for k, v in r.items()} for r in reports]
    decision = {"job_id": int.from_bytes(os.urandom(8), "little"), "dedicated": dedicated, "colocated": colocated,
                "standby": standby, "actions": {str(k): v for k, v in decide(counts).items()}, "owners": {},
                "shares": {}}  # fmt: skip
    if dedicated or colocated:  # else colocated servers are started and keys spread by `owner`
        servers = weights(colocated, dedicated, a.placement)
        moved = {int(k): v[2] for r in reports for k, v in r.items()}
        loads = dict(loads)
        decision["owners"] = {str(k): i for k, i in place_moved(moved, loads, servers).items()}
        total = sum(loads.values()) + sum(moved.values())
        for k, i in decision["owners"].items():
            loads[servers[i].address] = loads.get(servers[i].address, 0) + moved[int(k)]
        decision["shares"] = {s.address: round(loads.get(s.address, 0) / max(total, 1), 3) for s in servers}
    return decision


def connect(a: Agreement, ns: str, servers: list[Server], job_id: int, on_link_down: Callable, what: str,
            attempt: int) -> tuple[object | None, list[str]]:  # fmt: skip
    """This rank's client of the decided `servers`, once every rank's said HELLO to all of them (`up/<rank>`).
    If some rank's could not, every rank closes its own and gets (None, the servers those ranks could not reach);
    after `ATTEMPTS` agreements, a TransportError naming each rank's error. what: e.g. "torch_bps[default]:
    failover 2", for the logs."""
    client, trouble = None, None
    try:
        client = a.make_client(servers, job_id, on_link_down, a.hello_timeout)
    except (TransportError, BpsTimeoutError, ServerError) as error:
        candidates = [s.address for s in servers if s.dedicated]
        unreachable = sorted(set(candidates) - set(answering(a.answers, candidates)))
        trouble = {"error": f"{type(error).__name__}: {error}", "unreachable": unreachable}
    a.store.set(f"{ns}up/{a.rank}", json.dumps(trouble))
    # A rank whose servers do not answer waits the HELLO timeout for them: the others wait that much longer.
    reports = wait_all(a, ns + "up", "whether its client reached the servers", a.timeout + a.hello_timeout)
    failed = {rank: t for rank, t in enumerate(map(json.loads, reports)) if t}
    if not failed:
        return client, []
    if client is not None:
        client.close()
    unreachable = sorted({address for t in failed.values() for address in t["unreachable"]})
    why = "; ".join(f"rank {rank}: {t['error']}" for rank, t in failed.items())
    if attempt + 1 >= ATTEMPTS:
        raise TransportError(f"{what}: agreed {ATTEMPTS} times, and each time some rank's client could not reach the "
                             f"servers decided: {why}")  # fmt: skip
    log.warning("%s: rank(s) %s could not reach the servers decided (%s): agreeing again without %s", what,
                sorted(failed), why, ", ".join(unreachable) or "them")  # fmt: skip
    return None, unreachable
