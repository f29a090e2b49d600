"""What a collective's partitions carry on the wire, and the way back: the transforms of a partition.

A partition is a view of this rank's slice of a tensor (partition.py cuts it, exchange.py gives its push and pull
ranges). Three transforms may change what travels, each in one place here, none a branch of the pipeline:

- wire casts (precision.py): an fp32 sum's slice is cast into a buffer of the wire dtype right before its
  partitions go to the client, and the sum cast back as soon as the network stage ends, before anyone may gather it;
- a codec (compress.py): the partitions of tensors that ask for it (`Exchange.compress`: bps_hook's gradients) are
  encoded with error feedback as they are cut, and the servers' encoded sums decoded where the casts back run;
- pull-only (backup workers catching up on rounds that closed without them): a partition that pushes nothing and
  pulls its round's sum; a compressed one still counts the round (random-k's indices follow the count).

May import: torch, torch_bps.wire, torch_bps.engine.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence

import torch

from torch_bps.engine.compress import Compressor
from torch_bps.engine.exchange import Exchange, intersect
from torch_bps.engine.op import Op
from torch_bps.engine.partition import Part
from torch_bps.engine.precision import WireCasts, travels_as
from torch_bps.wire import Mode, Partition


class WireTransform:
    """The wire dtype and the codec of one engine, applied to its collectives' partitions.

    Args:
        wire_dtype: what fp32 sums travel as (torch.bfloat16, torch.float16), or None: as themselves.
        compressor: encodes the partitions of tensors whose Exchange asks for it; None: none is.

    Example: `wire.to_wire(op, slice_range)`, then `wire.parts(op, i, plan, base, ranks)` for each tensor; once the
    network stage ended, `wire.from_wire(op, ranks_of)`.
    """

    def __init__(self, wire_dtype: torch.dtype | None, compressor: Compressor | None):
        self.wire_dtype = wire_dtype
        self.compressor = compressor
        self._casts = WireCasts()

    def travels_as(self, x: Exchange) -> torch.dtype:
        """The dtype x's keys are declared in."""
        return x.tensor.dtype if self.codec(x) else travels_as(x.tensor, x.mode, self.wire_dtype)

    def codec(self, x: Exchange) -> int:
        """The codec word x's keys carry: the compressor's for an fp32 all-reduce that asks for it, else 0."""
        whole = x.mode == Mode.SUM and x.push is None and x.pull is None and x.tensor.dtype == torch.float32
        return self.compressor.word if self.compressor is not None and x.compress and whole else 0

    def to_wire(self, op: Op, slice_range: Callable[[int], tuple[int, int]]) -> None:
        """Cast this rank's slice of each of op's fp32 sums into a buffer of the wire dtype (op.cast)."""
        for i, x in enumerate(op.items):
            if self.travels_as(x) != x.tensor.dtype:
                lo, hi = slice_range(x.tensor.numel())
                op.cast[i] = (lo, self._casts.cast(x.tensor[lo:hi], self.wire_dtype))

    def parts(self, op: Op, index: int, plan: list[Part], base: int, ranks: Sequence[int]) -> list[Partition]:
        """This rank's partitions of op's tensor `index`, as push_pull_batch takes them: cut from this local rank's
        slice, which starts at `base` in the tensor; `ranks`: the group ranks the worker stands for."""
        x = op.items[index]
        if codec := self.codec(x):
            return [self._encoded(op, x, base, part, codec) for part in plan]
        parts = _cut(x, op.cast.get(index), plan, base, ranks)
        return [_pull_only(p) for p in parts] if op.pull_only else parts

    def from_wire(self, op: Op, ranks_of: Callable[[Exchange], Sequence[int]]) -> None:
        """Decode op's encoded sums and cast its wire-dtype sums back into the caller's tensors (skipped for a failed
        collective: a late reply may still be written into its buffers, which are dropped)."""
        if op.encoded:
            self._decode(op)
        if op.cast:
            self._cast_back(op, ranks_of)

    def _encoded(self, op: Op, x: Exchange, base: int, part: Part, codec: int) -> Partition:
        """A compressed partition: encoded (with its key's error feedback) into a payload of its own, its encoded sum
        pulled into another and decoded into the tensor when the network stage ends. Pulling only, nothing is
        encoded: the round's sum is pulled and decoded."""
        dense = x.tensor[base + part.start : base + part.start + part.numel]
        if op.pull_only:  # the round still counts: random-k's indices follow the count
            payload, rnd = dense[:0], self.compressor.skip(part.key)
        else:
            payload, rnd = self.compressor.encode(part.key, dense)
        pulled = torch.empty(self.compressor.wire_numel(part.numel))
        op.encoded.append((part.key, rnd, pulled, dense))
        return Partition(payload, part.key, part.server, pulled, Mode.SUM, pulled.numel(), 0, 0, codec, part.numel)

    def _decode(self, op: Op) -> None:
        try:
            for key, rnd, pulled, out in op.encoded if op.error is None else ():
                self.compressor.decode(key, rnd, pulled, out)
        except BaseException as e:  # noqa: BLE001 - the collective fails with it
            op.error = op.error or e
        op.encoded.clear()

    def _cast_back(self, op: Op, ranks_of: Callable[[Exchange], Sequence[int]]) -> None:
        """Write each cast sum into the caller's tensor (what this worker pulled of it) and give its buffer back."""
        try:
            for i, (lo, cast) in op.cast.items():
                if op.error is not None:
                    continue
                x = op.items[i]
                a, b = intersect(x.pulled_by(ranks_of(x)), lo, lo + cast.numel())
                x.tensor[a:b].copy_(cast[a - lo : b - lo])
                self._casts.give(cast)
        except BaseException as e:  # noqa: BLE001 - the collective fails with it
            op.error = op.error or e
        op.cast.clear()


def _cut(x: Exchange, cast: tuple[int, torch.Tensor] | None, plan: list[Part], base: int,
         ranks: Sequence[int]) -> list[Partition]:  # fmt: skip
    """x's partitions as views of its tensor, or of its wire-dtype buffer (`cast`: the slice from `base` on)."""
    t, at = (x.tensor, 0) if cast is None else (cast[1], base)
    pushed, pulled = x.pushed_by(ranks), x.pulled_by(ranks)
    whole = (at, at + t.numel())
    parts = []
    for part in plan:
        lo = base + part.start
        hi = lo + part.numel
        src, dst = intersect(pushed, lo, hi), intersect(pulled, lo, hi)
        # A slice makes a tensor per call: a partition that is the whole tensor goes as it is, and one pulled
        # over the range it pushed (any all-reduce's) uses one tensor for both.
        pushing = t if src == whole else t[src[0] - at : src[1] - at]
        out = pushing if dst == src else t[dst[0] - at : dst[1] - at]
        parts.append(Partition(pushing, part.key, part.server, out, x.mode, part.numel, src[0] - lo, dst[0] - lo))
    return parts


def _pull_only(p: Partition) -> Partition:
    """Push nothing (the client then sends only the PULL) and pull the partition's round's sum, as it would have."""
    return p._replace(tensor=p.tensor[:0])
