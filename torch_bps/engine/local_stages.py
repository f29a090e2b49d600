"""The local stages of a collective on a machine of several local ranks, and their one order.

The machine is one worker to the servers, and each collective goes through three named steps:

    reduce-scatter (its caller, or the stage thread) -> network (`schedule`) -> all-gather and `done` (whoever
      ended the network)

The local reduce-scatters run in submission order, because every local rank must meet the others in the same
sequence (a COPY tensor's first step is a local all-gather of the local ranks' ranges instead, so that the
machine pushes its ranks' bytes once): one thread at a time holds the reduce-scatter channel and reduce-scatters
and schedules the waiting collectives in order. A caller that finds the channel free takes it and runs its own
collective's reduce-scatter and hand-over to the network on its own thread, without a hand-off; but a caller must
not wait for its local peers (an async collective returns before they launch theirs), so its call waits at most
PATIENCE at the first local meeting and, if the peers have not all come, pauses (LocalComm's steps), and the
stage thread ("bps-local-rs") finishes it, then the collectives waiting behind; a caller whose collective has
others waiting behind it hands the channel to the stage thread too. The all-gathers must keep submission order
too, and take turns the same way: the thread that ends a collective's network stage gathers it and runs its `done`
at once when it is next in order (the "gatherer"; one at a time); the collectives ready behind it go to a fresh
completion task before `done` runs, because `done` may block on a later collective. A rank whose collective failed
after its reduce-scatter comes to the all-gather with nothing to give (`failed=True`): its peers fail at once.

When the machine is the whole job (`alone`) the local stages already make the result: `schedule` ends the network
stage at once, and the thread that reduce-scattered a collective gathers it when it is next: its caller, then
completing it on its own thread (its all-gather too waits for the peers at most PATIENCE, then a completion task
finishes it), or the stage thread with none waiting behind (else a completion task gathers it).

Why a thread that reduce-scatters may gather, and only so: a thread that drives both local channels must meet its
peers' threads in the same interleaving. It gathers only the collective it has just reduce-scattered, with
nothing before it left to gather, so its sequence is always reduce-scatter k, all-gather k, reduce-scatter
k + 1; a completion thread only ever gathers. Whoever holds the reduce-scatter channel gathers after its
hand-over to the network, never inside it (`network_ended` leaves that to it).

The stages call the composer back through the callables they are given (`schedule`, `network_done`, `post`), so
they import nothing of it.
May import: torch, torch_bps.futures, torch_bps.wire, torch_bps.engine.
"""

from __future__ import annotations

import collections
import functools
import queue
import threading
from collections.abc import Callable, Sequence

import torch

from torch_bps.engine.exchange import Exchange
from torch_bps.engine.op import Op, span_name
from torch_bps.engine.spans import span
from torch_bps.wire import Mode

# How long a caller's thread waits for its local peers at a collective's first local meeting before it hands the
# collective to another thread: long enough for ranks that run in step, short beside any timeout.
PATIENCE = 0.002
_DRIVE = object()  # the stage thread's cue: the reduce-scatter channel is yours, work through the waiting collectives


