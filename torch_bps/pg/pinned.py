"""A bounded pool of pinned host slots, reused: what the per-partition staging copies through.

A slot is taken before a partition's device -> host copy and given back once its pulled sum has been queued
for the copy back on the same stream (the next copy into the slot is ordered after it by the stream itself, so no
host wait is needed). At most `slots` x `slot_bytes` bytes are ever pinned; a slot a failed collective may still
receive a late reply into is dropped, not reused, and a fresh one takes its place.

May import: torch, torch_bps.errors, torch_bps.pg.cuda_ops.
"""

from __future__ import annotations

import threading

import torch

from torch_bps.errors import BpsTimeoutError, ConfigError
from torch_bps.pg.cuda_ops import CudaOps


class PinnedPool:
    """`slots` pinned buffers of `slot_bytes` each, made on first use.

    Example: `i, buf = pool.acquire(60, "partition 3"); ...; pool.release(i)`.
    """

    def __init__(self, ops: CudaOps, slot_bytes: int, slots: int):
        if slots < 2:
            raise ConfigError(f"a staging pool needs at least 2 slots (one copying while one is pushed), got {slots}")
        if slot_bytes <= 0:
            raise ConfigError(f"slot_bytes={slot_bytes} must be positive")
        self.slot_bytes, self.slots = slot_bytes, slots
        self._ops = ops
        self._buffers: list[torch.Tensor | None] = [None] * slots
        self._free = list(range(slots - 1, -1, -1))  # a stack: the most recently used slot is reused first
        self._cond = threading.Condition()
        self.made = 0  # buffers allocated so far (slots dropped after a failure make this exceed `slots`)

    def acquire(self, timeout: float, what: str) -> tuple[int, torch.Tensor]:
        """Take a free slot, waiting up to `timeout` seconds for one; returns (index, uint8 buffer)."""
        with self._cond:
            if not self._cond.wait_for(lambda: self._free, timeout):
                raise BpsTimeoutError(f"waited {timeout:.1f} s for a free pinned staging slot ({self.slots} of "
                                      f"{self.slot_bytes} bytes, all in flight) for {what}")  # fmt: skip
            index = self._free.pop()
            if self._buffers[index] is None:
                self._buffers[index] = self._ops.pinned(self.slot_bytes)
                self.made += 1
            return index, self._buffers[index]

    def release(self, index: int) -> None:
        """Give a slot back for reuse."""
        with self._cond:
            self._free.append(index)
            self._cond.notify()

    def drop(self, index: int) -> None:
        """Give a slot back without its buffer, which a late reply may still write into."""
        with self._cond:
            self._buffers[index] = None
            self._free.append(index)
            self._cond.notify()

    @property
    def in_use(self) -> int:
        with self._cond:
            return self.slots - len(self._free)
