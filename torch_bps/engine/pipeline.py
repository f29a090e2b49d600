"""The worker pipeline: one collective's tensors, stage by stage, to one completion.

    local reduce-scatter -> cast to the wire dtype -> cut into partitions (compressed: encoded) -> push/pull
      through the C++ client, which schedules them (priority, credit) -> decode, cast back -> local all-gather
      -> done(error)

A collective is a list of 1-D tensors, each summed in place or, as an `Exchange` (exchange.py), gathered
from the ranks' ranges (COPY) and/or read back only in part; all their partitions go down to the client in one
`push_pull_batch`, which completes once, on one of the C++ client's completion threads. Those threads (and the
callers' own, below) may block in `done` (torch's PowerSGD hook waits on further collectives inside its
callbacks): the client's completion pool then starts another thread, so nested collectives always make progress.

Every wait has a bound. The client bounds each request (its timeout) and its error, naming server, key and round,
ends the network stage. What no request bounds, a collective whose network stage never ends with nothing in flight
(a lost completion: a bug), a stall check does: one thread fails it when no partition was sent or acknowledged for
longer than any request may take (`stall_seconds`).

With one local rank the local stages are skipped and partitions are views of the caller's tensors. With
several, the machine is one worker to the servers, and each collective goes through three named steps:

    reduce-scatter (its caller, or the stage thread) -> network (the client) -> all-gather and `done` (whoever
      ended the network)

The local reduce-scatters run in submission order, because every local rank must meet the others in the same
sequence (a COPY tensor's first step is a local all-gather of the local ranks' ranges instead, so that the
machine pushes its ranks' bytes once): one thread at a time holds the reduce-scatter channel and reduce-scatters
and schedules the waiting collectives in order. A caller that finds the channel free takes it and runs its own
collective's reduce-scatter and hand-over to the client on its own thread, without a hand-off; but a caller must
not wait for its local peers (an async collective returns before they launch theirs), so its call waits at most
PATIENCE at the first local meeting and, if the peers have not all come, pauses (LocalComm's steps), and the
stage thread ("bps-local-rs") finishes it, then the collectives waiting behind; a caller whose collective has
others waiting behind it hands the channel to the stage thread too. The network stage is fully pipelined across
collectives. The all-gathers must keep submission order too, and take turns the same way: the thread that ends a
collective's network stage gathers it and runs its `done` at once when it is next in order (the "gatherer"; one
at a time); the collectives ready behind it go to a fresh completion task before `done` runs, because `done` may
block on a later collective.

`run_staged` sums a device tensor instead through a stager (pg.device.PartitionPipeline) that copies each partition
to the host, hands it to the client as one batch, and copies its sum back; collectives scheduled while it still has
partitions to hand over go to the client behind them (one local rank per machine).

With a wire dtype (Config.wire_dtype, precision.py), fp32 sums are cast into 16-bit staging buffers right before
their partitions go to the client, and the sums cast back as soon as the network stage ends, before anyone may
gather them. With a compressor (Config.compressor, compress.py), the partitions of tensors that ask for it
(`Exchange.compress`: bps_hook's gradients) are encoded with error feedback as they are cut, and the servers'
encoded sums decoded at the same point the casts back run. When the machine is the whole job (`alone`) the local
stages already make the result: nothing goes to a server, and the thread that reduce-scattered a collective ends
its network stage at once and gathers it when it is next: its caller, then completing it on its own thread (its
all-gather too waits for the peers at most PATIENCE, then a completion task finishes it), or the stage thread with
none waiting behind (else a completion task gathers it).

Why a thread that reduce-scatters may gather, and only so: a thread that drives both local channels must meet its
peers' threads in the same interleaving. It gathers only the collective it has just reduce-scattered, with
nothing before it left to gather, so its sequence is always reduce-scatter k, all-gather k, reduce-scatter
k + 1; a completion thread only ever gathers. Whoever holds the reduce-scatter channel gathers after its
hand-over to the network, never inside it (`_network_done` leaves that to it).

May import: torch, torch_bps.errors, torch_bps.futures, torch_bps.wire, torch_bps.engine.
"""

