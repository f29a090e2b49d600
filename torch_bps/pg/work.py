"""Launching a collective's push_pulls, and the Work the caller gets back.

A collective is a list of `Exchange`s (engine/exchange.py): buffers the Runtime sums (or gathers) in place as
one unit, then their `finish` functions, which copy or reduce the sums to where the caller wants them. Both run,
and the Work's future completes, on one of the C++ client's completion threads (see torch_bps/engine/pipeline.py);
a user's callback that blocks there on another collective (PowerSGD) makes the client start another thread.

The Work is a C++ c10d Work (torch_bps._C.make_work): DDP's reducer and Join call its getFuture() from
C++, its wait() rethrows the collective's error and honours the group's timeout, and a failure is set on
the C++ future, so C++ consumers see an error rather than an exception object posing as a tensor.

Every rank must start a group's collectives in one order: the keys, rounds and local meetings are numbered by it.
A `then` callback that launches a collective (PowerSGD's) runs when its Future completes, on a completion thread, at
a time that differs between ranks; `LaunchOrder` puts its collective where NCCL's inline completion would.

May import: torch, torch_bps.futures, torch_bps.wire, torch_bps.engine.exchange, torch_bps.device; torch_bps._C when a
collective is launched (`import torch_bps` must not load the C++ client).
"""

from __future__ import annotations

import functools
import threading
import weakref
from collections import deque
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any

import torch
import torch.distributed as dist

from torch_bps.device.pinned import completion_context, cuda_ops, order_after_caller
from torch_bps.engine.exchange import Exchange
from torch_bps.futures import fail


@dataclass(eq=False)
class _Launch:
    """One collective in its group's LaunchOrder."""

    nested: bool = False  # launched from a callback of the group's collective: it starts at once
    taken: bool = False  # Python took its future (work.get_future()): callbacks may hang on it
    delivered: bool = False  # its future completed and its callbacks returned


class LaunchOrder:
    """A group's collectives started in the order a program sees them issued, callbacks included.

    NCCL completes a collective's Future at launch, so a `then` callback runs on the caller's thread before the
    caller's next collective, and whatever it launches comes first on every rank. Here a Future completes when its
    sums are back, on a completion thread: a callback's all_reduce (PowerSGD's) and the caller's next collective
    would reach the group in an order that differs between ranks (local ranks meeting in different calls; keys and
    rounds numbered differently). So a collective whose future Python took (`work.get_future()`, the only way to
    attach a callback) holds back the collectives launched after it until its callbacks have returned, and a
    collective launched from inside those callbacks starts at once: the order NCCL gives. A future only C++ takes
    (DDP's reducer), or nobody, holds nothing back; a callback's collective whose future Python took holds them back
    too, until its own callbacks have returned (NCCL runs those inline as well). One limit: a callback attached to a
    future taken after a later collective was launched is not ordered.

    Example: `entry = order.enter(); order.start(entry, lambda: runtime.run(...))`; then `order.taken(entry)` when
    Python takes the future; `order.inside.depth` raised around `future.set_result(...)`; `order.delivered(entry)`.
    """

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._open: list[_Launch] = []  # taken, not yet delivered: what later launches wait for
        self._held: deque[tuple[list[_Launch], Callable[[], None]]] = deque()  # (what it waits for, its start)
        self._starting = False  # a thread is starting held collectives: new ones queue behind them
        self.inside = _Depth()  # deliveries under way on this thread (raised around a set_result)

    def enter(self) -> _Launch:
        """A collective about to be launched (by a callback of one of this group's, if this thread delivers one)."""
        return _Launch(nested=self.inside.depth > 0)

    def start(self, entry: _Launch, run: Callable[[], None], hold: Callable[[], Callable[[], None]]) -> None:
        """Run `run` now, or queue what `hold()` returns (the same start, made to run on another thread later)
        behind the collectives it must follow. Called under the group's launch lock, on the launching thread."""
        if not entry.nested:
            with self._lock:
                waits = list(self._open)
                if waits or self._held or self._starting:
                    self._held.append((waits, hold()))
                    return
        run()

    def taken(self, entry: _Launch) -> None:
        with self._lock:
            entry.taken = True
            if not entry.delivered:
                self._open.append(entry)
                if entry.nested:  # launched by a callback: it and its own callbacks' come before all held now
                    for waits, _ in self._held:
                        waits.append(entry)

    def delivered(self, entry: _Launch) -> None:
        """entry's future completed and its callbacks returned: start what waited for it, in launch order."""
        with self._lock:
            entry.delivered = True
            if entry.taken:  # only a taken entry is ever open
                self._open.remove(entry)
            if self._starting or not self._held:
                return
            self._starting = True
        while True:
            with self._lock:
                if not self._held or any(not e.delivered for e in self._held[0][0]):
                    self._starting = False
                    return
                _, run = self._held.popleft()
            run()


class _Depth(threading.local):
    """How many deliveries this thread is inside."""

    depth = 0


_orders: weakref.WeakKeyDictionary = weakref.WeakKeyDictionary()  # runtime -> LaunchOrder
_orders_lock = threading.Lock()
_internal = threading.local()  # set while this package takes a future for itself (own_future)


def launch_order(runtime) -> LaunchOrder | None:
    """The runtime's LaunchOrder, made on first use (None for a stand-in that cannot be weakly referenced)."""
    try:
        if (order := _orders.get(runtime)) is not None:
            return order
        with _orders_lock:
            return _orders.setdefault(runtime, LaunchOrder())
    except TypeError:
        return None


