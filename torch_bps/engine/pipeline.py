"""The worker pipeline: one collective's tensors, stage by stage, to one completion.

    local reduce-scatter -> to the wire (casts, codecs) -> push/pull through the C++ client, which schedules the
      partitions (priority, credit) -> from the wire -> local all-gather -> done(error)

`PushPullEngine` only composes its stages, each an object it owns: the local stages (local_stages.py: with several
local ranks, the reduce-scatter and all-gather among them in submission order), the network stage (here: one batch
per collective to the client, or the failover router, which completes once, on a completion thread), the stall
check (stall.py) and the wire transform (wire_transform.py: the wire dtype's casts, the codec, pull-only rounds).
A collective is a list of 1-D tensors, each summed in place or, as an `Exchange` (exchange.py), gathered from the
ranks' ranges (COPY) and/or read back only in part. With one local rank there are no local stages and partitions
are views of the caller's tensors; when the machine is the whole job (`alone`) nothing goes to a server.

Completion threads (and callers' own) may block in `done` (torch's PowerSGD hook waits on further collectives
inside its callbacks): the client's completion pool then starts another thread, so nested collectives always make
progress. `run_copied` sums a device tensor instead through a partition copier (device.pinned.PartitionPipeline).

May import: torch, torch_bps.errors, torch_bps.futures, torch_bps.wire, torch_bps.engine.
"""

from __future__ import annotations

import functools
import threading
from collections.abc import Callable, Sequence

import torch

from torch_bps.engine.compress import Compressor
from torch_bps.engine.exchange import Exchange
from torch_bps.engine.local_stages import LocalStages
from torch_bps.engine.op import Op, modes, span_name
from torch_bps.engine.partition import KeyBook
from torch_bps.engine.precision import travels_as
from torch_bps.engine.spans import span
from torch_bps.engine.stall import StallCheck
from torch_bps.engine.wire_transform import WireTransform
from torch_bps.futures import Done, completer
from torch_bps.wire import Mode, Partition