from __future__ import annotations

import collections
import functools
import logging
import queue
import threading
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field

import torch

from torch_bps.engine.compress import Compressor
from torch_bps.engine.exchange import Exchange, intersect
from torch_bps.engine.partition import KeyBook, Part
from torch_bps.engine.precision import StagingBuffers, travels_as
from torch_bps.engine.spans import describe, span
from torch_bps.errors import BpsTimeoutError
from torch_bps.futures import completer
from torch_bps.wire import Mode, Partition

log = logging.getLogger("torch_bps.engine")

Done = Callable[[BaseException | None], None]

# How long a caller's thread waits for its local peers at a collective's first local meeting before it hands the
# collective to another thread: long enough for ranks that run in step, short beside any timeout.
PATIENCE = 0.002
_DRIVE = object()  # the stage thread's cue: the reduce-scatter channel is yours, work through the waiting collectives


@dataclass
class _Op:
    items: Sequence[Exchange]  # 1-D, contiguous, CPU tensors: summed or gathered in place
    plans: list[list[Part]]  # this rank's partitions of each tensor
    priority: int
    done: Done
    slices: list[torch.Tensor] = field(default_factory=list)  # several local ranks: this rank's reduced slices
    # A wire dtype: item index -> (where this rank's slice starts in the tensor, that slice in the wire dtype)
    staged: dict[int, tuple[int, torch.Tensor]] = field(default_factory=dict)
    # Compressed partitions: (key, round, the pulled encoded sum, where its decoding goes)
    encoded: list[tuple[int, int, torch.Tensor, torch.Tensor]] = field(default_factory=list)
    error: BaseException | None = None
    sent_at: float = 0.0  # when its partitions went to the client (time.monotonic())
    # Under the engine's _state lock. ending: one ending took it (a late second one is ignored); network_ended: its
    # result is in the caller's tensors (cast back), so it may be gathered.
    ending: bool = False
    network_ended: bool = False
    pull_only: bool = False  # push nothing, pull the rounds' sums (a worker catching up on backup rounds)
    stage_span: Done | None = None  # closes the profiler span of the local stage under way (_run_stage)
    sliced: bool = False  # a staged slice whose local stages run on the device (run_staged): none to gather here


