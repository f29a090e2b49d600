"""The paper's section 4.1 (BytePS, OSDI'20), for n workers, k CPU servers, bandwidth B: its communication times,
and its x / 1-x split of one tensor, to the byte, the reference `--placement exact` measures the library against.

The times take bytes and bits per second and return seconds; `size_bytes` is the gradient size M.

The library places whole partitions, balancing bytes as they come (torch_bps.engine.placement); `split` cuts a
flat tensor into contiguous slices instead, a share x/k for each of the k dedicated servers and (1-x)/n for each of
the n colocated servers (one per worker host), and every slice into partitions of at most `partition_bytes` so
push/pull can pipeline: exactly the shares the paper assumes. The worker program pins a partition to its server by
its index (see workers/bps_pushpull.py). `server_shares` also sizes the benchmark's socket buffers
(byteps.socket_buffer_for).
May import: the standard library only.
"""

from __future__ import annotations

import itertools
from dataclasses import dataclass


def _check(n: int, k: int = 0) -> None:
    if n < 2 or k < 0:
        raise ValueError(f"need n >= 2 workers and k >= 0 servers, got n={n}, k={k}")


def allreduce_bound_s(n: int, size_bytes: float, rate_bps: float) -> float:
    """Return the ring all-reduce bound 2(n-1)M/(nB): each worker sends and receives 2(n-1)/n x M.

    Example: `allreduce_bound_s(4, 64 * 2**20, 500e6)` -> 1.61 s.
    """
    _check(n)
    return 2 * (n - 1) * size_bytes * 8 / (n * rate_bps)


def dedicated_fraction(n: int, k: int) -> float:
    """Return x, the share of bytes sent to the k CPU servers: 2k(n-1)/(n^2+kn-2k), and 1 for k >= n."""
    _check(n, k)
    if k >= n:
        return 1.0
    return 2 * k * (n - 1) / (n * n + k * n - 2 * k)


def t_opt_s(n: int, k: int, size_bytes: float, rate_bps: float) -> float:
    """Return the optimal step time 2n(n-1)M/((n^2+kn-2k)B); M/B for k >= n (the x = 1 formula).

    k = 0 is the all-reduce bound, k = n the parameter-server time M/B.
    Example: `t_opt_s(4, 2, 64 * 2**20, 500e6)` -> 1.29 s.
    """
    _check(n, k)
    if k >= n:
        return size_bytes * 8 / rate_bps
    return 2 * n * (n - 1) * size_bytes * 8 / ((n * n + k * n - 2 * k) * rate_bps)


@dataclass(frozen=True)
class Partition:
    """Elements [start, start+length) of the flat tensor go to server `server` under key `key`."""

    server: int  # index into the server list: the k dedicated ones first, then the n colocated ones
    key: int
    start: int
    length: int


def server_shares(n: int, k: int) -> list[float]:
    """Return the share of bytes of each server: k dedicated ones (x/k each), then n colocated ((1-x)/n)."""
    x = dedicated_fraction(n, k)
    return [x / k] * k + [(1.0 - x) / n] * n if k else [1.0 / n] * n


def effective_servers(n: int, k: int) -> float:
    """Return 1 / sum(share^2): how many servers the bytes spread over, counted by share (about n at every k)."""
    return 1.0 / sum(s * s for s in server_shares(n, k))


def split(numel: int, element_size: int, n: int, k: int, partition_bytes: int = 4_096_000) -> list[Partition]:
    """Split `numel` elements over the k + n servers by `server_shares`; key = server << 16 | partition.

    Example: `split(1000, 4, n=2, k=2)` sends everything to the two dedicated servers (x = 1 at k = n).
    """
    shares = server_shares(n, k)
    bounds, acc = [0], 0.0
    for share in shares:
        acc += share
        bounds.append(round(acc * numel))
    bounds[-1] = numel  # rounding never loses the tail
    per_partition = max(1, partition_bytes // element_size)
    parts = []
    for server, (lo, hi) in enumerate(itertools.pairwise(bounds)):
        for index, start in enumerate(range(lo, hi, per_partition)):
            parts.append(Partition(server, server << 16 | index, start, min(per_partition, hi - start)))
    return parts