class PushPullEngine:
    """Sum tensors over every worker of the job through the summation service.

    Args:
        client: a torch_bps.client.Client (worker = this machine, num_workers = machines); it schedules the
            partitions within its credit of bytes in flight.
        keys: the KeyBook (partitioning and placement).
        local_channels: (reduce_scatter, all_gather) LocalComm channels among this machine's ranks, or None for
            one rank per machine (local_stages.py).
        local_rank: this rank's index within its machine.
        timeout: the client's request timeout; the stall check waits a little longer (stall.py), so the client's
            own error (naming server, key and round) is the one that surfaces.
        worker_ranks: the group ranks this engine's worker stands for (this machine's, in local rank order);
            default: the client's worker index times the local size, onwards.
        alone: this machine is the whole job: the local stages make the sum (or the gather) and nothing goes to
            a server.
        router: a torch_bps.failover.Router, in the client's shape: partitions go through it (it follows keys
            across failovers) instead of straight to the client, which is then its first one.
        wire_dtype: what fp32 sums travel as (torch.bfloat16, torch.float16), or None: as themselves (precision.py).
        compressor: encodes the partitions of tensors whose Exchange asks for it (compress.py); None: none is.
    """

    def __init__(
        self,
        client,
        keys: KeyBook,
        *,
        local_channels=None,
        local_rank: int = 0,
        timeout: float = 300.0,
        worker_ranks: Sequence[int] | None = None,
        alone: bool = False,
        router=None,
        wire_dtype: torch.dtype | None = None,
        compressor: Compressor | None = None,
    ):
        self.client = client
        self.router = router
        self._sink = router if router is not None else client  # where partitions go: both take push_pull_batch
        self.alone = alone
        self.keys = keys
        self.local_channels = local_channels
        self.local_rank = local_rank
        self.timeout = timeout
        self._worker_ranks = worker_ranks
        self._lock = threading.Lock()  # collectives may come from several threads; plans must stay in order
        self._copier = None  # the PartitionPipeline of run_copied, once used
        self.wire = WireTransform(None if alone else wire_dtype, None if alone else compressor)  # alone: no wire
        self.stall = StallCheck(timeout, progress=self._progress, holding=self._holding, fail=self._network_done,
                                post=client.post,
                                who=f"local rank {local_rank}: " if local_channels is not None else "")  # fmt: skip
        self.local: LocalStages | None = None
        if local_channels is not None:
            self.local = LocalStages(local_channels, local_rank, lambda: self.worker_ranks, schedule=self._schedule,
                                     network_done=self._network_done, post=client.post)  # fmt: skip

    @property
    def wire_dtype(self) -> torch.dtype | None:
        return self.wire.wire_dtype

    @property
    def compressor(self) -> Compressor | None:
        return self.wire.compressor

    @property
    def stall_seconds(self) -> float:
        return self.stall.seconds

    def push_pull(self, tensor: torch.Tensor, *, priority: int = 0) -> torch.futures.Future:
        """Sum one tensor in place (see `run`); return a Future of it. For tests and benchmarks."""
        future = torch.futures.Future()
        self.run([tensor], completer(future, tensor), priority=priority)
        return future

    def run(self, tensors: Sequence[torch.Tensor | Exchange], done: Done, *, priority: int = 0,
            pull_only: bool = False) -> None:  # fmt: skip
        """Sum each 1-D contiguous CPU tensor in place over all workers (or exchange it as its `Exchange`
        says), then call `done(error or None)` once.

        `pull_only`: push nothing and overwrite the tensors with their rounds' sums, which the other workers make
        (backup workers: a worker catching up on rounds that closed without it; one local rank per worker).

        Collective: every rank calls it with tensors of the same numels, dtypes and modes, in the same order.
        `done` runs on a completion thread, or inline before run returns: when there is nothing to send, or when the
        machine is the whole job and its local peers meet the caller in time.
        """
        items = [t if isinstance(t, Exchange) else Exchange(t) for t in tensors]
        for x in items:
            t = x.tensor
            if t.device.type != "cpu" or not t.is_contiguous() or t.dim() != 1:
                raise ValueError(f"push_pull takes 1-D contiguous CPU tensors, got {tuple(t.shape)} on {t.device}")
        if pull_only and (self.local is not None or any(x.mode != Mode.SUM for x in items)):
            raise ValueError("pull_only takes summed tensors, with one local rank per worker")
        mine = self.local_rank if self.local is not None else 0
        done = span(lambda: span_name(f"collective ({modes(items)})", items), done)
        with self._lock:
            plans = [self.keys.plan(x.tensor.numel(), self.wire.travels_as(x), x.mode, self.wire.codec(x))[mine]
                     for x in items]  # fmt: skip
            op = Op(items, plans, priority, done, pull_only=pull_only)
            if self.local is None:
                self._schedule(op)
                return
            lead = self.local.submit(op)
        if lead:  # outside the lock: another thread may launch the next collective meanwhile
            self.local.lead(op)

    def run_copied(self, tensor: torch.Tensor, copier, done: Done, *, priority: int = 0, sliced: bool = False,
                   prepare: Callable[[], None] | None = None) -> None:  # fmt: skip
        """Sum a device tensor in place, one partition at a time through `copier` (a device.pinned.PartitionPipeline):
        each partition is copied to a pinned slot, pushed and pulled on its own, and copied back, the copy of the
        next one overlapping its push; then `done(error or None)`. Returns at once.

        A tensor that travels as its own dtype (the caller casts to a wire dtype); every rank calls it for the same
        collective. One local rank per machine, or with `sliced` several, whose local stages ran on the device
        (device/paths.py): then only this local rank's slice goes out, already summed over the machine by
        `prepare`, which the copier runs first on its thread. Collectives launched while partitions are still to be
        handed over wait behind them (`_schedule`), so every key's rounds reach the client in one order on every rank.
        """
        if (why := self.cannot_copy(tensor, sliced)) is not None:
            raise ValueError(f"run_copied: {why}")
        done = span(lambda: span_name("collective (staged sum)", [Exchange(tensor)]), done)
        with self._lock:
            if self._copier is not None and self._copier is not copier:
                raise ValueError("one PushPullEngine stages through one PartitionPipeline")
            self._copier = copier
            mine = self.local_rank if sliced else 0
            plan = self.keys.plan(tensor.numel(), tensor.dtype, Mode.SUM)[mine]
            base = self._slice_range(tensor.numel())[0] if sliced else 0
            op = Op([Exchange(tensor)], [plan], priority, done, sliced=sliced)

            def push(i: int, host: torch.Tensor, pulled: Done) -> None:
                if i == 0:  # the network stage begins (after `prepare`, which may wait for the local peers)
                    self.stall.enter(op)
                p = plan[i]
                part = Partition(host, p.key, p.server, host, Mode.SUM, p.numel, 0, 0)
                self._submit([part], priority, pulled, pulled)

            copier.start(tensor, [(base + p.start, base + p.start + p.numel) for p in plan], push,
                         lambda error: self._network_done(op, error), prepare=prepare)  # fmt: skip

    def cannot_copy(self, tensor: torch.Tensor, sliced: bool = False) -> str | None:
        """Why `run_copied` cannot take `tensor` (with `sliced`: this local rank's slice of it), or None if it can."""
        if self.alone:
            return "the machine is the whole job: there are no servers to reach"
        if self.local is not None and not sliced:
            return "with several local ranks per machine only slices summed on the device are staged (sliced)"
        if sliced and self.local is None:
            return "sliced takes several local ranks per machine"
        if tensor.dim() != 1 or not tensor.is_contiguous():
            return f"it takes a 1-D contiguous tensor, got shape {tuple(tensor.shape)}, stride {tensor.stride()}"
        if travels_as(tensor, Mode.SUM, self.wire_dtype) != tensor.dtype:
            return f"{tensor.dtype} travels as {self.wire_dtype} (the wire dtype): it is cast on the host"
        return None

    def own_keys(self, every_slice: bool = False) -> dict[int, tuple[int, int]]:
        """Every key this rank has pushed or may push so far (with `every_slice`, its machine's) -> (its server as
        placed at the start, its bytes)."""
        with self._lock:
            return self.keys.keys_of(None if every_slice else self.local_rank if self.local is not None else 0)

    @property
    def worker_ranks(self) -> Sequence[int]:
        if self._worker_ranks is None:
            size = self.local.local_size if self.local is not None else 1
            self._worker_ranks = range(self.client.worker * size, (self.client.worker + 1) * size)
        return self._worker_ranks

    @property
    def _handed(self) -> int:
        """Collectives gathered off the thread that reduce-scattered them (local_stages.py)."""
        return self.local.handed if self.local is not None else 0

    # -- the network stage: partitions onto the network, in one batch the client schedules (priority, credit)
    def _schedule(self, op: Op) -> None:
        try:
            self.wire.to_wire(op, self._slice_range)
            parts = [] if self.alone else [p for i, plan in enumerate(op.plans) for p in self._parts(op, i, plan)]
        except BaseException as e:  # noqa: BLE001 - nothing was sent: the op fails
            self._network_done(op, e)
            return
        if not parts:
            self._network_done(op, None)
            return
        done = span(lambda: self._network_name(parts), lambda error: self._network_done(op, error))
        self.stall.enter(op)
        failed = functools.partial(self._network_done, op)
        if self._copier is not None and self._copier.pending():  # behind the copied partitions not yet handed over
            self._copier.after(lambda: self._submit(parts, op.priority, done, failed))
        else:
            self._submit(parts, op.priority, done, failed)

    def _parts(self, op: Op, index: int, plan) -> list[Partition]:
        x = op.items[index]
        return self.wire.parts(op, index, plan, self._slice_range(x.tensor.numel())[0], self._ranks(x))

    def _submit(self, parts: list[Partition], priority: int, done: Done, failed: Done) -> None:
        """Hand `parts` to the client (or the router), `done` once they end; `failed` if they could not be handed."""
        try:
            self._sink.push_pull_batch(parts, priority=priority, on_done=done)
        except BaseException as e:  # noqa: BLE001 - the collective fails, as a failed partition would
            failed(e)

    def _network_done(self, op: Op, error: BaseException | None) -> None:
        if not self.stall.leave(op):
            return  # the stall check ended it already: a completion after that changes nothing
        op.error = op.error or error
        self.wire.from_wire(op, self._ranks)  # before the local stages may gather: the sum is in the caller's tensor
        if self.local is None or op.sliced:
            op.done(op.error)
        else:
            self.local.network_ended(op)

    def _network_name(self, parts: list[Partition]) -> str:
        keys = [p.key for p in parts]
        servers = ", ".join(self.client.servers[i] for i in sorted({p.server for p in parts}))
        return f"torch_bps::network {len(parts)} partitions, keys {min(keys):#x}..{max(keys):#x}, servers {servers}"

    def _slice_range(self, numel: int) -> tuple[int, int]:
        """This local rank's slice of a tensor of numel elements: what it pushes and pulls for its machine."""
        return self.local.slice_range(numel) if self.local is not None else (0, numel)

    def _ranks(self, x: Exchange) -> Sequence[int]:
        return self.worker_ranks if x.push is not None or x.pull is not None else ()

    def _progress(self) -> list[tuple[int, int]]:
        """What moves while network stages work: batch parts sent and acknowledged, by every client in use."""
        clients = self.router.clients() if self.router is not None else [self.client]
        return [(s["parts_sent"], s["parts_acknowledged"]) for s in (c.scheduler_stats() for c in clients)]

    def _holding(self) -> bool:
        return self.router is not None and self.router.failing_over()

    def close(self) -> None:
        self.stall.close()
        if self.local is not None:
            self.local.close()
