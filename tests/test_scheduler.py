"""The credit-bounded priority scheduler."""

from __future__ import annotations

import threading

import pytest

from torch_bps.engine.scheduler import CreditScheduler


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
