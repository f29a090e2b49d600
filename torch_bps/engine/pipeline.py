"""The worker pipeline: one collective's tensors, stage by stage, to one completion.

    local reduce-scatter -> cut into partitions -> schedule (priority, credit)
      -> push/pull through the C++ client -> local all-gather -> done(error)

A collective is a list of 1-D tensors summed in place; every partition of all of them counts down one
counter, and `done` runs once, on one of the C++ client's completion threads: the only executor. Those
threads may block in `done` (torch's PowerSGD hook waits on further collectives inside its callbacks):
the client's completion pool then starts another thread, so nested collectives always make progress.

With one local rank the local stages are skipped and partitions are views of the caller's tensors. With
several, the local stages run on two threads of their own (reduce-scatter in submission order, all-gather
in submission order), because every local rank must meet the others in the same sequence; the network
stage in between is fully pipelined across collectives. The all-gather thread hands `done` to the client's
completion threads, so a blocking `done` never stalls it.

May import: torch, torch_bps.errors, torch_bps.futures, torch_bps.engine.
"""

from __future__ import annotations

import logging
import queue
import threading
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field

import torch

from torch_bps.engine.partition import KeyBook, Part
from torch_bps.engine.scheduler import CreditScheduler
from torch_bps.errors import BpsTimeoutError
from torch_bps.futures import completer

log = logging.getLogger("torch_bps.engine")

Done = Callable[[BaseException | None], None]


@dataclass
class _Op:
    tensors: Sequence[torch.Tensor]  # 1-D, contiguous, CPU: summed in place
    plans: list[list[Part]]  # this rank's partitions of each tensor
    priority: int
    done: Done
    slices: list[torch.Tensor] = field(default_factory=list)  # this rank's slices after the local reduce-scatter
    remaining: int = 0
    error: BaseException | None = None
    net_done: threading.Event = field(default_factory=threading.Event)
    lock: threading.Lock = field(default_factory=threading.Lock)


