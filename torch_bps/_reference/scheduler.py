"""Reference model, not run by the engine: credit-bounded priority scheduling of partitions onto the network.

The engine's partitions are scheduled by the C++ client's IO thread (cpp_ext/client/credit_queue.h, through
`Client.push_pull_batch`); this class states the same rule in Python and nothing in torch_bps imports it:
tests/client/test_scheduler.py checks that both send the same submissions in the same order.

At most `credit_bytes` of pushes are in flight (sent and not yet acknowledged by their server), and, if
`destination_credit_bytes` is set, at most that many toward any one destination (a server); the rest wait
in a priority queue per destination, so a partition submitted late with a higher priority overtakes the
queued ones (Runtime.push_pull's priority; the backend and bps_hook submit everything at one priority: docs/design.md,
"Scheduling"). The next to go is the best head (higher priority, then first come) among the destinations whose credit
admits it; a head whose destination holds its share lets heads for other destinations go past it. One
partition is always allowed in flight, and one per destination, however large, so nothing starves.

May import: the standard library only.
"""

from __future__ import annotations

import heapq
import itertools
import threading
from collections import defaultdict
from collections.abc import Callable
from dataclasses import dataclass, field


@dataclass(order=True)
class _Queued:
    sort_key: tuple[int, int]  # (-priority, arrival): higher priority first, then first come first served
    nbytes: int = field(compare=False)
    start: Callable[[], None] = field(compare=False)


class CreditScheduler:
    """Start submitted jobs in priority order while their bytes in flight stay within the credits.

    Args:
        credit_bytes: bytes in flight in all.
        destination_credit_bytes: bytes in flight toward one destination; 0: no limit but credit_bytes.

    Example:
        sched = CreditScheduler(credit_bytes=16 << 20, destination_credit_bytes=1 << 20)
        sched.submit(nbytes, priority, start=lambda: send(...), destination=server)  # start() must not block
        ... later, when that partition's transfer finished: sched.release(nbytes, destination=server)
    """

    def __init__(self, credit_bytes: int, destination_credit_bytes: int = 0):
        if credit_bytes <= 0 or destination_credit_bytes < 0:
            raise ValueError(f"credit_bytes must be positive, got {credit_bytes} (and {destination_credit_bytes})")
        self.credit_bytes = credit_bytes
        self.destination_credit_bytes = destination_credit_bytes
        self.in_flight = 0
        self.peak_in_flight = 0
        self.destination_in_flight: dict[int, int] = defaultdict(int)
        self.peak_destination_in_flight = 0
        self._queues: dict[int, list[_Queued]] = defaultdict(list)
        self._arrival = itertools.count()
        self._lock = threading.Lock()

    def submit(self, nbytes: int, priority: int, start: Callable[[], None], destination: int = 0) -> None:
        with self._lock:
            heapq.heappush(self._queues[destination], _Queued((-priority, next(self._arrival)), nbytes, start))
        self._pump()

    def release(self, nbytes: int, destination: int = 0) -> None:
        """Return the credit of a finished transfer and start what now fits."""
        with self._lock:
            self.in_flight -= nbytes
            self.destination_in_flight[destination] -= nbytes
        self._pump()

    def _admitted(self, destination: int, nbytes: int) -> bool:
        held = self.destination_in_flight[destination]
        return not self.destination_credit_bytes or not held or held + nbytes <= self.destination_credit_bytes

    def _pump(self) -> None:
        while True:
            with self._lock:
                heads = [(q[0].sort_key, d) for d, q in self._queues.items() if q and self._admitted(d, q[0].nbytes)]
                if not heads:
                    return
                destination = min(heads)[1]
                head = self._queues[destination][0]
                if self.in_flight and self.in_flight + head.nbytes > self.credit_bytes:
                    return
                heapq.heappop(self._queues[destination])
                self.in_flight += head.nbytes
                self.peak_in_flight = max(self.peak_in_flight, self.in_flight)
                self.destination_in_flight[destination] += head.nbytes
                self.peak_destination_in_flight = max(
                    self.peak_destination_in_flight, self.destination_in_flight[destination]
                )
            head.start()  # outside the lock: start() may complete synchronously and call release()
