"""One collective on its way through the engine's stages (pipeline.py): its tensors, their partitions, and what
each stage leaves on it for the next.

May import: torch, torch_bps.futures, torch_bps.wire, torch_bps.engine.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field

import torch

from torch_bps.engine.exchange import Exchange
from torch_bps.engine.partition import Part
from torch_bps.engine.spans import describe
from torch_bps.futures import Done
from torch_bps.wire import Mode


@dataclass
class Op:
    """A collective: `run` makes it, the stages fill it in, `done` ends it once."""

    items: Sequence[Exchange]  # 1-D, contiguous, CPU tensors: summed or gathered in place
    plans: list[list[Part]]  # this rank's partitions of each tensor
    priority: int
    done: Done
    slices: list[torch.Tensor] = field(default_factory=list)  # several local ranks: this rank's reduced slices
    # A wire dtype: item index -> (where this rank's slice starts in the tensor, that slice in the wire dtype)
    cast: dict[int, tuple[int, torch.Tensor]] = field(default_factory=dict)
    # Compressed partitions: (key, round, the pulled encoded sum, where its decoding goes)
    encoded: list[tuple[int, int, torch.Tensor, torch.Tensor]] = field(default_factory=list)
    error: BaseException | None = None
    sent_at: float = 0.0  # when its partitions went to the client (time.monotonic())
    # Under the stall check's lock: one ending took it (a late second one is ignored).
    ending: bool = False
    # Under the local stages' lock: its result is in the caller's tensors (cast back), so it may be gathered.
    network_ended: bool = False
    pull_only: bool = False  # push nothing, pull the rounds' sums (a worker catching up on backup rounds)
    stage_span: Done | None = None  # closes the profiler span of the local stage under way (local_stages.py)
    sliced: bool = False  # a copied slice whose local stages run on the device (run_copied): none to gather here

    def keys(self) -> str:
        """Its keys' range, for errors and spans."""
        keys = [p.key for plan in self.plans for p in plan]
        return f"keys {min(keys):#x}..{max(keys):#x}" if keys else "no keys"


def span_name(what: str, items: Sequence[Exchange]) -> str:
    return f"torch_bps::{what} {size_of(items)}"


def size_of(items: Sequence[Exchange]) -> str:
    return describe(sum(x.tensor.numel() * x.tensor.element_size() for x in items), len(items))


def modes(items: Sequence[Exchange]) -> str:
    return "/".join(sorted({Mode(x.mode).name.lower() for x in items}))