class PushPullEngine:
    """Sum tensors over every worker of the job through the summation service.

    Args:
        client: a torch_bps.client.Client (worker = this machine, num_workers = machines).
        keys: the KeyBook (partitioning and placement).
        scheduler: the CreditScheduler for bytes in flight.
        local: (reduce_scatter, all_gather) LocalComm channels among this machine's ranks, or None for one
            rank per machine. Two channels, because the two stages run on their own threads and each
            channel needs its calls in the same order on every local rank.
        local_rank: this rank's index within its machine.
        timeout: the client's request timeout; a local stage waits a little longer for the network stage, so
            the client's own error (naming server, key and round) is the one that surfaces.
    """

    def __init__(
        self,
        client,
        keys: KeyBook,
        scheduler: CreditScheduler,
        *,
        local=None,
        local_rank: int = 0,
        timeout: float = 300.0,
    ):
        self.client = client
        self.keys = keys
        self.scheduler = scheduler
        self.local = local
        self.local_rank = local_rank
        self.timeout = timeout
        self._lock = threading.Lock()  # collectives may come from several threads; plans must stay in order
        self._threads: list[threading.Thread] = []
        if local is not None:
            self._rs_queue: queue.Queue = queue.Queue()
            self._ag_queue: queue.Queue = queue.Queue()
            for name, target in (("bps-local-rs", self._reduce_scatter_loop), ("bps-local-ag", self._all_gather_loop)):
                t = threading.Thread(target=target, name=name, daemon=True)
                t.start()
                self._threads.append(t)

    def push_pull(self, tensor: torch.Tensor, *, priority: int = 0) -> torch.futures.Future:
        """Sum one tensor in place (see `run`); return a Future of it. For tests and benchmarks."""
        future = torch.futures.Future()
        self.run([tensor], completer(future, tensor), priority=priority)
        return future

    def run(self, tensors: Sequence[torch.Tensor], done: Done, *, priority: int = 0) -> None:
        """Sum each 1-D contiguous CPU tensor in place over all workers, then call `done(error or None)` once.

        Collective: every rank calls it with tensors of the same numels and dtypes, in the same order.
        `done` runs on a completion thread (inline, before run returns, when there is nothing to send).
        """
        for t in tensors:
            if t.device.type != "cpu" or not t.is_contiguous() or t.dim() != 1:
                raise ValueError(f"push_pull takes 1-D contiguous CPU tensors, got {tuple(t.shape)} on {t.device}")
        mine = self.local_rank if self.local is not None else 0
        with self._lock:
            plans = [self.keys.plan(t.numel(), t.dtype)[mine] for t in tensors]
            op = _Op(tensors, plans, priority, done)
            if self.local is None:
                self._schedule(op, tensors)
            else:
                self._rs_queue.put(op)

    # -- stage: local reduce-scatter (several local ranks only)
    def _reduce_scatter_loop(self) -> None:
        while (op := self._rs_queue.get()) is not None:
            try:
                for t in op.tensors:
                    lo, hi = self.local[0].slice_range(t.numel())
                    # In place: my slice of the sum lands in my own tensor (big fresh buffers page-fault).
                    op.slices.append(self.local[0].reduce_scatter(t, out=t[lo:hi]))
            except BaseException as e:  # noqa: BLE001 - the op fails, the loop serves the next one
                op.error = e
                op.net_done.set()
            else:
                self._schedule(op, op.slices)
            self._ag_queue.put(op)

    # -- stage: partitions onto the network, highest priority first within the credit
    def _schedule(self, op: _Op, data: Sequence[torch.Tensor]) -> None:
        op.remaining = sum(len(parts) for parts in op.plans)
        if op.remaining == 0:
            self._network_done(op)
            return
        for parts, flat in zip(op.plans, data, strict=True):
            for part in parts:
                view = flat.narrow(0, part.start, part.numel)
                nbytes = view.numel() * view.element_size()
                self.scheduler.submit(nbytes, op.priority, lambda v=view, p=part, n=nbytes: self._send(op, v, p, n))

    def _send(self, op: _Op, view: torch.Tensor, part: Part, nbytes: int) -> None:
        if op.error is not None:  # an earlier partition failed: do not push the rest
            self.scheduler.release(nbytes)
            self._part_done(op, None)
            return
        # The credit comes back when the server has the push, not when the sum is back: a sum waits for
        # the other workers, whose schedulers may have picked other partitions first (priorities and
        # timing differ per worker), so holding credit until the pull would let workers wait on each
        # other forever.
        try:
            self.client.push_pull(view, part.key, server=part.server, on_done=lambda e: self._part_done(op, e),
                                  on_pushed=lambda _: self.scheduler.release(nbytes))  # fmt: skip
        except BaseException as e:  # noqa: BLE001
            self.scheduler.release(nbytes)
            self._part_done(op, e)

    def _part_done(self, op: _Op, error: BaseException | None) -> None:
        with op.lock:
            if error is not None and op.error is None:
                op.error = error
            op.remaining -= 1
            last = op.remaining == 0
        if last:
            self._network_done(op)

    def _network_done(self, op: _Op) -> None:
        if self.local is None:
            op.done(op.error)
        else:
            op.net_done.set()

    # -- stage: local all-gather (several local ranks only)
    def _all_gather_loop(self) -> None:
        while (op := self._ag_queue.get()) is not None:
            if not op.net_done.wait(self.timeout + 30):
                op.error = op.error or BpsTimeoutError(
                    f"local rank {self.local_rank}: network stage of a collective of {len(op.tensors)} tensor(s) "
                    f"did not finish within {self.timeout + 30}s"
                )
            if op.error is None:
                try:
                    for slice_, t in zip(op.slices, op.tensors, strict=True):
                        self.local[1].all_gather(slice_, t)
                except BaseException as e:  # noqa: BLE001
                    op.error = e
            self.client.post(lambda op=op: op.done(op.error))

    def close(self) -> None:
        if self.local is not None:
            self._rs_queue.put(None)
            self._ag_queue.put(None)
            for t in self._threads:
                t.join(timeout=5)
