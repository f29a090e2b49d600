"""The engine's pipeline over real summation servers: sums and the credit bound, counted independently; and its
wire-precision step alone (engine/precision.py): which tensors are cast, and the staging buffers.

The C++ client schedules the engine's partitions within its credit. The bytes in flight are counted
apart from the credit, from a PUSH leaving the client to the server's acknowledgement (the client's
`push_bytes_in_flight`), not by the credit's own counter: a credit returned twice makes that counter
under-read exactly when the bound is broken, and a credit never returned stalls the pipeline, which
`_wait_all` names within seconds.
"""

from __future__ import annotations

import time

import pytest
import torch

from torch_bps.client import Client
from torch_bps.engine.partition import KeyBook
from torch_bps.engine.pipeline import PushPullEngine
from torch_bps.engine.placement import Placement, server_weights
from torch_bps.engine.precision import WireCasts, travels_as, wire_dtype
from torch_bps.wire import Mode

pytestmark = pytest.mark.timeout(120)

PARTITION = 64 << 10
CREDIT = 4 * PARTITION
# A collective's (numel, dtype, priority): several partitions each, some a fraction of one, mixed priorities.
COLLECTIVES = [(300_000, torch.float32, 0), (150_001, torch.float16, 2), (40_000, torch.int64, 1),
               (1000, torch.float32, 5), (262_144, torch.bfloat16, 0), (70_000, torch.float32, 3)]  # fmt: skip


def _data(worker: int, step: int, numel: int, dtype: torch.dtype) -> torch.Tensor:
    # Small integers: every dtype here sums them exactly.
    return ((torch.arange(numel) % 17) * (worker + 1) + step).to(dtype)


def _wait_all(futures, clients, stall: float = 10.0) -> None:
    """Poll instead of Future.wait(): a stalled pipeline (no acknowledgement for `stall` seconds while
    collectives are unfinished) fails the test in seconds instead of hanging it."""
    progress, last = -1, time.monotonic()
    while not all(f.done() for f in futures):
        stats = [c.scheduler_stats() for c in clients]
        if (acks := sum(s["parts_acknowledged"] for s in stats)) != progress:
            progress, last = acks, time.monotonic()
        elif time.monotonic() - last > stall:
            state = [(s["credit_in_flight"], s["queued"], s["parts_sent"], s["parts_acknowledged"]) for s in stats]
            pytest.fail(
                f"{sum(not f.done() for f in futures)} of {len(futures)} collectives unfinished, no acknowledgement "
                f"for {stall}s; per worker (credit taken, partitions queued, pushes sent, acknowledged): {state}: "
                "is the credit returned?"
            )
        time.sleep(0.01)


@pytest.mark.parametrize("middle_factor", [1, 3])
def test_bytes_in_flight_never_exceed_the_credit(servers, job_id, middle_factor):
    """Two workers, three servers, six concurrent collectives of 64 KiB partitions under a 256 KiB credit (with
    middle_factor 3, each tensor's middle in partitions of up to 192 KiB between 64 KiB ends)."""
    addresses = [s.address for s in servers]
    weights = server_weights(addresses[:2], addresses[2:])  # two machines' colocated servers + one dedicated
    book = lambda: KeyBook(Placement(weights), PARTITION * middle_factor, lambda n: [(0, n)],  # noqa: E731
                           min_partition_bytes=PARTITION, middle_factor=middle_factor)  # fmt: skip
    engines, clients = [], []
    try:
        for w in range(2):
            clients.append(Client(addresses, job_id, w, 2, timeout=60, credit_bytes=CREDIT))
            keys = book()
            engines.append(PushPullEngine(clients[w], keys, timeout=60))
        for step in range(3):
            tensors = [[_data(w, step, n, dt) for n, dt, _ in COLLECTIVES] for w in range(2)]
            futures = [e.push_pull(t, priority=p) for w, e in enumerate(engines)
                       for t, (_, _, p) in zip(tensors[w], COLLECTIVES, strict=True)]  # fmt: skip
            _wait_all(futures, clients)
            for f, (n, dt, _) in zip(futures, COLLECTIVES * 2, strict=True):
                assert torch.equal(f.value(), _data(0, step, n, dt) + _data(1, step, n, dt)), (n, dt, step)
        fresh = book()
        parts = 3 * sum(len(fresh.plan(n, dt)[0]) for n, dt, _ in COLLECTIVES)
        for c in clients:
            s = c.scheduler_stats()
            assert s["parts_sent"] == s["parts_acknowledged"] == parts, s
            assert CREDIT // 2 < s["peak_push_bytes_in_flight"] <= CREDIT, s  # the credit filled up, and held
            assert s["push_bytes_in_flight"] == 0 and s["queued"] == 0, s
            assert s["credit_in_flight"] == 0, s  # every credit taken came back, once
            assert s["peak_credit_in_flight"] <= CREDIT, s
    finally:
        for e in engines:
            e.close()
        for c in clients:
            c.close()


