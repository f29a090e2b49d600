"""What one tensor of a collective exchanges: summed whole, or gathered from byte ranges; read back whole or
in part. The pipeline turns it into each partition's push range and pull range.

An all-reduce pushes and pulls every element. A reduce-scatter pushes every element and pulls only the rank's
shard of the sum. An all-gather (COPY) pushes only the rank's own slot and pulls everything; a broadcast
(COPY) pushes everything from the root and nothing elsewhere, and the root pulls nothing. So every shard
crosses the wire once up and once down per rank that needs it: a parameter server's ideal traffic.

May import: the standard library, torch and torch_bps.wire.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass

import torch

from torch_bps.wire import Mode

Range = tuple[int, int]  # [start, stop) in elements of the tensor


@dataclass(frozen=True)
class Exchange:
    """One 1-D contiguous CPU tensor of a collective, and what each rank of the group puts in and takes out.

    Args:
        tensor: summed in place (SUM), or filled in place with everyone's ranges (COPY).
        mode: Mode.SUM or Mode.COPY.
        push: COPY: per rank of the group, the range it contributes (the ranges tile the tensor; they may be
            empty). SUM: None (every rank pushes everything).
        pull: per rank, the range it needs back; None: everything.
        compress: a SUM of fp32 gradients the engine may compress (its Compressor, compress.py): lossy, so only
            what asks for it (bps_hook's buckets), never a plain all_reduce.
        finish: what the front door runs once the collective's sums are in (pg/work.py's `launch`): copies or
            reductions to where the caller wants them; the engine never calls it.

    Example (an all-gather of 4 elements per rank among 2 ranks):
        Exchange(buf, Mode.COPY, push=((0, 4), (4, 8)))
    """

    tensor: torch.Tensor
    mode: Mode = Mode.SUM
    push: Sequence[Range] | None = None
    pull: Sequence[Range] | None = None
    compress: bool = False
    finish: Callable[[], None] | None = None

    def __post_init__(self) -> None:
        if (self.mode == Mode.COPY) != (self.push is not None):
            raise ValueError(f"an Exchange of mode {self.mode.name} takes push ranges exactly when it is COPY")

    def pushed_by(self, ranks: Sequence[int]) -> Range:
        """The range `ranks` (one machine's) contribute together; it must be contiguous: their ranges tile it."""
        if self.push is None:
            return 0, self.tensor.numel()
        return _hull([self.push[r] for r in ranks], contiguous=True)

    def pulled_by(self, ranks: Sequence[int]) -> Range:
        """The smallest range holding everything `ranks` need back."""
        if self.pull is None:
            return 0, self.tensor.numel()
        return _hull([self.pull[r] for r in ranks], contiguous=False)


def intersect(a: Range, lo: int, hi: int) -> Range:
    """[a] ∩ [lo, hi), as an empty range at lo when they do not meet."""
    start, stop = max(a[0], lo), min(a[1], hi)
    return (start, stop) if start < stop else (lo, lo)


def _hull(ranges: list[Range], contiguous: bool) -> Range:
    ranges = sorted(r for r in ranges if r[1] > r[0])
    if not ranges:
        return 0, 0
    if contiguous and any(a[1] != b[0] for a, b in zip(ranges, ranges[1:], strict=False)):
        raise ValueError(f"the ranges {ranges} of one machine's ranks do not form one contiguous range")
    return ranges[0][0], max(r[1] for r in ranges)
