"""The paper's x / 1-x split of one tensor, to the byte: the reference `--placement exact` measures the library against.

The library places whole partitions, balancing bytes as they come (torch_bps.engine.placement); this module
splits a flat tensor into contiguous slices instead, a share x/k for each of the k dedicated servers and
(1-x)/n for each of the n colocated servers (one per worker host), and cuts every slice into partitions of at
most `partition_bytes` so push/pull can pipeline: exactly the shares section 4.1 of the paper assumes. The
worker program pins a partition to its server by its index (see workers/bps_pushpull.py). `server_shares`
also sizes the benchmark's socket buffers (byteps.socket_buffer_for).
May import: the standard library and benchmarks.cluster.theory.
"""

from __future__ import annotations

import itertools
from dataclasses import dataclass

from benchmarks.cluster.theory import dedicated_fraction


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