def test_a_collective_whose_completion_is_lost_fails_in_time(server, job_id):
    """The planted bug the engine's stall check exists for (the failover's double hold was one): the client runs the
    batch, but its completion never reaches the engine. With one local rank nothing else waits on the collective: it
    must still fail, naming its size and keys, one stall wait after the last partition moved, and the engine must go
    on serving the next one."""
    from torch_bps.errors import BpsTimeoutError

    with Client([server.address], job_id, 0, 1, timeout=2) as client:
        keys = KeyBook(Placement(server_weights([server.address], [])), PARTITION, lambda n: [(0, n)],
                       min_partition_bytes=PARTITION)  # fmt: skip
        engine = PushPullEngine(client, keys, timeout=2)
        try:
            run_batch = client.push_pull_batch
            client.push_pull_batch = lambda parts, priority, on_done: run_batch(
                parts, priority=priority, on_done=lambda error: None
            )
            started = time.monotonic()
            with pytest.raises(BpsTimeoutError) as failed:
                engine.push_pull(torch.ones(100_000)).wait()
            elapsed = time.monotonic() - started
            assert engine.stall_seconds == 7.0
            message = str(failed.value)
            assert "the network stage of a collective of 400.0 kB in 1 tensor (keys 0x" in message, message
            assert "no partition was sent or acknowledged in the last 7.0 s" in message, message
            assert 7.0 <= elapsed < 7.0 + 3, elapsed
            client.push_pull_batch = run_batch
            assert torch.equal(engine.push_pull(torch.full((1000,), 3.0)).wait(), torch.full((1000,), 3.0))
        finally:
            engine.close()


def test_only_fp32_sums_travel_as_the_wire_dtype():
    bf16 = wire_dtype("bf16")
    assert bf16 is torch.bfloat16 and wire_dtype("fp16") is torch.float16 and wire_dtype("fp32") is None
    f32 = torch.zeros(4)
    assert travels_as(f32, Mode.SUM, bf16) is torch.bfloat16
    assert travels_as(f32, Mode.COPY, bf16) is torch.float32  # gathers deliver their bytes exactly
    assert travels_as(f32, Mode.SUM, None) is torch.float32
    for other in (torch.float64, torch.float16, torch.int32, torch.int64):
        assert travels_as(torch.zeros(4, dtype=other), Mode.SUM, bf16) is other


def test_a_wire_cast_buffer_is_never_shared_while_taken_and_reused_once_given_back():
    casts = WireCasts()
    exact = torch.tensor([1.0, 1.0 + 2.0**-8, 1.0 + 3 * 2.0**-8, -(2.0**20) - 1])
    a, b = casts.cast(exact, torch.bfloat16), casts.cast(exact, torch.bfloat16)
    assert a.data_ptr() != b.data_ptr()  # two collectives in flight
    # Rounded to nearest, ties to even, as torch rounds: the two ties go to 1 and to 1 + 2**-6.
    assert torch.equal(a, exact.to(torch.bfloat16)) and a.tolist() == [1.0, 1.0, 1.0 + 2.0**-6, -(2.0**20)]
    casts.give(a)
    assert casts.cast(exact, torch.bfloat16).data_ptr() == a.data_ptr()
    assert casts.cast(exact, torch.float16).dtype is torch.float16  # by dtype too: a new one
