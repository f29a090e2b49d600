"""Credit-bounded priority scheduling of partitions onto the network: the reference.

The engine's partitions are scheduled by the C++ client's IO thread (cpp_ext/credit_queue.h, through
`Client.push_pull_batch`); this class states the same rule in Python, and tests/test_scheduler.py checks that
both send the same submissions in the same order.

At most `credit_bytes` of pushes are in flight (sent and not yet acknowledged by their server); the rest
wait in a priority queue, so a partition submitted late with a higher priority overtakes the queued ones.
This is what lets the first layers' gradients (needed first by the next forward pass) jump the queue.
One partition is always allowed in flight, however large, so nothing starves.

May import: the standard library only.
"""

from __future__ import annotations

import heapq
import itertools
import threading
from collections.abc import Callable
from dataclasses import dataclass, field


@dataclass(order=True)
class _Queued:
    sort_key: tuple[int, int]  # (-priority, arrival): higher priority first, then first come first served
    nbytes: int = field(compare=False)
    start: Callable[[], None] = field(compare=False)


class CreditScheduler:
    """Start submitted jobs in priority order while their bytes in flight stay within the credit.

    Example:
        sched = CreditScheduler(credit_bytes=16 << 20)
        sched.submit(nbytes, priority, start=lambda: send(...))   # start() must not block
        ... later, when that partition's transfer finished: sched.release(nbytes)
    """

    def __init__(self, credit_bytes: int):
        if credit_bytes <= 0:
            raise ValueError(f"credit_bytes must be positive, got {credit_bytes}")
        self.credit_bytes = credit_bytes
        self.in_flight = 0
        self.peak_in_flight = 0
        self._queue: list[_Queued] = []
        self._arrival = itertools.count()
        self._lock = threading.Lock()

    def submit(self, nbytes: int, priority: int, start: Callable[[], None]) -> None:
        with self._lock:
            heapq.heappush(self._queue, _Queued((-priority, next(self._arrival)), nbytes, start))
        self._pump()

    def release(self, nbytes: int) -> None:
        """Return the credit of a finished transfer and start what now fits."""
        with self._lock:
            self.in_flight -= nbytes
        self._pump()

    def _pump(self) -> None:
        while True:
            with self._lock:
                if not self._queue:
                    return
                head = self._queue[0]
                if self.in_flight and self.in_flight + head.nbytes > self.credit_bytes:
                    return
                heapq.heappop(self._queue)
                self.in_flight += head.nbytes
                self.peak_in_flight = max(self.peak_in_flight, self.in_flight)
            head.start()  # outside the lock: start() may complete synchronously and call release()
