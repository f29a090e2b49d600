"""The worker pipeline: one push_pull, stage by stage.

    local reduce-scatter -> cut into partitions -> [compress] -> schedule (priority, credit)
      -> push/pull through the C++ client -> [decompress] -> local all-gather -> complete the future

With one local rank the local stages are skipped and partitions are views of the caller's tensor, summed
in place. With several, the local stages run on two threads of their own (reduce-scatter in submission
order, all-gather in submission order), because every local rank must meet the others in the same
sequence; the network stage in between is fully pipelined across collectives.

User futures are completed from a small thread pool, never from the client's threads: torch's comm hooks
(PowerSGD) block inside Future callbacks on further collectives, which must still be able to complete.
May import: torch, torch_bps.errors, torch_bps.engine.
"""

from __future__ import annotations

import logging
import queue
import threading
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field

import torch

from torch_bps.engine.partition import KeyBook, Part
from torch_bps.engine.scheduler import CreditScheduler
from torch_bps.errors import BpsError, BpsTimeoutError

log = logging.getLogger("torch_bps.engine")


@dataclass
class _Op:
    tensor: torch.Tensor  # 1-D, contiguous, CPU: summed in place
    parts: list[Part]
    priority: int
    future: torch.futures.Future
    slice_: torch.Tensor | None = None  # this rank's slice after the local reduce-scatter
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
        self._lock = threading.Lock()  # push_pull may be called from several threads; plans must stay in order
        self._completer = ThreadPoolExecutor(max_workers=16, thread_name_prefix="bps-complete")
        self._threads: list[threading.Thread] = []
        if local is not None:
            self._rs_queue: queue.Queue = queue.Queue()
            self._ag_queue: queue.Queue = queue.Queue()
            for name, target in (("bps-local-rs", self._reduce_scatter_loop), ("bps-local-ag", self._all_gather_loop)):
                t = threading.Thread(target=target, name=name, daemon=True)
                t.start()
                self._threads.append(t)

    def push_pull(self, tensor: torch.Tensor, *, priority: int = 0) -> torch.futures.Future:
        """Sum a 1-D contiguous CPU tensor in place over all workers; the future's value is the tensor.

        Collective: every rank calls it with tensors of the same numel and dtype, in the same order.
        """
        if tensor.device.type != "cpu" or not tensor.is_contiguous() or tensor.dim() != 1:
            raise ValueError(
                f"push_pull takes a 1-D contiguous CPU tensor, got {tuple(tensor.shape)} on {tensor.device}"
            )
        future = torch.futures.Future()
        with self._lock:
            plan = self.keys.plan(tensor.numel(), tensor.dtype)
            op = _Op(tensor, plan[self.local_rank if self.local is not None else 0], priority, future)
            if self.local is None:
                self._schedule(op, tensor)
            else:
                self._rs_queue.put(op)
        return future

    # -- stage: local reduce-scatter (several local ranks only)
    def _reduce_scatter_loop(self) -> None:
        while (op := self._rs_queue.get()) is not None:
            try:
                lo, hi = self.local[0].slice_range(op.tensor.numel())
                # In place: my slice of the sum lands in my own tensor (no allocation: big fresh buffers page-fault).
                op.slice_ = self.local[0].reduce_scatter(op.tensor, out=op.tensor[lo:hi])
            except BaseException as e:  # noqa: BLE001 - the op fails, the loop serves the next one
                op.error = op.error or e
                op.net_done.set()
            else:
                self._schedule(op, op.slice_)
            self._ag_queue.put(op)

    # -- stage: partitions onto the network, highest priority first within the credit
    def _schedule(self, op: _Op, data: torch.Tensor) -> None:
        op.remaining = len(op.parts)
        if not op.parts:
            self._network_done(op)
            return
        for part in op.parts:
            view = data.narrow(0, part.start, part.numel)
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
        pushed = torch.futures.Future()
        pushed.add_done_callback(lambda _: self.scheduler.release(nbytes))
        try:
            fut = self.client.push_pull(view, part.key, server=part.server, pushed=pushed)  # [compress] around here
        except BaseException as e:  # noqa: BLE001
            self.scheduler.release(nbytes)
            self._part_done(op, e)
            return
        fut.add_done_callback(lambda f: self._part_done(op, _exception_of(f)))

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
            self._finish(op)
        else:
            op.net_done.set()

    # -- stage: local all-gather (several local ranks only)
    def _all_gather_loop(self) -> None:
        while (op := self._ag_queue.get()) is not None:
            if not op.net_done.wait(self.timeout + 30):
                op.error = op.error or BpsTimeoutError(
                    f"local rank {self.local_rank}: network stage of a {op.tensor.numel()}-element collective "
                    f"did not finish within {self.timeout + 30}s"
                )
            if op.error is None:
                try:
                    self.local[1].all_gather(op.slice_, op.tensor)
                except BaseException as e:  # noqa: BLE001
                    op.error = e
            self._finish(op)

    def _finish(self, op: _Op) -> None:
        # [decompress] slots in here. Completed off the client's threads (see module docstring).
        try:
            self._completer.submit(_complete, op.future, op.tensor, op.error)
        except RuntimeError:  # closing: nobody can be blocked on our threads any more
            _complete(op.future, op.tensor, op.error)

    def close(self) -> None:
        if self.local is not None:
            self._rs_queue.put(None)
            self._ag_queue.put(None)
            for t in self._threads:
                t.join(timeout=5)
        self._completer.shutdown(wait=False, cancel_futures=False)


def _exception_of(fut: torch.futures.Future) -> BaseException | None:
    try:
        fut.value()
    except BaseException as e:  # noqa: BLE001 - handed to the op's future
        return e
    return None


def _complete(future: torch.futures.Future, value: torch.Tensor, error: BaseException | None) -> None:
    if error is None:
        future.set_result(value)
    else:
        future.set_exception(error if isinstance(error, BpsError) else BpsError(f"push_pull failed: {error}"))
