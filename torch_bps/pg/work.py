"""Launching a collective's push_pulls, and the Work and Future the caller gets back.

Threading contract (why completion has threads of its own):
torch runs a Future's callbacks inside `set_result`, on the thread that completes it, and some callbacks
launch another collective and block on it (torch's PowerSGD hook calls `all_reduce(...).get_future().wait()`
inside `.then`). A Runtime completes its futures from one completion thread, possibly the same one for
every request: running user callbacks there would deadlock on the first nested collective, and would stall
every other group's completions meanwhile. So a Runtime future's done-callback only counts down and hands
the rest to a `Completer`; the Completer's threads copy sums where they belong and complete the future the
caller sees, which runs the caller's callbacks on our thread. When every Completer thread is blocked inside a
caller's callback, the next completion starts a new thread, so nested collectives always make progress.

May import: torch, torch_bps.errors.
"""

from __future__ import annotations

import logging
import queue
import threading
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from datetime import timedelta
from typing import Any

import torch
import torch.distributed as dist

from torch_bps.errors import BpsTimeoutError

log = logging.getLogger("torch_bps")


class Completer:
    """A cached thread pool: runs each submitted function on an idle thread of its own, or on a new thread
    when all of them are busy (blocked in a caller's callback). Idle threads beyond the first exit after
    `keepalive` seconds. Threads are daemons: a callback blocked forever never holds the interpreter at exit.
    """

    def __init__(self, name: str, keepalive: float = 10.0):
        self._name = name
        self._keepalive = keepalive
        self._queue: queue.SimpleQueue[Callable[[], None]] = queue.SimpleQueue()
        self._lock = threading.Lock()
        self._idle = 0  # threads waiting on the queue for which no item is queued yet
        self._threads = 0
        self._spawned = 0

    def submit(self, fn: Callable[[], None]) -> None:
        """Run `fn` soon on a Completer thread. Never blocks: safe inside a Runtime's future callback."""
        with self._lock:
            if self._idle > 0:
                self._idle -= 1  # reserve that thread for fn
                self._queue.put(fn)
                return
            self._threads += 1
            self._spawned += 1
            name = f"{self._name}-{self._spawned}"
        threading.Thread(target=self._run, args=(fn,), name=name, daemon=True).start()

    @property
    def threads(self) -> int:
        """How many threads are alive (for tests: PowerSGD's nesting makes it grow past one)."""
        return self._threads

    def _run(self, fn: Callable[[], None]) -> None:
        while True:
            try:
                fn()
            except BaseException:  # fn completes a future itself; anything escaping is a bug of ours
                log.exception("torch_bps: completion of a collective failed")
            with self._lock:
                self._idle += 1
            while True:
                try:
                    fn = self._queue.get(timeout=self._keepalive)
                    break
                except queue.Empty:
                    with self._lock:
                        # idle = waiting threads minus queued items: if positive, this thread is surplus.
                        if self._idle > 0 and self._threads > 1:
                            self._idle -= 1
                            self._threads -= 1
                            return


class BpsWork(dist._Work):
    """The handle of one collective. `wait` re-raises its failure and honours timeouts; nothing is swallowed.

    torch's `_create_work_from_future` would return True from `wait()` even when the future failed, hence
    this subclass.
    """

    def __init__(self, future: torch.futures.Future, op: str, where: str, timeout: float):
        super().__init__()
        self._future = future
        self._op = op
        self._where = where
        self._timeout = timeout
        self._done = threading.Event()
        self._exception: BaseException | None = None
        future.add_done_callback(self._on_done)

    def _on_done(self, future: torch.futures.Future) -> None:
        try:
            future.value()
        except BaseException as e:
            self._exception = e
        self._done.set()

    def wait(self, timeout: timedelta | float | None = None) -> bool:
        """Block until the collective is done; raise its error, or BpsTimeoutError past `timeout`.

        A zero or missing timeout means the group's timeout (that of init_process_group / new_group).
        """
        seconds = timeout.total_seconds() if isinstance(timeout, timedelta) else float(timeout or 0)
        if seconds <= 0:
            seconds = self._timeout
        if not self._done.wait(seconds):
            raise BpsTimeoutError(f"{self._op} {self._where} did not complete within {seconds:g}s")
        self._future.wait()  # raises the failure; for CUDA futures also makes the current stream wait
        return True

    def synchronize(self) -> None:
        self.wait()

    def is_completed(self) -> bool:
        return self._done.is_set()

    def is_success(self) -> bool:
        return self._done.is_set() and self._exception is None

    def exception(self) -> BaseException | None:
        return self._exception

    def get_future(self) -> torch.futures.Future:
        return self._future

    def result(self) -> Any:
        self.wait()
        return self._future.value()


@dataclass
class Transfer:
    """One push_pull of a collective: `buffer` (1-D, contiguous, CPU) is summed in place over the group,
    then `finish` (on a Completer thread) copies or reduces the sum to where the caller wants it."""

    buffer: torch.Tensor
    finish: Callable[[], None] | None = None


def launch(runtime, completer: Completer, op: str, transfers: Sequence[Transfer], result: Any, *, where: str,
           timeout: float, priority: int = 0, device: torch.device | None = None) -> BpsWork:  # fmt: skip
    """Push_pull every transfer (in order), then finish them and complete the Work's future with `result`.

    The caller must hold the group's launch lock so that one collective's push_pulls stay contiguous: every
    rank must issue the same push_pulls in the same order. Transfers with no elements send nothing (every
    rank skips them alike, since shapes must agree).

    Example: `launch(rt, completer, "barrier", [Transfer(torch.zeros(1))], [], where="on group 0", timeout=60)`.
    """
    future = torch.futures.Future(devices=[device]) if device is not None and device.type != "cpu" else None
    future = future if future is not None else torch.futures.Future()
    work = BpsWork(future, op, where, timeout)
    sums = [runtime.push_pull(t.buffer, priority=priority) for t in transfers if t.buffer.numel() > 0]

    def complete() -> None:
        error = None
        for s in sums:
            try:
                s.value()
            except BaseException as e:
                error = error or e
        if error is None:
            try:
                for t in transfers:
                    if t.finish is not None:
                        t.finish()
            except BaseException as e:
                error = e
        if error is None:
            future.set_result(result)
            return
        if hasattr(error, "add_note"):
            error.add_note(f"torch_bps: while running {op} {where}")
        future.set_exception(error)

    if not sums:
        complete()
        return work
    remaining = [len(sums)]
    lock = threading.Lock()

    def on_sum(_: torch.futures.Future) -> None:  # on the Runtime's completion thread: count, hand over, return
        with lock:
            remaining[0] -= 1
            last = remaining[0] == 0
        if last:
            completer.submit(complete)

    for s in sums:
        s.add_done_callback(on_sum)
    return work
