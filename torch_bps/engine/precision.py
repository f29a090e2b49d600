"""Wire precision: fp32 sums travel to the servers as bf16 or fp16 (Config.wire_dtype), half the bytes.

One step on each side of the network stage. Before it, each fp32 tensor summed through the servers has its
machine's slice (after the local reduce-scatter, which stays fp32) cast into a buffer of the wire dtype; the
partitions push and pull that buffer, under keys declared in the wire dtype. After it, the pulled sum is cast
back into the caller's tensor (wire_transform.py applies both). The servers add 16-bit pushes in fp32 and round
the sum once (docs/protocol.md, "Summation"), and every worker pulls the same rounded sum, so replicas stay
bit-identical.

Only SUM tensors of fp32 are cast: a gather (COPY) must deliver its bytes exactly, integers and fp64 have no
16-bit form here, and 16-bit tensors already travel as themselves.

May import: the standard library, torch and torch_bps.wire.
"""

from __future__ import annotations

import threading
from collections import defaultdict

import torch

from torch_bps.wire import Mode

# Config.wire_dtype -> the dtype fp32 sums travel as (None: as themselves).
WIRE_DTYPES: dict[str, torch.dtype | None] = {"fp32": None, "bf16": torch.bfloat16, "fp16": torch.float16}


def wire_dtype(name: str) -> torch.dtype | None:
    """Return the torch dtype a Config.wire_dtype name stands for (None for "fp32": no cast).

    Example: wire_dtype("bf16") is torch.bfloat16.
    """
    return WIRE_DTYPES[name]


def travels_as(tensor: torch.Tensor, mode: int, wire: torch.dtype | None) -> torch.dtype:
    """Return the dtype a tensor of a collective is pushed and pulled as: `wire` for an fp32 sum, else its own."""
    if wire is not None and mode == Mode.SUM and tensor.dtype == torch.float32:
        return wire
    return tensor.dtype


class WireCasts:
    """Wire-dtype buffers, reused by size. A buffer belongs to one collective from its cast onto the wire until its
    sum is cast back, so collectives in flight never share one; fresh big buffers would page-fault every step.

    Example:
        casts = WireCasts()
        cast = casts.cast(grad_slice, torch.bfloat16)   # ... pushed and pulled ...
        grad_slice.copy_(cast)
        casts.give(cast)
    """

    def __init__(self):
        self._lock = threading.Lock()  # collectives are cast on the stage thread, cast back on completion threads
        self._free: dict[tuple[int, torch.dtype], list[torch.Tensor]] = defaultdict(list)

    def cast(self, exact: torch.Tensor, wire: torch.dtype) -> torch.Tensor:
        """Return a buffer holding `exact` cast to `wire` (rounded to nearest, ties to even)."""
        with self._lock:
            free = self._free[(exact.numel(), wire)]
            cast = free.pop() if free else None
        if cast is None:
            cast = torch.empty(exact.numel(), dtype=wire)
        return cast.copy_(exact)

    def give(self, cast: torch.Tensor) -> None:
        """Take back a buffer `cast` returned, once nothing reads or writes it any more."""
        with self._lock:
            self._free[(cast.numel(), cast.dtype)].append(cast)
