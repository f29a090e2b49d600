"""Which server sums which partition: the paper's optimal split, then byte balance within each side.

OSDI'20 section 4.1: with n worker machines, each running a colocated summation server, and k dedicated
CPU servers, sending a fraction x = 2k(n-1) / (n^2 + kn - 2k) of the bytes to the dedicated servers
(x = 1 once k >= n) and the rest to the colocated ones minimises communication time,
t_opt = 2n(n-1)M / ((n^2 + kn - 2k)B). k = 0 is all-reduce's traffic, k = n the parameter server's.

Placement is a pure function of the order in which partitions are first seen and their sizes, so every
worker, seeing the same collectives in the same order, computes the same assignment with no messages.
`receive_buffers` sizes each server connection's receive window by the same shares.
May import: the standard library only.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

MODES = ("optimal", "dedicated", "colocated")
MIN_RECEIVE_WINDOW = 8 * 1448  # bytes: 8 segments of an Ethernet MTU


def dedicated_fraction(n: int, k: int) -> float:
    """Return x, the share of bytes the k dedicated servers should sum (paper section 4.1)."""
    if n < 1 or k < 0:
        raise ValueError(f"need n >= 1 worker machines and k >= 0 dedicated servers, got n={n}, k={k}")
    if k == 0:
        return 0.0
    if k >= n or n == 1:
        return 1.0
    return 2 * k * (n - 1) / (n * n + k * n - 2 * k)


def t_opt(n: int, k: int, nbytes: float, bandwidth: float) -> float:
    """Return the optimal communication time in seconds for nbytes per worker at bandwidth bytes/s."""
    if n == 1:
        return 0.0 if k == 0 else nbytes / bandwidth  # one machine: only a dedicated server makes traffic (the PS case)
    k = min(k, n)
    return 2 * n * (n - 1) * nbytes / ((n * n + k * n - 2 * k) * bandwidth)


@dataclass(frozen=True)
class Server:
    address: str
    dedicated: bool
    weight: float  # the share of all bytes this server should receive


def server_weights(colocated: list[str], dedicated: list[str], mode: str = "optimal") -> list[Server]:
    """Return every server with its target share of bytes (shares sum to 1; zero-weight servers dropped).

    colocated: one address per worker machine (may be empty); dedicated: the k CPU-only servers.
    """
    if mode not in MODES:
        raise ValueError(f"placement mode {mode!r} is not one of {MODES}")
    n, k = len(colocated), len(dedicated)
    if mode == "dedicated" or (mode == "optimal" and n == 0):
        x = 1.0
    elif mode == "colocated" or k == 0:
        x = 0.0
    else:
        x = dedicated_fraction(n, k)
    if (x > 0 and k == 0) or (x < 1 and n == 0):
        raise ValueError(f"placement {mode!r} needs servers it does not have ({n} colocated, {k} dedicated)")
    servers = [Server(a, True, x / k) for a in dedicated] if x > 0 else []
    servers += [Server(a, False, (1 - x) / n) for a in colocated] if x < 1 else []
    return servers


def receive_buffers(base: int, servers: list[Server]) -> list[int]:
    """Return each server connection's receive buffer: `base` x the server's weight x the effective server count.

    TCP gives the connections through one link equal shares; t_opt needs each at its server's share (a dedicated
    server's connection carries 3.5x a colocated one's at n = 8, k = 4). A receive window in proportion to the
    share paces each connection near it, and counting 1 / sum(weight^2) servers keeps the bytes in flight about
    what `base` for every server would allow. No window goes below 8 segments (or `base`): with fewer in
    flight a loss cannot get 3 duplicate acknowledgements and waits for a timer. `base` 0 (the kernel's) gives 0s.
    Example: equal weights give `base` for every server.
    """
    if base <= 0:
        return [0] * len(servers)
    effective = 1.0 / sum(s.weight * s.weight for s in servers)
    return [max(min(base, MIN_RECEIVE_WINDOW), round(base * s.weight * effective)) for s in servers]


class Placement:
    """Assign partitions to servers: each goes where it leaves bytes closest to the target shares.

    Deterministic given the order of `assign` calls. Stable: a key, once placed, never moves.
    """

    def __init__(self, servers: list[Server]):
        if not servers:
            raise ValueError("placement needs at least one server")
        self.servers = servers
        self.load = [0] * len(servers)  # bytes assigned so far
        self._where: dict[int, int] = {}

    def assign(self, key: int, nbytes: int) -> int:
        """Return the index (into servers) of the server for key, placing it on first sight."""
        where = self._where.get(key)
        if where is None:
            # Least relative load after adding this partition; ties go to the lowest index (deterministic).
            where = min(range(len(self.servers)), key=lambda i: ((self.load[i] + nbytes) / self.servers[i].weight, i))
            self.load[where] += nbytes
            self._where[key] = where
        return where

    def shares(self) -> list[float]:
        """Return the fraction of bytes placed on each server so far."""
        total = sum(self.load)
        return [load / total if total else math.nan for load in self.load]
