"""The credit-bounded priority scheduler: the Python reference, and the C++ client's twin held to it."""

from __future__ import annotations

import threading

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from torch_bps import _C
from torch_bps._reference.scheduler import CreditScheduler


def test_high_priority_overtakes_queued_low_priority():
    sched = CreditScheduler(credit_bytes=100)
    started = []
    for i in range(5):
        sched.submit(100, priority=0, start=lambda i=i: started.append(("low", i)))
    sched.submit(100, priority=10, start=lambda: started.append(("high", 0)))
    assert started == [("low", 0)]  # the credit admits one 100-byte partition
    sched.release(100)
    assert started[1] == ("high", 0)  # submitted last, sent next
    for _ in range(5):
        sched.release(100)
    assert [s for s in started if s[0] == "low"] == [("low", i) for i in range(5)]  # FIFO within a priority


def test_bytes_in_flight_never_exceed_credit():
    sched = CreditScheduler(credit_bytes=1000)
    in_flight, peak, lock = [0], [0], threading.Lock()
    pending = []

    def start(n):
        with lock:
            in_flight[0] += n
            peak[0] = max(peak[0], in_flight[0])
        pending.append(n)

    sizes = [300, 500, 200, 700, 100, 999, 1, 400] * 5
    for n in sizes:
        sched.submit(n, priority=n % 3, start=lambda n=n: start(n))
    finished = 0
    while pending:
        n = pending.pop(0)
        with lock:
            in_flight[0] -= n
        sched.release(n)
        finished += 1
    assert finished == len(sizes) and peak[0] <= 1000 and sched.peak_in_flight <= 1000


def test_oversized_partition_is_not_starved():
    sched = CreditScheduler(credit_bytes=10)
    started = []
    sched.submit(1000, priority=0, start=lambda: started.append(1000))
    assert started == [1000]


def test_bad_credit():
    with pytest.raises(ValueError):
        CreditScheduler(0)
    with pytest.raises(ValueError):
        CreditScheduler(100, destination_credit_bytes=-1)


def test_destination_credit_lets_other_destinations_pass_and_bounds_each():
    """Credit for 2 partitions toward one server: a third for server 0 waits while server 1's go past it."""
    sched = CreditScheduler(credit_bytes=1000, destination_credit_bytes=200)
    started = []
    for i in range(4):
        sched.submit(100, priority=5, start=lambda i=i: started.append((0, i)), destination=0)
    sched.submit(100, priority=0, start=lambda: started.append((1, 0)), destination=1)
    assert started == [(0, 0), (0, 1), (1, 0)]  # server 0 holds its 200; the lower priority for server 1 goes
    assert sched.destination_in_flight[0] == 200 and sched.peak_destination_in_flight == 200
    sched.release(100, destination=1)
    assert len(started) == 3  # credit returned to server 1 admits nothing for server 0
    sched.release(100, destination=0)
    assert started[3] == (0, 2)


def test_destination_credit_admits_one_oversized_partition_per_destination():
    sched = CreditScheduler(credit_bytes=10_000, destination_credit_bytes=10)
    started = []
    for d in (0, 0, 1):
        sched.submit(1000, priority=0, start=lambda d=d: started.append(d), destination=d)
    assert started == [0, 1]


class _Twin:
    """The C++ client's CreditQueue driven as its IO thread drives it: after every push or release, send
    (pop) whatever may go."""

    def __init__(self, credit_bytes: int, destination_credit_bytes: int = 0):
        self.queue = _C._testing.CreditQueue(credit_bytes, destination_credit_bytes)
        self.started: list[int] = []

    def submit(self, item: int, nbytes: int, priority: int, destination: int = 0) -> None:
        self.queue.push(destination, nbytes, priority, item)
        self._pump()

    def release(self, nbytes: int, destination: int = 0) -> None:
        self.queue.release(destination, nbytes)
        self._pump()

    def _pump(self) -> None:
        while (head := self.queue.pop()) is not None:
            self.started.append(head[0])


# A submission: (nbytes, priority, destination); an acknowledgement: which of the started-and-unacknowledged
# to release.
_EVENTS = st.lists(
    st.one_of(
        st.tuples(st.just("submit"), st.integers(0, 3000), st.integers(-2, 3), st.integers(0, 3)),
        st.tuples(st.just("ack"), st.integers(0, 1 << 16)),
    ),
    max_size=80,
)