class PushPullEngine:
    """Sum tensors over every worker of the job through the summation service.

    Args:
        client: a torch_bps.client.Client (worker = this machine, num_workers = machines); it schedules the
            partitions within its credit of bytes in flight.
        keys: the KeyBook (partitioning and placement).
        local_channels: (reduce_scatter, all_gather) LocalComm channels among this machine's ranks, or None for
            one rank per machine. Two channels, because the two steps run on different threads and each
            channel needs its calls in the same order on every local rank.
        local_rank: this rank's index within its machine.
        timeout: the client's request timeout; a local stage waits a little longer for the network stage, so
            the client's own error (naming server, key and round) is the one that surfaces.
        worker_ranks: the group ranks this engine's worker stands for (this machine's, in local rank order);
            default: the client's worker index times the local size, onwards.
        alone: this machine is the whole job: the local stages make the sum (or the gather) and nothing goes to
            a server.
        router: a torch_bps.failover.Router: partitions go through it (it follows keys across failovers)
            instead of straight to the client.
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
        self.compressor = None if alone else compressor
        self.wire_dtype = None if alone else wire_dtype  # alone, nothing goes on a wire
        self._staging = StagingBuffers()
        self.router = router
        self.alone = alone
        self._worker_ranks = worker_ranks
        self.keys = keys
        self.local_channels = local_channels
        self.local_rank = local_rank
        self.timeout = timeout
        self._lock = threading.Lock()  # collectives may come from several threads; plans must stay in order
        # Under _state: the collectives in their network stage, by id (for the stall check, and the thread that runs
        # it); with several local ranks, those not yet gathered, in submission order, and whether a gatherer runs.
        self._state = threading.Lock()
        self._in_network: dict[int, _Op] = {}
        self._stall_check: threading.Thread | None = None
        self._closing = threading.Event()
        self._to_gather: collections.deque[_Op] = collections.deque()
        self._gathering = False
        self._handed = 0  # collectives gathered off the thread that reduce-scattered them (counted by the gatherer)
        # Under _state, with several local ranks: the collectives whose local reduce-scatter has not begun, in
        # submission order, and the thread that holds the reduce-scatter channel (the one that works through them).
        self._rs_waiting: collections.deque[_Op] = collections.deque()
        self._rs_holder: int | None = None
        self._stage_thread: threading.Thread | None = None
        self._stager = None  # the PartitionPipeline of run_staged, once used
        if local_channels is not None:
            self._rs_queue: queue.Queue = queue.Queue()  # the stage thread's cues: _DRIVE, (op, paused steps), None
            self._stage_thread = threading.Thread(target=self._reduce_scatter_loop, name="bps-local-rs", daemon=True)
            self._stage_thread.start()

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
        if pull_only and (self.local_channels is not None or any(x.mode != Mode.SUM for x in items)):
            raise ValueError("pull_only takes summed tensors, with one local rank per worker")
        mine = self.local_rank if self.local_channels is not None else 0
        done = span(lambda: _span_name(f"collective ({_modes(items)})", items), done)
        with self._lock:
            plans = [self.keys.plan(x.tensor.numel(), self._travels_as(x), x.mode, self._codec(x))[mine] for x in items]
            op = _Op(items, plans, priority, done, pull_only=pull_only)
            if self.local_channels is None:
                self._schedule(op)
                return
            with self._state:
                self._to_gather.append(op)  # before its network stage can end: gathers keep submission order
                self._rs_waiting.append(op)
                lead = self._rs_holder is None
                if lead:
                    self._rs_holder = threading.get_ident()
        if lead:  # outside the lock: another thread may launch the next collective meanwhile
            self._lead(op)

    def run_staged(self, tensor: torch.Tensor, stager, done: Done, *, priority: int = 0, sliced: bool = False,
                   prepare: Callable[[], None] | None = None) -> None:  # fmt: skip
        """Sum a device tensor in place, one partition at a time through `stager` (a pg.device.PartitionPipeline):
        each partition is copied to a pinned slot, pushed and pulled on its own, and copied back, the copy of the
        next one overlapping its push; then `done(error or None)`. Returns at once.

        A tensor that travels as its own dtype (the caller casts to a wire dtype); every rank calls it for the same
        collective. One local rank per machine, or with `sliced` several, whose local stages ran on the device
        (pg/device_local.py): then only this local rank's slice goes out, already summed over the machine by
        `prepare`, which the stager runs first on its thread. Collectives launched while partitions are still to be
        handed over wait behind them (`_schedule`), so every key's rounds reach the client in one order on every rank.
        """
        if (why := self.cannot_stage(tensor, sliced)) is not None:
            raise ValueError(f"run_staged: {why}")
        done = span(lambda: _span_name("collective (staged sum)", [Exchange(tensor)]), done)
        with self._lock:
            if self._stager is not None and self._stager is not stager:
                raise ValueError("one PushPullEngine stages through one PartitionPipeline")
            self._stager = stager
            mine = self.local_rank if sliced else 0
            plan = self.keys.plan(tensor.numel(), tensor.dtype, Mode.SUM)[mine]
            base = self._slice_range(tensor.numel())[0] if sliced else 0
            op = _Op([Exchange(tensor)], [plan], priority, done, sliced=sliced)

            def push(i: int, host: torch.Tensor, pulled: Done) -> None:
                if i == 0:  # the network stage begins (after `prepare`, which may wait for the local peers)
                    with self._state:
                        op.sent_at = time.monotonic()
                        if not op.ending:
                            self._in_network[id(op)] = op
                        self._start_stall_check()
                p = plan[i]
                self._submit(
                    [Partition(host, p.key, p.server, host, Mode.SUM, p.numel, 0, 0)], priority, pulled, pulled
                )

            stager.start(tensor, [(base + p.start, base + p.start + p.numel) for p in plan], push,
                         lambda error: self._network_done(op, error), prepare=prepare)  # fmt: skip

    def cannot_stage(self, tensor: torch.Tensor, sliced: bool = False) -> str | None:
        """Why `run_staged` cannot take `tensor` (with `sliced`: this local rank's slice of it), or None if it can."""
        if self.alone:
            return "the machine is the whole job: there are no servers to reach"
        if self.local_channels is not None and not sliced:
            return "with several local ranks per machine only slices summed on the device are staged (sliced)"
        if sliced and self.local_channels is None:
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
            return self.keys.keys_of(None if every_slice else self.local_rank if self.local_channels is not None else 0)

    @property
    def worker_ranks(self) -> Sequence[int]:
        if self._worker_ranks is None:
            size = self.local_channels[0].local_size if self.local_channels is not None else 1
            self._worker_ranks = range(self.client.worker * size, (self.client.worker + 1) * size)
        return self._worker_ranks

    # -- step 1: local reduce-scatter (several local ranks only), by the thread that holds the reduce-scatter channel
    def _lead(self, op: _Op) -> None:
        """On the thread that launched `op` and took the channel with it: reduce-scatter and schedule op here if its
        local peers come within PATIENCE (else the stage thread goes on with it), give the channel to the stage
        thread if collectives wait behind op, and gather op if it is the next to gather."""
        with self._state:
            self._rs_waiting.popleft()  # op
        steps = self._reduce_scatter_steps(op, PATIENCE)
        if not self._reduce_scatter(op, steps):  # its peers are late; the caller must not wait for them
            with self._state:
                self._rs_holder = self._stage_thread.ident
            self._rs_queue.put((op, steps))
            return
        with self._state:
            behind = bool(self._rs_waiting)
            self._rs_holder = self._stage_thread.ident if behind else None
            gather = self._may_gather(op)
        if behind:
            self._rs_queue.put(_DRIVE)
        if gather:
            self._gather_next(PATIENCE)

    def _reduce_scatter_loop(self) -> None:
        """The stage thread: given the channel, it finishes a collective whose local peers were late, then
        reduce-scatters and schedules the collectives waiting, in order, and lets go of the channel when none is
        left. It gathers a collective itself only right after reduce-scattering it, with none waiting behind."""
        while (cue := self._rs_queue.get()) is not None:
            if cue is not _DRIVE:
                op, steps = cue
                while not self._reduce_scatter(op, steps):
                    pass  # resumed, a paused call waits for its peers as long as its timeout allows: never taken
                self._after_reduce_scatter(op)
            while True:
                with self._state:
                    if not self._rs_waiting:
                        self._rs_holder = None
                        break
                    op = self._rs_waiting.popleft()
                self._reduce_scatter(op, self._reduce_scatter_steps(op, None))
                self._after_reduce_scatter(op)

    def _after_reduce_scatter(self, op: _Op) -> None:
        """On the stage thread: gather op here if it is next with none waiting behind it, else on a completion thread
        (the channel's next collective goes first); `done` always on a completion thread, as it may block."""
        with self._state:
            gather = self._may_gather(op)
            behind = bool(self._rs_waiting)
        if gather and behind:
            self.client.post(functools.partial(self._gather_next, handed=True))
        elif gather:
            self._gather_next(post_done=True)

    def _reduce_scatter(self, op: _Op, steps) -> bool:
        """Run op's local reduce-scatter steps on, then hand its partitions to the network (alone: end its network
        stage); False if the steps paused, its local peers late. Its gathering is left to the holder of the channel."""
        try:
            if not self._run_stage(op, "local_reduce_scatter", steps):
                return False
        except BaseException as e:  # noqa: BLE001 - nothing was sent: the op fails, the channel serves the next one
            self._network_done(op, e)
            return True
        self._schedule(op)
        return True

    def _reduce_scatter_steps(self, op: _Op, patience: float | None):
        """op's local reduce-scatter as LocalComm steps (local/comm.py): with `patience`, they pause if the local
        peers have not all come to the first meeting within it. Later meetings never pause: the peers are in this
        collective already."""
        comm = self.local_channels[0]
        for x in op.items:
            t = x.tensor
            lo, hi = comm.slice_range(t.numel())
            if x.mode == Mode.COPY:
                if (yield from self._share_local_ranges(x, patience)):
                    patience = None
                op.slices.append(t[lo:hi])
            else:  # in place: my slice of the sum lands in my own tensor (big fresh buffers page-fault)
                op.slices.append((yield from comm.reduce_scatter_steps(t, out=t[lo:hi], patience=patience)))
                patience = None

    def _share_local_ranges(self, x: Exchange, patience: float | None):
        """Give every local rank the other local ranks' COPY ranges, so the machine pushes them once; as steps that
        return whether the local ranks met (not when every range is empty).

        Ranges may differ in length (a broadcast's root has all, the others none): each rank's goes into a
        block of the longest one's size, and one local all-gather of the blocks moves them all.
        """
        comm, me, t = self.local_channels[0], self.local_rank, x.tensor
        ranges = [x.push[r] for r in self.worker_ranks]
        block = max(hi - lo for lo, hi in ranges)
        if block == 0:
            return False
        blocks = torch.empty(comm.local_size * block, dtype=t.dtype)
        lo, hi = ranges[me]
        blocks[me * block : me * block + hi - lo].copy_(t[lo:hi])
        yield from comm.all_gather_steps(blocks[me * block : (me + 1) * block], blocks, patience=patience)
        for i, (lo, hi) in enumerate(ranges):
            if i != me:
                t[lo:hi].copy_(blocks[i * block : i * block + hi - lo])
        return True

    # -- step 2: fp32 sums into staging buffers of the wire dtype (precision.py), and back once pulled
    def _travels_as(self, x: Exchange) -> torch.dtype:
        return x.tensor.dtype if self._codec(x) else travels_as(x.tensor, x.mode, self.wire_dtype)

    def _codec(self, x: Exchange) -> int:
        """The codec word x's keys carry: the compressor's for an fp32 all-reduce that asks for it, else 0."""
        whole = x.mode == Mode.SUM and x.push is None and x.pull is None and x.tensor.dtype == torch.float32
        return self.compressor.word if self.compressor is not None and x.compress and whole else 0

    def _decode(self, op: _Op) -> None:
        """Decode each compressed partition's pulled sum into the caller's tensor (skipped for a failed one: a late
        reply may still be written into its buffers)."""
        try:
            for key, rnd, pulled, out in op.encoded if op.error is None else ():
                self.compressor.decode(key, rnd, pulled, out)
        except BaseException as e:  # noqa: BLE001 - the collective fails with it
            op.error = op.error or e
        op.encoded.clear()

    def _cast_to_wire(self, op: _Op) -> None:
        for i, x in enumerate(op.items):
            if self._travels_as(x) != x.tensor.dtype:
                lo, hi = self._slice_range(x.tensor.numel())
                op.staged[i] = (lo, self._staging.cast(x.tensor[lo:hi], self.wire_dtype))

    def _cast_back(self, op: _Op) -> None:
        """Write each staged sum into the caller's tensor (what this worker pulled of it) and give its buffer back.
        A failed collective's buffers are dropped instead: a late reply may still be written into them."""
        try:
            for i, (lo, staged) in op.staged.items():
                if op.error is not None:
                    continue
                x = op.items[i]
                a, b = intersect(x.pulled_by(self._ranks(x)), lo, lo + staged.numel())
                x.tensor[a:b].copy_(staged[a - lo : b - lo])
                self._staging.give(staged)
        except BaseException as e:  # noqa: BLE001 - the collective fails with it
            op.error = op.error or e
        op.staged.clear()

    # -- step 3: partitions onto the network, in one batch the client schedules (priority, credit)
    def _schedule(self, op: _Op) -> None:
        try:
            self._cast_to_wire(op)
            plans = zip(op.items, op.plans, strict=True)
            parts = [] if self.alone else [p for i, (x, plan) in enumerate(plans) for p in self._parts(op, i, plan)]
        except BaseException as e:  # noqa: BLE001 - nothing was sent: the op fails
            self._network_done(op, e)
            return
        if not parts:
            self._network_done(op, None)
            return
        done = span(lambda: self._network_name(parts), lambda error: self._network_done(op, error))
        with self._state:
            op.sent_at = time.monotonic()
            self._in_network[id(op)] = op
            self._start_stall_check()
        failed = functools.partial(self._network_done, op)
        if self._stager is not None and self._stager.pending():  # behind the staged partitions not yet handed over
            self._stager.after(lambda: self._submit(parts, op.priority, done, failed))
        else:
            self._submit(parts, op.priority, done, failed)

    def _submit(self, parts: list[Partition], priority: int, done: Done, failed: Done) -> None:
        """Hand `parts` to the client (or the router), `done` once they end; `failed` if they could not be handed."""
        try:
            if self.router is not None:
                self.router.submit(parts, priority, done)
            else:
                self.client.push_pull_batch(parts, priority=priority, on_done=done)
        except BaseException as e:  # noqa: BLE001 - the collective fails, as a failed partition would
            failed(e)

    def _start_stall_check(self) -> None:  # under _state
        if self._stall_check is None:
            self._stall_check = threading.Thread(target=self._check_stalls, name="bps-stall-check", daemon=True)
            self._stall_check.start()

    def _network_name(self, parts: list[Partition]) -> str:
        keys = [p.key for p in parts]
        servers = ", ".join(self.client.servers[i] for i in sorted({p.server for p in parts}))
        return f"torch_bps::network {len(parts)} partitions, keys {min(keys):#x}..{max(keys):#x}, servers {servers}"

    def _slice_range(self, numel: int) -> tuple[int, int]:
        """This local rank's slice of a tensor of numel elements: what it pushes and pulls for its machine."""
        return self.local_channels[0].slice_range(numel) if self.local_channels is not None else (0, numel)

    def _ranks(self, x: Exchange) -> Sequence[int]:
        return self.worker_ranks if x.push is not None or x.pull is not None else ()

    def _parts(self, op: _Op, index: int, plan: list[Part]) -> list[Partition]:
        """This rank's partitions of one tensor, as push_pull_batch takes them."""
        x = op.items[index]
        # Parts are cut from this local rank's slice: `base` is where it starts in the tensor. A staged tensor's
        # partitions are views of its staging buffer, which holds the slice from `base` on.
        base = self._slice_range(x.tensor.numel())[0]
        t, at = (x.tensor, 0) if index not in op.staged else (op.staged[index][1], base)
        if codec := self._codec(x):
            return self._encoded_parts(op, x, base, plan, codec)
        ranks = self._ranks(x)
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
            if op.pull_only:  # an empty push: the client sends only the PULL
                pushing, out = t[lo - at : lo - at], t[lo - at : hi - at]
            parts.append(Partition(pushing, part.key, part.server, out, x.mode, part.numel, src[0] - lo, dst[0] - lo))
        return parts

    def _encoded_parts(self, op: _Op, x: Exchange, base: int, plan: list[Part], codec: int) -> list[Partition]:
        """A compressed all-reduce's partitions: each encoded (with its key's error feedback) into a payload of its
        own, its encoded sum pulled into another and decoded into the tensor when the network stage ends. Pulling
        only (backup workers catching up), nothing is encoded: the round's sum is pulled and decoded."""
        parts = []
        for part in plan:
            dense = x.tensor[base + part.start : base + part.start + part.numel]
            if op.pull_only:  # the round still counts: random-k's indices follow the count
                payload, rnd = dense[:0], self.compressor.skip(part.key)
            else:
                payload, rnd = self.compressor.encode(part.key, dense)
            pulled = torch.empty(self.compressor.wire_numel(part.numel))
            op.encoded.append((part.key, rnd, pulled, dense))
            parts.append(Partition(payload, part.key, part.server, pulled, Mode.SUM, pulled.numel(), 0, 0, codec,
                                   part.numel))  # fmt: skip
        return parts

    def _network_done(self, op: _Op, error: BaseException | None) -> None:
        with self._state:
            if op.ending:
                return  # the stall check ended it already: a completion after that changes nothing
            op.ending = True
            self._in_network.pop(id(op), None)
            op.error = op.error or error
        if op.encoded:
            self._decode(op)  # before network_ended, like the casts back
        if op.staged:
            self._cast_back(op)  # before network_ended: a gatherer must find the sum in the caller's tensor
        with self._state:
            op.network_ended = True
            if self.local_channels is None or op.sliced:
                gather = False
            elif threading.get_ident() == self._rs_holder:
                return  # the holder of the reduce-scatter channel gathers it when it may (_lead, _after_reduce_scatter)
            elif not self._may_gather(op):
                return  # the gatherer, or the collective ahead of it when it ends, gathers it in turn
            else:
                gather = True
        if gather:
            self._gather_next(handed=True)
        else:
            op.done(op.error)

    # -- step 4: local all-gather and completion, by the one gatherer (several local ranks only)
    def _may_gather(self, op: _Op) -> bool:
        """Under _state: take the gatherer's role if op is the next to gather, its network stage ended, and no one
        gathers."""
        if self._gathering or not self._to_gather or self._to_gather[0] is not op or not op.network_ended:
            return False
        self._gathering = True
        return True

    def _gather_next(self, patience: float | None = None, *, handed: bool = False, post_done: bool = False) -> None:
        """Gather the first collective not yet gathered (its network stage ended) and complete it; the caller holds
        the gatherer's role, which passes to a fresh completion task if the next one is ready too. With `patience`
        (a caller's thread, which must not wait for its peers), a completion task goes on with the all-gather if
        the local peers do not come within it. `handed`: off the thread that reduce-scattered it."""
        with self._state:
            op = self._to_gather.popleft()
        self._handed += handed
        steps = self._all_gather_steps(op, patience)
        if not self._local_all_gather(op, steps):
            self.client.post(functools.partial(self._gathered, op, steps, post_done))
            return
        self._gathered(op, None, post_done)

    def _gathered(self, op: _Op, steps, post_done: bool) -> None:
        """Finish op's all-gather (`steps`, if it paused), pass the gatherer's role on, complete op."""
        if steps is not None:
            while not self._local_all_gather(op, steps):
                pass
        with self._state:
            more = bool(self._to_gather) and self._to_gather[0].network_ended
            self._gathering = more
        if more:  # before `done`, which may block on a later collective
            self.client.post(functools.partial(self._gather_next, handed=True))
        if post_done:  # `done` may block: never on the stage thread
            self.client.post(lambda: op.done(op.error))
        else:
            op.done(op.error)

    def _all_gather_steps(self, op: _Op, patience: float | None):
        """op's local all-gather as LocalComm steps; with `patience`, they pause as _reduce_scatter_steps' do."""
        if op.error is not None:  # failed: nothing to gather
            if op.slices and len(op.slices) == len(op.items):  # after the reduce-scatter: the peers come, tell them
                comm = self.local_channels[1]
                yield from comm.all_gather_steps(op.slices[0], op.items[0].tensor, patience=patience, failed=True)
            return
        for slice_, x in zip(op.slices, op.items, strict=True):
            yield from self.local_channels[1].all_gather_steps(slice_, x.tensor, patience=patience)
            patience = None

    def _local_all_gather(self, op: _Op, steps) -> bool:
        """Run op's all-gather steps on; False if they paused. Whatever raises, the op ends with it: a gatherer that
        dies leaves every later collective unfinished."""
        try:
            return self._run_stage(op, "local_all_gather", steps)
        except BaseException as e:  # noqa: BLE001
            op.error = op.error or e  # a failed collective keeps its own error; its peers get this one
            return True

    @staticmethod
    def _run_stage(op: _Op, what: str, steps) -> bool:
        """Run a local stage's steps on (`_go_on`) under one profiler span, from the thread where the stage began to
        wherever it ends."""
        if op.stage_span is None:
            op.stage_span = span(lambda: _span_name(what, op.items), _ignore)
        try:
            ended = _go_on(steps)
        except BaseException:
            ended = True
            raise
        finally:
            if ended:
                op.stage_span(None)
                op.stage_span = None
        return ended

    @property
    def stall_seconds(self) -> float:
        """How long nothing may be sent or acknowledged while a network stage is open: longer than any request may
        take, so every request sent has ended by then (a pull may take a tenth more than the timeout); in proportion,
        so that a short timeout stays short."""
        return self.timeout + max(5.0, self.timeout / 5)

    def _check_stalls(self) -> None:
        """Fail every collective whose network stage stayed open while nothing moved for `stall_seconds`.

        The timeout bounds requests, not collectives: a big one over a slow link takes as long as it needs while its
        partitions move, so only a stage that stopped fails here. A failover holds collectives with nothing moving,
        bounded by its own waits: it counts as moving."""
        wait = self.stall_seconds
        progress, moved = self._progress(), time.monotonic()
        while not self._closing.wait(wait / 8):
            try:
                now, before, progress = time.monotonic(), progress, self._progress()
                if progress != before or (self.router is not None and self.router.failing_over()):
                    moved = now
                    continue
                with self._state:
                    stuck = [op for op in self._in_network.values() if now - max(op.sent_at, moved) >= wait]
                    for op in stuck:
                        del self._in_network[id(op)]
                for op in stuck:  # ended on a completion thread: `done` may block (see the module's docstring)
                    self.client.post(functools.partial(self._network_done, op, self._stalled(op, wait)))
            except Exception:  # noqa: BLE001 - the check must outlive a client that is closing under it
                log.exception("torch_bps: the stall check failed once; it goes on")

    def _stalled(self, op: _Op, wait: float) -> BpsTimeoutError:
        keys = [p.key for plan in op.plans for p in plan]
        which = f"keys {min(keys):#x}..{max(keys):#x}" if keys else "no keys"
        who = f"local rank {self.local_rank}: " if self.local_channels is not None else ""
        return BpsTimeoutError(
            f"{who}the network stage of a collective of {_size(op.items)} ({which}) has not ended and no partition "
            f"was sent or acknowledged in the last {wait:.1f} s"
        )

    def _progress(self) -> list[tuple[int, int]]:
        """What moves while network stages work: batch parts sent and acknowledged, by every client in use."""
        clients = self.router.clients() if self.router is not None else [self.client]
        return [(s["parts_sent"], s["parts_acknowledged"]) for s in (c.scheduler_stats() for c in clients)]

    def close(self) -> None:
        self._closing.set()
        if self._stall_check is not None:
            self._stall_check.join(timeout=5)
        if self._stage_thread is not None:
            self._rs_queue.put(None)
            self._stage_thread.join(timeout=5)


def _ignore(error: BaseException | None) -> None:
    pass


def _go_on(steps) -> bool:
    """Run a LocalComm call's steps (generators: local/comm.py) until they end (True) or pause, the local peers late
    (False: any one thread may run them on later)."""
    try:
        next(steps)
    except StopIteration:
        return True
    return False


def _span_name(what: str, items: Sequence[Exchange]) -> str:
    return f"torch_bps::{what} {_size(items)}"


def _size(items: Sequence[Exchange]) -> str:
    return describe(sum(x.tensor.numel() * x.tensor.element_size() for x in items), len(items))


def _modes(items: Sequence[Exchange]) -> str:
    return "/".join(sorted({Mode(x.mode).name.lower() for x in items}))
