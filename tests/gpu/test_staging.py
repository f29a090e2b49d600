"""CUDA staging on the device: per-partition round trips after a slow producer stream, no device-wide waits, and a
broadcast that must not be overwritten by a write still queued on the receiver's stream."""

from __future__ import annotations

import threading

import pytest
import torch
import torch.distributed as dist

from tests.gpu.common import requires
from tests.helpers import run_ranks

DEVICE = "cuda:0" if torch.cuda.is_available() else None
pytestmark = [*requires(DEVICE), pytest.mark.timeout(120)]
SLEEP_CYCLES = 10**8  # ~50 ms of a kernel that does nothing: a copy not ordered after it reads stale data


def _round_trip(n: int, parts: int, slots: int, add: float):
    """Fill a tensor on a side stream behind a long kernel, stage it per partition with a host 'service' that adds
    `add`, and read the result on that same stream through the device Future."""
    from torch_bps.device.pinned import PartitionPipeline

    stream = torch.cuda.Stream(device=DEVICE)
    t = torch.zeros(n, device=DEVICE)
    step = -(-n // parts)
    bounds = [(lo, min(n, lo + step)) for lo in range(0, n, step)]
    pipe = PartitionPipeline(torch.device(DEVICE), slot_bytes=step * 4, slots=slots, timeout=30)
    future = torch.futures.Future(devices=[DEVICE])

    def push(index, host, pulled):
        def answer():
            host.add_(add)
            pulled(None)

        threading.Thread(target=answer).start()

    def done(error):
        if error is not None:
            future.set_exception(error)
        else:
            future.set_result(t)

    with torch.cuda.stream(stream):
        torch.cuda._sleep(SLEEP_CYCLES)
        t.fill_(3.0)
        pipe.start(t, bounds, push, done)
        future.wait()  # makes `stream` wait for the event recorded after the last copy back
        total = t.sum().item()
    pipe.close()
    return total


def test_partitions_round_trip_after_a_slow_producer_and_are_read_in_order_on_the_callers_stream():
    n = 1 << 20
    assert _round_trip(n, parts=7, slots=2, add=1.0) == pytest.approx(4.0 * n)


def test_staging_never_synchronizes_the_device_or_a_stream(monkeypatch):
    calls = []
    monkeypatch.setattr(torch.cuda, "synchronize", lambda *a, **k: calls.append("torch.cuda.synchronize"))
    original = torch.cuda.Stream.synchronize
    monkeypatch.setattr(torch.cuda.Stream, "synchronize", lambda self: (calls.append("Stream.synchronize"),
                                                                       original(self))[1])  # fmt: skip
    n = 1 << 18
    assert _round_trip(n, parts=4, slots=3, add=2.0) == pytest.approx(5.0 * n)
    assert calls == []


def _broadcast_over_a_queued_write(rank, world, gloo, device):
    t = torch.full((1 << 16,), float(rank), device=device)
    if rank == 1:
        torch.cuda._sleep(SLEEP_CYCLES)  # the fill below is still queued when the broadcast stages its output
        t.fill_(7.0)
    dist.broadcast(t, 0)
    return t.cpu().unique().tolist()


def test_broadcast_lands_after_a_write_still_queued_on_a_receivers_stream():
    results = run_ranks(_broadcast_over_a_queued_write, 2, DEVICE, timeout=100)
    assert results == [[0.0], [0.0]], f"rank 1 must hold rank 0's values, not its own queued write: {results}"
