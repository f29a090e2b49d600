"""Cut tensors into partitions with keys every worker agrees on, without any message.

A collective's tensors are named by the order of first appearance of their (numel, dtype): every rank
issues collectives in the same order (torch.distributed requires it), so every rank derives the same
tensor ids, keys and server placement locally. No init barrier is needed in the hot path: the server
learns a key from the INIT the client pipelines in front of its first push.

Up to `slots` collectives of one (numel, dtype) may be in flight at once on distinct keys; the next
reuses the first slot's keys, and the client sends a key's next round only after the previous one came
back, so rounds of one key never overlap. A MODEL tensor always gets the same keys: they hold its running
total on the servers.

Key layout (u64): tensor id << 24 | local slice << 16 | partition index.
May import: the standard library, torch, torch_bps.config, torch_bps.wire and torch_bps.engine.placement.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

import torch

from torch_bps.config import DEFAULT_MIN_PARTITION_BYTES
from torch_bps.engine.placement import Placement
from torch_bps.wire import Mode

MAX_PARTS = 1 << 16
PARTS_PER_SERVER = 64
MAX_SLICES = 1 << 8


@dataclass(frozen=True)
class Part:
    key: int
    start: int  # element offset within the local slice
    numel: int
    server: int  # index into the placement's servers


def cut(numel: int, itemsize: int, partition_bytes: int) -> list[tuple[int, int]]:
    """Return (start, numel) pieces covering [0, numel), each at most partition_bytes (at least 1 element)."""
    per = max(1, partition_bytes // itemsize)
    return [(s, min(per, numel - s)) for s in range(0, numel, per)]


def cut_mixed(numel: int, itemsize: int, end_bytes: int, middle_bytes: int, ends: int) -> list[tuple[int, int]]:
    """Return (start, numel) pieces covering [0, numel): `ends` pieces of end_bytes first and last, and the middle
    in equal pieces of at most middle_bytes. A tensor too short for a middle is cut in end_bytes pieces.

    Example: cut_mixed(10, 1, 2, 4, 1) == [(0, 2), (2, 3), (5, 3), (8, 2)].
    """
    per = max(1, end_bytes // itemsize)
    middle = numel - 2 * ends * per
    if middle_bytes <= end_bytes or middle <= per:
        return cut(numel, itemsize, end_bytes)
    # Equal middle pieces: a ragged last one would be a whole message for a few bytes.
    pieces = -(-middle // max(1, middle_bytes // itemsize))
    bounds = [ends * per + i * middle // pieces for i in range(pieces + 1)]
    head = [(s, per) for s in range(0, ends * per, per)]
    tail = [(numel - (ends - i) * per, per) for i in range(ends)]
    return head + [(a, b - a) for a, b in zip(bounds, bounds[1:], strict=False)] + tail


class KeyBook:
    """Hands out partition plans: for a collective on (numel, dtype), the parts of every local slice.

    Args:
        placement: where keys go; fed in the same order on every rank.
        partition_bytes: the largest partition.
        slices: function numel -> list of (start, end) element ranges, one per local rank.
        slots: concurrent collectives of the same (numel, dtype) that get distinct keys.
        min_partition_bytes: the floor of partition_size (Config.min_partition_bytes).
        middle_factor: a tensor's middle partitions are this many times partition_size, up to partition_bytes
            (Config.middle_partition_factor); its first and last len(servers) partitions stay at partition_size.
    """

    def __init__(
        self,
        placement: Placement,
        partition_bytes: int,
        slices: Callable[[int], list[tuple[int, int]]],
        slots: int = 4,
        min_partition_bytes: int = DEFAULT_MIN_PARTITION_BYTES,
        middle_factor: int = 1,
    ):
        self.placement = placement
        self.partition_bytes = partition_bytes
        self.min_partition_bytes = min_partition_bytes
        self.middle_factor = middle_factor
        self.slices = slices
        self.slots = slots
        self._calls: dict[tuple[int, torch.dtype, int, int], int] = {}
        self._plans: dict[tuple[int, torch.dtype, int, int, int], list[list[Part]]] = {}

    def plan(self, numel: int, dtype: torch.dtype, mode: int = 0, codec: int = 0) -> list[list[Part]]:
        """Return, for each local slice, its parts (keys, offsets within the slice, servers).

        `mode` (torch_bps.wire.Mode) and `codec` (a compressed key's codec word) keep summed, gathered and
        compressed tensors of one size on keys of their own: the server fixes both at a key's first INIT.
        """
        shape = (numel, dtype, int(mode), codec)
        calls = self._calls.get(shape, 0)
        self._calls[shape] = calls + 1
        slot = 0 if mode == Mode.MODEL else calls % self.slots
        plan = self._plans.get((*shape, slot))
        if plan is None:
            plan = self._plans[(*shape, slot)] = self._new_plan(len(self._plans), numel, dtype)
        return plan

    def keys_of(self, slice_index: int | None = None) -> dict[int, tuple[int, int]]:
        """Every key planned so far (of local slice `slice_index`; None: of all) -> (its server, its bytes)."""
        return {
            p.key: (p.server, p.numel * shape[1].itemsize)
            for shape, plan in self._plans.items()
            for parts in (plan if slice_index is None else [plan[slice_index]])
            for p in parts
        }

    def partition_size(self, nbytes: int) -> int:
        """Return the partition size for a tensor of nbytes: at most partition_bytes, and small enough that
        even the server with the smallest share gets PARTS_PER_SERVER partitions of it, down to
        min_partition_bytes (every message costs CPU on both ends).

        Why: a partition's sum can only come back once every worker pushed all of it, so the first
        partition's push (fill) and the last one's pull (drain) are times no pipelining hides: about 2/P of the
        step with P partitions per server, hence 64 of them. Every message costs CPU on both ends, hence a floor;
        128 KiB is where the emulated cluster's fastest points are with the stream transport and the sized
        credit, on 2 cores (docs/benchmarks.md). With socket buffers set it is their size (Config.partition_floor).
        A machine with cores to spare may lower it, one bound by CPU raise it (BPS_MIN_PARTITION_BYTES).
        """
        # The server with the smallest share (a colocated one under the paper's split) sets the size.
        smallest = min(s.weight for s in self.placement.servers)
        fair = int(-(-nbytes * smallest // PARTS_PER_SERVER))
        return max(min(self.partition_bytes, self.min_partition_bytes), min(self.partition_bytes, fair))

    def _new_plan(self, tensor_id: int, numel: int, dtype: torch.dtype) -> list[list[Part]]:
        itemsize = dtype.itemsize
        size = self.partition_size(numel * itemsize)
        # Only the first partitions' pushes (fill) and the last ones' pulls (drain) wait unhidden; one per server
        # at each end keeps those short, and fewer, bigger partitions between them save CPU per message.
        middle = min(self.partition_bytes, size * self.middle_factor)
        plan = []
        for index, (lo, hi) in enumerate(self.slices(numel)):
            pieces = cut_mixed(hi - lo, itemsize, size, middle, len(self.placement.servers))
            if len(pieces) > MAX_PARTS or index >= MAX_SLICES:
                raise ValueError(f"tensor of {numel} elements needs {len(pieces)} partitions; raise partition_bytes")
            parts = []
            for p, (start, n) in enumerate(pieces):
                key = tensor_id << 24 | index << 16 | p
                parts.append(Part(key, start, n, self.placement.assign(key, n * itemsize)))
            plan.append(parts)
        return plan
