"""The stall check: the one bound on a network stage that no request bounds.

The client bounds each request (its timeout) and its error, naming server, key and round, ends the network stage.
What no request bounds, a collective whose network stage never ends with nothing in flight (a lost completion: a
bug), the stall check does: one thread ("bps-stall-check", started with the first network stage) fails it when no
partition was sent or acknowledged for longer than any request may take (`seconds`). The timeout bounds requests,
not collectives: a big one over a slow link takes as long as it needs while its partitions move, so only a stage
that stopped fails here. A failover holds collectives with nothing moving, bounded by its own waits: it counts as
moving.

May import: torch_bps.errors, torch_bps.engine.
"""

from __future__ import annotations

import functools
import logging
import threading
import time
from collections.abc import Callable

from torch_bps.engine.op import Op, size_of
from torch_bps.errors import BpsTimeoutError

log = logging.getLogger("torch_bps.engine")


class StallCheck:
    """The collectives in their network stage, and the thread that fails those that stopped moving.

    Args:
        timeout: the client's request timeout (seconds).
        progress: what moves while network stages work (batch parts sent and acknowledged, by every client).
        holding: whether a failover holds collectives now (nothing moves, and that is no stall).
        fail: `fail(op, error)` ends a stalled collective's network stage; the check runs it on a completion thread
            through `post`, since ending may block (a `done` that waits on a later collective).
        who: how errors name this rank ("local rank 1: "), or "".

    Example: `check.enter(op)` as op's partitions go to the client; `if check.leave(op): ...` as its network stage
    ends, which is True once: for the first ending.
    """

    def __init__(self, timeout: float, *, progress: Callable[[], list], holding: Callable[[], bool],
                 fail: Callable[[Op, BaseException], None], post: Callable[[Callable[[], None]], None],
                 who: str = ""):  # fmt: skip
        self.timeout = timeout
        self._progress, self._holding, self._fail, self._post, self._who = progress, holding, fail, post, who
        self._lock = threading.Lock()  # _in_network, each op's `ending`, the thread
        self._in_network: dict[int, Op] = {}
        self._thread: threading.Thread | None = None
        self._closing = threading.Event()

    @property
    def seconds(self) -> float:
        """How long nothing may be sent or acknowledged while a network stage is open: longer than any request may
        take, so every request sent has ended by then (a pull may take a tenth more than the timeout); in proportion,
        so that a short timeout stays short."""
        return self.timeout + max(5.0, self.timeout / 5)

    def enter(self, op: Op) -> None:
        """op's partitions go to the network now (unless its network stage already ended)."""
        with self._lock:
            op.sent_at = time.monotonic()
            if not op.ending:
                self._in_network[id(op)] = op
            if self._thread is None:
                self._thread = threading.Thread(target=self._check, name="bps-stall-check", daemon=True)
                self._thread.start()

    def leave(self, op: Op) -> bool:
        """op's network stage ends: True the first time, False for a late second ending (it changes nothing)."""
        with self._lock:
            if op.ending:
                return False
            op.ending = True
            self._in_network.pop(id(op), None)
            return True

    def close(self) -> None:
        self._closing.set()
        if self._thread is not None:
            self._thread.join(timeout=5)

    def _check(self) -> None:
        """Fail every collective whose network stage stayed open while nothing moved for `seconds`."""
        wait = self.seconds
        progress, moved = self._progress(), time.monotonic()
        while not self._closing.wait(wait / 8):
            try:
                now, before, progress = time.monotonic(), progress, self._progress()
                if progress != before or self._holding():
                    moved = now
                    continue
                with self._lock:
                    stuck = [op for op in self._in_network.values() if now - max(op.sent_at, moved) >= wait]
                    for op in stuck:
                        del self._in_network[id(op)]
                for op in stuck:  # ended on a completion thread: `done` may block
                    self._post(functools.partial(self._fail, op, self._stalled(op, wait)))
            except Exception:  # noqa: BLE001 - the check must outlive a client that is closing under it
                log.exception("torch_bps: the stall check failed once; it goes on")

    def _stalled(self, op: Op, wait: float) -> BpsTimeoutError:
        return BpsTimeoutError(
            f"{self._who}the network stage of a collective of {size_of(op.items)} ({op.keys()}) has not ended and no "
            f"partition was sent or acknowledged in the last {wait:.1f} s"
        )