@settings(max_examples=300, deadline=None)
@given(
    credit=st.integers(1, 4000),
    destination_credit=st.one_of(st.just(0), st.integers(1, 3000)),
    events=_EVENTS,
)
def test_the_cpp_queue_sends_in_the_reference_order(credit, destination_credit, events):
    """The same submissions, priorities, destinations and acknowledgements give the same send order, and the
    same credit taken, in CreditScheduler and in the C++ client's queue; neither lets a destination hold more
    than its credit beyond one partition (a partition of 0 bytes holds none)."""
    ref, twin = CreditScheduler(credit, destination_credit), _Twin(credit, destination_credit)
    ref_started: list[int] = []
    sizes: list[int] = []
    where: list[int] = []
    acknowledged: set[int] = set()
    for event in events:
        if event[0] == "submit":
            item, nbytes, priority, destination = len(sizes), event[1], event[2], event[3]
            sizes.append(nbytes)
            where.append(destination)
            ref.submit(nbytes, priority, lambda item=item: ref_started.append(item), destination)
            twin.submit(item, nbytes, priority, destination)
        else:
            unacked = [i for i in ref_started if i not in acknowledged]
            if not unacked:
                continue
            item = unacked[event[1] % len(unacked)]
            acknowledged.add(item)  # each started item is acknowledged once
            ref.release(sizes[item], where[item])
            twin.release(sizes[item], where[item])
        assert twin.started == ref_started
        assert twin.queue.in_flight == ref.in_flight
        for d in range(4):
            held = [sizes[i] for i in ref_started if i not in acknowledged and where[i] == d and sizes[i]]
            assert twin.queue.destination_in_flight(d) == ref.destination_in_flight[d] == sum(held)
            if destination_credit and len(held) > 1:
                assert sum(held) <= destination_credit
    assert twin.queue.peak_in_flight == ref.peak_in_flight
    assert twin.queue.peak_destination_in_flight == ref.peak_destination_in_flight


# ---- the automatic credit's rule (cpp_ext/client/credit_sizer.h) ----


def _acks(sizer, servers: int, part: int, rate: float, seconds: float, start: float = 0.0, backlogged=True) -> list:
    """Acknowledgements of `part`-byte pushes round-robin over `servers` at `rate` bytes/s; the sizes returned."""
    sized, t = [], start
    for i in range(int(seconds * rate / part)):
        t = start + (i + 1) * part / rate
        sized.append(sizer.on_ack(i % servers, part, t, backlogged))
    return [s for s in sized if s]


def test_the_credit_is_a_partition_per_server_plus_the_rate_times_the_jitter():
    sizer = _C._testing.CreditSizer(256 << 10, 64 << 20, 0.008)
    sized = _acks(sizer, servers=4, part=128 << 10, rate=100e6, seconds=0.5)
    assert len(sized) >= 8  # one per 50 ms window
    want = 4 * (128 << 10) + 100e6 * 0.008
    assert all(abs(s - want) < 0.03 * want for s in sized), (sized, want)
    # A faster link: more credit, bounded by the maximum.
    faster = _acks(sizer, servers=4, part=128 << 10, rate=1e9, seconds=0.2, start=0.5)
    assert abs(faster[-1] - (4 * (128 << 10) + 8e6)) < 0.03 * 8.5e6
    assert _acks(_C._testing.CreditSizer(256 << 10, 2 << 20, 0.008), 4, 128 << 10, 1e9, 0.2)[-1] == 2 << 20


def test_the_credit_follows_the_servers_in_use_and_forgets_a_faster_past():
    sizer = _C._testing.CreditSizer(256 << 10, 64 << 20, 0.008, window_seconds=0.05, windows=4)
    _acks(sizer, servers=8, part=128 << 10, rate=400e6, seconds=0.3)
    # Then 2 servers at a quarter of the rate: after `windows` windows neither the 8 servers nor 400 MB/s count.
    later = _acks(sizer, servers=2, part=128 << 10, rate=100e6, seconds=0.5, start=0.3)
    assert abs(later[-1] - (2 * (128 << 10) + 100e6 * 0.008)) < 0.03 * 1.06e6, later


def test_a_caller_that_leaves_the_link_idle_measures_nothing():
    """Windows in which nothing waited for credit say what the caller asked, not what the link carries."""
    sizer = _C._testing.CreditSizer(256 << 10, 64 << 20, 0.008)
    assert _acks(sizer, servers=4, part=128 << 10, rate=1e6, seconds=1.0, backlogged=False) == []
    assert min(_acks(_C._testing.CreditSizer(1 << 20, 64 << 20, 0.008), 1, 4096, 1e6, 0.5)) == 1 << 20  # the floor