def own_future(work: dist.Work) -> torch.futures.Future:
    """work's future, taken by this package for a consumer whose callbacks launch no collective (DDP's reducer waits
    on bps_hook's, CrossBarrier's queues a parameter): a take that holds back no later collective."""
    _internal.on = True
    try:
        return work.get_future()
    finally:
        _internal.on = False


def locked(collective):
    """A BackendBPS collective from its checks, path choice and staging to its launch under the Runtime's launch lock
    (`self._launch_lock`): what two threads launch at once (DDP's autograd thread, a hook's callbacks) is then staged
    and launched in one order."""

    @functools.wraps(collective)
    def run(self, *args, **kwargs):
        with self._launch_lock:
            return collective(self, *args, **kwargs)

    return run


def launch(runtime, op: str, exchanges: Sequence[Exchange], result: Any, *, where: str, timeout: float,
           device: torch.device | None = None, priority: int = 0) -> dist.Work:  # fmt: skip
    """Sum (or gather) each exchange's tensor over the group, run the finishes, complete the Work's future with
    `result`. `priority`: the client sends the partitions of a higher one ahead of those queued before them.

    The caller holds the Runtime's launch lock (`Runtime.launch_lock`): collectives stay in one order on every rank.
    Exchanges with no elements send nothing (every rank skips them alike, since shapes must agree).

    Example: `launch(rt, "barrier", [Exchange(torch.zeros(1))], [], where="on group 0", timeout=60)`.
    """
    on_device = device is not None and device.type != "cpu"
    future = cuda_ops().future([device]) if on_device else torch.futures.Future()
    if on_device:  # the finishes may write into outputs the collective only writes (scatter, gather...)
        order_after_caller(device)
    order, what = launch_order(runtime), f"{op} {where}"
    entry = order.enter() if order is not None else None

    def done(error: BaseException | None) -> None:
        # On a completion thread: device set and the side stream current, so copies back and the Future's event
        # are ordered on that stream and never dropped into the training stream (device/pinned.py).
        with completion_context(device if on_device else None):
            if error is None:
                try:
                    for x in exchanges:
                        if x.finish is not None:
                            x.finish()
                except BaseException as e:  # noqa: BLE001 - the collective fails with it
                    error = e
            _deliver(order, entry, future, result, error, what)

    run = functools.partial(runtime.run, [x for x in exchanges if x.tensor.numel() > 0], done, priority=priority)
    return _start(order, entry, run, done, future, timeout, what)


def launch_on_device(runtime, op: str, tensor: torch.Tensor, path, result: Any, *, average: bool, where: str,
                     timeout: float) -> dist.Work:  # fmt: skip
    """Sum (`average`: average) `tensor` (1-D, contiguous, floats on a CUDA device) in place over the group through
    `path` (device.paths.choose's answer: the device local stages, or a partition at a time through pinned memory),
    and complete the Work's future with `result`. The caller holds the Runtime's launch lock.

    Example: `launch_on_device(rt, "allreduce", grad.view(-1), choose(rt, grad, "AVG"), [grad], average=True,
    where="on group 0", timeout=60)`.
    """
    device = tensor.device
    future = cuda_ops().future([device])
    order, what = launch_order(runtime), f"{op} {where}"
    entry = order.enter() if order is not None else None

    def done(error: BaseException | None) -> None:
        with completion_context(device):  # the path calls it with its side stream current
            _deliver(order, entry, future, result, error, what)

    run = functools.partial(path.run, runtime, tensor, average, done)
    return _start(order, entry, run, done, future, timeout, what, device)


def _start(order: LaunchOrder | None, entry: _Launch | None, run: Callable[[], None], done, future, timeout: float,
           what: str, device: torch.device | None = None) -> dist.Work:  # fmt: skip
    """Start a collective (`run`) now or, behind a collective whose callbacks have not run yet, later; return its
    Work, which tells `order` when Python takes its future."""
    if order is None:
        run()
        return make_work(future, timeout, what)

    def hold() -> Callable[[], None]:
        if device is not None:  # the start runs later on another thread, with the side stream current (a device
            order_after_caller(device)  # start records its events on the current stream): after the caller's work

        def later() -> None:  # on a completion thread: nobody to raise to, so the Work fails
            try:
                with completion_context(device):
                    run()
            except BaseException as e:  # noqa: BLE001
                done(e)

        return later

    order.start(entry, run, hold)

    def taken() -> None:
        if not getattr(_internal, "on", False):
            order.taken(entry)

    return make_work(future, timeout, what, taken)


def _deliver(order: LaunchOrder | None, entry: _Launch | None, future, result: Any, error: BaseException | None,
             what: str) -> None:  # fmt: skip
    """Complete the future (its callbacks run here), then start what waited for them."""
    if order is None:
        _settle(future, result, error, what)
        return
    inside = order.inside
    inside.depth += 1  # what the callbacks launch is nested
    try:
        _settle(future, result, error, what)
    finally:
        inside.depth -= 1
    order.delivered(entry)


def _settle(future: torch.futures.Future, result: Any, error: BaseException | None, what: str) -> None:
    """Complete a collective's future: with `result`, or with `error` noting what ran."""
    if error is None:
        future.set_result(result)
        return
    if hasattr(error, "add_note"):
        error.add_note(f"torch_bps: while running {what}")
    fail(future, error)


def make_work(future: torch.futures.Future, timeout: float, what: str, taken: Callable[[], None] | None = None
              ) -> dist.Work:  # fmt: skip
    """The C++ Work over `future` that torch gets: wait() rethrows its error and honours `timeout` (seconds);
    `taken()` runs the first time Python takes its future."""
    from torch_bps import _C

    return _C.make_work(future, timeout, what, taken)