class LocalStages:
    """The reduce-scatter and all-gather of each collective among a machine's local ranks, in submission order.

    Args:
        channels: (reduce_scatter, all_gather) LocalComm channels among this machine's ranks. Two channels, because
            the two steps run on different threads and each channel needs its calls in the same order on every
            local rank.
        local_rank: this rank's index within its machine.
        worker_ranks: the group ranks the machine stands for, in local rank order (called when first needed).
        schedule: `schedule(op)` hands a reduce-scattered collective to the network stage.
        network_done: `network_done(op, error)` ends a collective's network stage (here: one whose reduce-scatter
            failed, so nothing was sent).
        post: runs a task on a completion thread (the client's `post`).

    Example: `stages.submit(op)` under the composer's plan lock, then `stages.lead(op)` if it returned True; the
    composer calls `stages.network_ended(op)` when the network stage ends.
    """

    def __init__(self, channels, local_rank: int, worker_ranks: Callable[[], Sequence[int]], *,
                 schedule: Callable[[Op], None], network_done: Callable[[Op, BaseException | None], None],
                 post: Callable[[Callable[[], None]], None]):  # fmt: skip
        self.channels = channels
        self._rs, self._ag = channels
        self.local_rank = local_rank
        self._worker_ranks = worker_ranks
        self._schedule, self._network_done, self._post = schedule, network_done, post
        # Under _lock: the collectives not yet gathered, in submission order, and whether a gatherer runs; those whose
        # reduce-scatter has not begun, in submission order, and the thread that holds the reduce-scatter channel.
        self._lock = threading.Lock()
        self._to_gather: collections.deque[Op] = collections.deque()
        self._gathering = False
        self.handed = 0  # collectives gathered off the thread that reduce-scattered them (counted by the gatherer)
        self._rs_waiting: collections.deque[Op] = collections.deque()
        self._rs_holder: int | None = None
        self._cues: queue.Queue = queue.Queue()  # the stage thread's: _DRIVE, (op, paused steps), None
        self._thread = threading.Thread(target=self._reduce_scatter_loop, name="bps-local-rs", daemon=True)
        self._thread.start()

    def slice_range(self, numel: int) -> tuple[int, int]:
        """This local rank's slice of a tensor of numel elements: what it pushes and pulls for its machine."""
        return self._rs.slice_range(numel)

    @property
    def local_size(self) -> int:
        return self._rs.local_size

    def submit(self, op: Op) -> bool:
        """Queue op for both local stages (under the composer's plan lock, so that every rank queues in one order);
        True if this thread took the reduce-scatter channel with it: then call `lead(op)`, outside that lock."""
        with self._lock:
            self._to_gather.append(op)  # before its network stage can end: gathers keep submission order
            self._rs_waiting.append(op)
            lead = self._rs_holder is None
            if lead:
                self._rs_holder = threading.get_ident()
        return lead

    def network_ended(self, op: Op) -> None:
        """op's network stage ended and its result is in the caller's tensors: gather it here if it is next and
        nobody gathers, else leave it to whoever will."""
        with self._lock:
            op.network_ended = True
            if threading.get_ident() == self._rs_holder:
                return  # the holder of the reduce-scatter channel gathers it when it may (lead, _after_reduce_scatter)
            if not self._may_gather(op):
                return  # the gatherer, or the collective ahead of it when it ends, gathers it in turn
        self._gather_next(handed=True)

    def close(self) -> None:
        self._cues.put(None)
        self._thread.join(timeout=5)

    # -- the reduce-scatter, by the thread that holds the reduce-scatter channel
    def lead(self, op: Op) -> None:
        """On the thread that launched `op` and took the channel with it: reduce-scatter and schedule op here if its
        local peers come within PATIENCE (else the stage thread goes on with it), give the channel to the stage
        thread if collectives wait behind op, and gather op if it is the next to gather."""
        with self._lock:
            self._rs_waiting.popleft()  # op
        steps = self._reduce_scatter_steps(op, PATIENCE)
        if not self._reduce_scatter(op, steps):  # its peers are late; the caller must not wait for them
            with self._lock:
                self._rs_holder = self._thread.ident
            self._cues.put((op, steps))
            return
        with self._lock:
            behind = bool(self._rs_waiting)
            self._rs_holder = self._thread.ident if behind else None
            gather = self._may_gather(op)
        if behind:
            self._cues.put(_DRIVE)
        if gather:
            self._gather_next(PATIENCE)

    def _reduce_scatter_loop(self) -> None:
        """The stage thread: given the channel, it finishes a collective whose local peers were late, then
        reduce-scatters and schedules the collectives waiting, in order, and lets go of the channel when none is
        left. It gathers a collective itself only right after reduce-scattering it, with none waiting behind."""
        while (cue := self._cues.get()) is not None:
            if cue is not _DRIVE:
                op, steps = cue
                while not self._reduce_scatter(op, steps):
                    pass  # resumed, a paused call waits for its peers as long as its timeout allows: never taken
                self._after_reduce_scatter(op)
            while True:
                with self._lock:
                    if not self._rs_waiting:
                        self._rs_holder = None
                        break
                    op = self._rs_waiting.popleft()
                self._reduce_scatter(op, self._reduce_scatter_steps(op, None))
                self._after_reduce_scatter(op)

    def _after_reduce_scatter(self, op: Op) -> None:
        """On the stage thread: gather op here if it is next with none waiting behind it, else on a completion thread
        (the channel's next collective goes first); `done` always on a completion thread, as it may block."""
        with self._lock:
            gather = self._may_gather(op)
            behind = bool(self._rs_waiting)
        if gather and behind:
            self._post(functools.partial(self._gather_next, handed=True))
        elif gather:
            self._gather_next(post_done=True)

    def _reduce_scatter(self, op: Op, steps) -> bool:
        """Run op's local reduce-scatter steps on, then hand it to the network (alone: end its network stage);
        False if the steps paused, its local peers late. Its gathering is left to the holder of the channel."""
        try:
            if not _run_stage(op, "local_reduce_scatter", steps):
                return False
        except BaseException as e:  # noqa: BLE001 - nothing was sent: the op fails, the channel serves the next one
            self._network_done(op, e)
            return True
        self._schedule(op)
        return True

    def _reduce_scatter_steps(self, op: Op, patience: float | None):
        """op's local reduce-scatter as LocalComm steps (local/comm.py): with `patience`, they pause if the local
        peers have not all come to the first meeting within it. Later meetings never pause: the peers are in this
        collective already."""
        for x in op.items:
            t = x.tensor
            lo, hi = self._rs.slice_range(t.numel())
            if x.mode == Mode.COPY:
                if (yield from self._share_local_ranges(x, patience)):
                    patience = None
                op.slices.append(t[lo:hi])
            else:  # in place: my slice of the sum lands in my own tensor (big fresh buffers page-fault)
                op.slices.append((yield from self._rs.reduce_scatter_steps(t, out=t[lo:hi], patience=patience)))
                patience = None

    def _share_local_ranges(self, x: Exchange, patience: float | None):
        """Give every local rank the other local ranks' COPY ranges, so the machine pushes them once; as steps that
        return whether the local ranks met (not when every range is empty).

        Ranges may differ in length (a broadcast's root has all, the others none): each rank's goes into a
        block of the longest one's size, and one local all-gather of the blocks moves them all.
        """
        comm, me, t = self._rs, self.local_rank, x.tensor
        ranges = [x.push[r] for r in self._worker_ranks()]
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

    # -- the all-gather and completion, by the one gatherer
    def _may_gather(self, op: Op) -> bool:
        """Under _lock: take the gatherer's role if op is the next to gather, its network stage ended, and no one
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
        with self._lock:
            op = self._to_gather.popleft()
        self.handed += handed
        steps = self._all_gather_steps(op, patience)
        if not self._local_all_gather(op, steps):
            self._post(functools.partial(self._gathered, op, steps, post_done))
            return
        self._gathered(op, None, post_done)

    def _gathered(self, op: Op, steps, post_done: bool) -> None:
        """Finish op's all-gather (`steps`, if it paused), pass the gatherer's role on, complete op."""
        if steps is not None:
            while not self._local_all_gather(op, steps):
                pass
        with self._lock:
            more = bool(self._to_gather) and self._to_gather[0].network_ended
            self._gathering = more
        if more:  # before `done`, which may block on a later collective
            self._post(functools.partial(self._gather_next, handed=True))
        if post_done:  # `done` may block: never on the stage thread
            self._post(lambda: op.done(op.error))
        else:
            op.done(op.error)

    def _all_gather_steps(self, op: Op, patience: float | None):
        """op's local all-gather as LocalComm steps; with `patience`, they pause as _reduce_scatter_steps' do."""
        if op.error is not None:  # failed: nothing to gather
            if op.slices and len(op.slices) == len(op.items):  # after the reduce-scatter: the peers come, tell them
                yield from self._ag.all_gather_steps(op.slices[0], op.items[0].tensor, patience=patience, failed=True)
            return
        for slice_, x in zip(op.slices, op.items, strict=True):
            yield from self._ag.all_gather_steps(slice_, x.tensor, patience=patience)
            patience = None

    def _local_all_gather(self, op: Op, steps) -> bool:
        """Run op's all-gather steps on; False if they paused. Whatever raises, the op ends with it: a gatherer that
        dies leaves every later collective unfinished."""
        try:
            return _run_stage(op, "local_all_gather", steps)
        except BaseException as e:  # noqa: BLE001
            op.error = op.error or e  # a failed collective keeps its own error; its peers get this one
            return True


def _run_stage(op: Op, what: str, steps) -> bool:
    """Run a local stage's steps on (`_go_on`) under one profiler span, from the thread where the stage began to
    wherever it ends."""
    if op.stage_span is None:
        op.stage_span = span(lambda: span_name(what, op.items), _ignore)
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


def _go_on(steps) -> bool:
    """Run a LocalComm call's steps (generators: local/comm.py) until they end (True) or pause, the local peers late
    (False: any one thread may run them on later)."""
    try:
        next(steps)
    except StopIteration:
        return True
    return False


def _ignore(error: BaseException | None) -> None:
    pass
