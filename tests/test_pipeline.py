"""The engine's pipeline over real summation servers: sums and the credit bound, counted independently.

The bytes in flight are counted by a wrapper around the real Client, from the push leaving the engine to
the server's acknowledgement, not by the scheduler's own counter: a credit released twice makes that
counter under-read exactly when the bound is broken.
"""

from __future__ import annotations

import threading
import time

import pytest
import torch

from torch_bps.client import Client
from torch_bps.engine.partition import KeyBook
from torch_bps.engine.pipeline import PushPullEngine
from torch_bps.engine.placement import Placement, server_weights
from torch_bps.engine.scheduler import CreditScheduler

pytestmark = pytest.mark.timeout(120)

PARTITION = 64 << 10
CREDIT = 4 * PARTITION
# A collective's (numel, dtype, priority): several partitions each, some a fraction of one, mixed priorities.
COLLECTIVES = [(300_000, torch.float32, 0), (150_001, torch.float16, 2), (40_000, torch.int64, 1),
               (1000, torch.float32, 5), (262_144, torch.bfloat16, 0), (70_000, torch.float32, 3)]  # fmt: skip


class CountingClient:
    """A Client whose pushes are counted from send to acknowledgement: the bytes the credit must bound."""

    def __init__(self, client: Client):
        self.client = client
        self.in_flight = self.peak = self.sent = self.acknowledged = 0
        self._lock = threading.Lock()

    def push_pull(self, tensor, key, *, server=None, on_done=None, on_pushed=None):
        nbytes = tensor.numel() * tensor.element_size()

        def on_ack(error):
            with self._lock:  # uncounted before the engine gets its credit back, so no send is counted early
                self.in_flight -= nbytes
            if on_pushed is not None:
                on_pushed(error)  # runs the engine's release, and any send it starts
            with self._lock:
                self.acknowledged += 1

        with self._lock:
            self.in_flight += nbytes
            self.peak = max(self.peak, self.in_flight)
            self.sent += 1
        try:
            return self.client.push_pull(tensor, key, server=server, on_done=on_done, on_pushed=on_ack)
        except BaseException:
            with self._lock:
                self.in_flight -= nbytes
                self.sent -= 1
            raise


def _data(worker: int, step: int, numel: int, dtype: torch.dtype) -> torch.Tensor:
    # Small integers: every dtype here sums them exactly.
    return ((torch.arange(numel) % 17) * (worker + 1) + step).to(dtype)


def _wait_all(futures, engines, counters, stall: float = 10.0) -> None:
    """Poll instead of Future.wait(): a stalled pipeline (no acknowledgement for `stall` seconds while
    collectives are unfinished) fails the test in seconds instead of hanging it."""
    progress, last = -1, time.monotonic()
    while not all(f.done() for f in futures):
        if (acks := sum(c.acknowledged for c in counters)) != progress:
            progress, last = acks, time.monotonic()
        elif time.monotonic() - last > stall:
            state = [(e.scheduler.in_flight, len(e.scheduler._queue), c.sent, c.acknowledged)
                     for e, c in zip(engines, counters, strict=True)]  # fmt: skip
            pytest.fail(
                f"{sum(not f.done() for f in futures)} of {len(futures)} collectives unfinished, no acknowledgement "
                f"for {stall}s; per worker (credit taken, partitions queued, pushes sent, acknowledged): {state}: "
                "is the credit returned?"
            )
        time.sleep(0.01)


def test_bytes_in_flight_never_exceed_the_credit(servers, job_id):
    """Two workers, three servers, six concurrent collectives of 64 KiB partitions under a 256 KiB credit."""
    addresses = [s.address for s in servers]
    weights = server_weights(addresses[:2], addresses[2:])  # two machines' colocated servers + one dedicated
    engines, counters = [], []
    try:
        for w in range(2):
            counters.append(CountingClient(Client(addresses, job_id, w, 2, timeout=60)))
            keys = KeyBook(Placement(weights), PARTITION, lambda n: [(0, n)])
            engines.append(PushPullEngine(counters[w], keys, CreditScheduler(CREDIT), timeout=60))
        for step in range(3):
            tensors = [[_data(w, step, n, dt) for n, dt, _ in COLLECTIVES] for w in range(2)]
            futures = [e.push_pull(t, priority=p) for w, e in enumerate(engines)
                       for t, (_, _, p) in zip(tensors[w], COLLECTIVES, strict=True)]  # fmt: skip
            _wait_all(futures, engines, counters)
            for f, (n, dt, _) in zip(futures, COLLECTIVES * 2, strict=True):
                assert torch.equal(f.value(), _data(0, step, n, dt) + _data(1, step, n, dt)), (n, dt, step)
        deadline = time.monotonic() + 10  # acknowledgements' callbacks may still be running
        while any(c.acknowledged < c.sent for c in counters) and time.monotonic() < deadline:
            time.sleep(0.01)
        fresh = KeyBook(Placement(weights), PARTITION, lambda n: [(0, n)])
        parts = 3 * sum(len(fresh.plan(n, dt)[0]) for n, dt, _ in COLLECTIVES)
        for e, c in zip(engines, counters, strict=True):
            assert c.sent == c.acknowledged == parts
            assert CREDIT // 2 < c.peak <= CREDIT, c.peak  # the credit filled up, and held
            assert c.in_flight == 0 and e.scheduler.in_flight == 0  # every credit taken came back, once
            assert e.scheduler.peak_in_flight <= CREDIT
    finally:
        for e in engines:
            e.close()
        for c in counters:
            c.client.close()
