"""The engine's local stages (several local ranks of one machine): a collective completes, or fails within its
timeout, and never hangs.

Two real processes are the local ranks of one machine: each has its two LocalComms (reduce-scatter and
all-gather channels, through /dev/shm), its own Client and a PushPullEngine, as `Runtime.create` wires them, and
the machine is the only worker of a real summation server, so the network stage between the local stages runs
too. Every wait in a rank is bounded (`_finish`), so a stage that never completes its collective fails the test
in seconds instead of hanging it.
"""

from __future__ import annotations

import multiprocessing as mp
import os
import queue
import random
import signal
import time
import traceback
import uuid
from datetime import timedelta

import pytest
import torch
import torch.distributed as dist

from tests.helpers import TcpRelay
from torch_bps.client import Client
from torch_bps.engine.partition import KeyBook
from torch_bps.engine.pipeline import PushPullEngine
from torch_bps.engine.placement import Placement, server_weights
from torch_bps.errors import BpsError, BpsTimeoutError
from torch_bps.local import LocalComm, LocalPeerFailedError, shm

pytestmark = pytest.mark.timeout(90)

TIMEOUT = 3.0  # the engine's, the client's and the LocalComms' (Config.timeout, as the runtime passes it)
HUNG = 12.0  # a collective not complete by then is hung: past every bound the engine sets (TIMEOUT + 5 s)
PARTITION = 64 << 10  # several partitions per local slice


def _data(local_rank: int, step: int, numel: int, dtype: torch.dtype) -> torch.Tensor:
    return ((torch.arange(numel) % 11) * (local_rank + 1) + step).to(dtype)  # small integers: exact sums


def _finish(future: torch.futures.Future, hung: float = HUNG) -> torch.Tensor:
    """Future.wait() with a bound: it has none of its own."""
    deadline = time.monotonic() + hung
    while not future.done():
        if time.monotonic() > deadline:
            raise AssertionError(f"collective not complete after {hung} s (timeout {TIMEOUT} s): a stage hangs")
        time.sleep(0.005)
    return future.wait()


def _sums(engine: PushPullEngine, local_rank: int) -> int:
    """Sums over the two local ranks, several dtypes and sizes (an empty slice too), as single collectives."""
    done = 0
    for step in range(3):
        shapes = [(1, torch.float32), (1001, torch.int64), (300_001, torch.float32), (70_000, torch.bfloat16)]
        futures = [(n, dt, engine.push_pull(_data(local_rank, step, n, dt))) for n, dt in shapes]
        for n, dt, f in futures:
            want = _data(0, step, n, dt) + _data(1, step, n, dt)
            assert torch.equal(_finish(f), want), (n, dt, step)
            done += 1
    return done


def _all_gather_never_met(engine: PushPullEngine, local_rank: int):
    """Local rank 1 stops (SIGSTOP: alive, never arriving) on reaching the all-gather; rank 0 must fail, twice."""
    if local_rank == 1:
        engine.local_channels[1].all_gather_steps = lambda *args, **kwargs: os.kill(os.getpid(), signal.SIGSTOP)
    outcomes = []
    for _ in range(2):  # the second collective finds rank 1 missing at the reduce-scatter
        started = time.monotonic()
        try:
            _finish(engine.push_pull(torch.ones(100_000)))
            outcomes.append(("ok", "", time.monotonic() - started))
        except Exception as e:  # noqa: BLE001 - reported to the test process, which decides
            outcomes.append((type(e).__name__, str(e), time.monotonic() - started))
    return outcomes


# A slow but healthy network (tests.helpers.TcpRelay): each rank's half of SLOW_NUMEL floats crosses it in ~10 s,
# past the TIMEOUT + 5 s the engine once allowed a whole network stage, while a credit of two partitions keeps
# every request's answer well within TIMEOUT.
SLOW_RATE = 256 << 10
SLOW_NUMEL = 5 << 18
# stream=False: the relay carries the server's ZeroMQ port only; a stream (BPS_TRANSPORT=stream) would go around it.
SLOW_CLIENT = {"credit_bytes": 2 * PARTITION, "stream": False}


def _slow_network(engine: PushPullEngine, local_rank: int):
    started = time.monotonic()
    try:
        got = _finish(engine.push_pull(_data(local_rank, 0, SLOW_NUMEL, torch.float32)), hung=40.0)
        exact = torch.equal(got, _data(0, 0, SLOW_NUMEL, torch.float32) + _data(1, 0, SLOW_NUMEL, torch.float32))
        return "ok", exact, time.monotonic() - started
    except Exception as e:  # noqa: BLE001 - reported to the test process, which decides
        return type(e).__name__, str(e), time.monotonic() - started


def _network_stage_stopped(engine: PushPullEngine, local_rank: int):
    """A client that swallows the batch (a planted bug): nothing is ever sent, and the collective must still fail."""
    engine.client.push_pull_batch = lambda *args, **kwargs: None
    started = time.monotonic()
    try:
        _finish(engine.push_pull(torch.ones(100_000)))
        return "ok", "", time.monotonic() - started
    except Exception as e:  # noqa: BLE001 - reported to the test process, which decides
        return type(e).__name__, str(e), time.monotonic() - started


def _network_refused_once(engine: PushPullEngine, local_rank: int):
    """Local rank 1's client refuses its first batch (as a closed client does); then two collectives on each rank."""
    if local_rank == 1:
        submit = engine.client.push_pull_batch

        def refuse(*args, **kwargs):
            engine.client.push_pull_batch = submit
            raise BpsError("planted: the client refused the batch")

        engine.client.push_pull_batch = refuse
    outcomes = []
    for step in range(2):
        started = time.monotonic()
        try:
            got = _finish(engine.push_pull(_data(local_rank, step, 100_000, torch.float32)))
            want = _data(0, step, 100_000, torch.float32) + _data(1, step, 100_000, torch.float32)
            outcomes.append(("ok", torch.equal(got, want), time.monotonic() - started))
        except Exception as e:  # noqa: BLE001 - reported to the test process, which decides
            outcomes.append((type(e).__name__, str(e), time.monotonic() - started))
    return outcomes


def _alone_bursts(engine: PushPullEngine, local_rank: int):
    """Bursts of collectives on a machine that is the whole job, local rank 1 late to every fourth: some gathered on
    the thread that reduce-scattered them, some on a completion thread, every sum exact. Returns (collectives, handed
    off)."""
    rng = random.Random(5)  # the same sizes on both ranks
    done = 0
    for step in range(40):
        if local_rank == 1 and step % 4 == 0:
            time.sleep(0.05)  # past the engine's patience: rank 0's caller hands that burst on
        shapes = [(rng.choice([1, 257, 40_000, 200_001]), rng.choice([torch.float32, torch.int64]))
                  for _ in range(rng.randint(1, 5))]  # fmt: skip
        futures = [(n, dt, engine.push_pull(_data(local_rank, step, n, dt))) for n, dt in shapes]
        for n, dt, f in futures:
            assert torch.equal(_finish(f), _data(0, step, n, dt) + _data(1, step, n, dt)), (n, dt, step)
            done += 1
    return done, engine._handed


SCENARIOS = {
    "sums": _sums,
    "alone_bursts": _alone_bursts,
    "all_gather_never_met": _all_gather_never_met,
    "slow_network": _slow_network,
    "network_stage_stopped": _network_stage_stopped,
    "network_refused_once": _network_refused_once,
}


def _rank(local_rank, port, server, job_id, node, scenario, results, client_kwargs, alone):
    """A local rank: wired as Runtime.create wires one of a machine's ranks; runs `scenario`, reports."""
    torch.set_num_threads(1)
    store = dist.TCPStore("127.0.0.1", port, is_master=False, timeout=timedelta(seconds=30))
    channels, client, engine = (), None, None
    try:
        channels = tuple(LocalComm(store, local_rank, 2, f"{node}-{stage}", timeout=TIMEOUT) for stage in ("rs", "ag"))
        client = Client([server], job_id, 0, 1, timeout=TIMEOUT, **client_kwargs)
        slices = lambda n: [channels[0].slice_range(n, r) for r in range(2)]  # noqa: E731
        keys = KeyBook(Placement(server_weights([], [server])), PARTITION, slices)
        engine = PushPullEngine(
            client, keys, local_channels=channels, local_rank=local_rank, timeout=TIMEOUT, alone=alone
        )
        results.put((local_rank, "ok", SCENARIOS[scenario](engine, local_rank)))
    except BaseException as e:  # noqa: BLE001
        results.put((local_rank, type(e).__name__, f"{e}\n{traceback.format_exc()}"))
    finally:
        for closing in (engine, client, *channels):
            if closing is not None:
                closing.close()


def run(
    scenario: str,
    server,
    job_id: int,
    reporting: tuple[int, ...] = (0, 1),
    address: str | None = None,
    client_kwargs: dict | None = None,
    alone: bool = False,
) -> dict[int, object]:
    """Run `scenario` on two local ranks, their clients connected to `address` (default: the server's); return
    each reporting rank's result. Kills what is left at the end."""
    ctx = mp.get_context("forkserver")
    ctx.set_forkserver_preload([__name__])  # no effect if another test module started the forkserver first
    store = dist.TCPStore("127.0.0.1", 0, is_master=True, wait_for_workers=False)
    node, results = f"e{uuid.uuid4().hex[:8]}", ctx.Queue()
    args = (store.port, address or server.address, job_id, node, scenario, results, client_kwargs or {}, alone)
    procs = [ctx.Process(target=_rank, args=(r, *args), daemon=True) for r in range(2)]
    for p in procs:
        p.start()
    out = {}
    try:
        while set(reporting) - out.keys():
            rank, status, payload = results.get(timeout=HUNG + 60)
            assert status == "ok" and rank in reporting, f"local rank {rank}: {status}: {payload}"
            out[rank] = payload
    except queue.Empty:
        raise AssertionError(f"{scenario}: no report within {HUNG + 60} s; so far {out}") from None
    finally:
        for p in procs:
            if p.is_alive():
                p.kill()  # a SIGSTOPped rank too
            p.join(10)
    assert [n for n in os.listdir(shm.SHM_DIR) if node in n] == []  # no segment left, killed rank or not
    return out


def test_two_local_ranks_sum_through_the_local_stages_and_the_server(server, job_id):
    assert run("sums", server, job_id) == {0: 12, 1: 12}


def test_a_machine_alone_sums_bursts_in_order_on_one_thread_or_two(server, job_id):
    """Alone, a collective is gathered on the thread that reduce-scattered it (its caller's, or the stage thread's
    with none behind it), the others on a completion thread: both happen in these bursts, and the local ranks meet
    in the same order either way."""
    out = run("alone_bursts", server, job_id, alone=True)
    for done, handed in out.values():
        assert done >= 40 and 0 < handed < done, (done, handed)


@pytest.mark.parametrize("alone", [False, True])
def test_a_local_rank_that_never_reaches_the_all_gather_fails_the_collective_in_time(server, job_id, alone):
    """Rank 1 stops at the all-gather: rank 0's collective fails with a timeout naming the stage, both ranks and the
    round, its Future raising it (what DDP waits on), and the engine lives on: the next one fails, too. Alone, the
    caller's thread begins that all-gather itself, and the same holds."""
    gather, scatter = run("all_gather_never_met", server, job_id, reporting=(0,), alone=alone)[0]
    kind, message, elapsed = gather
    assert kind == BpsTimeoutError.__name__, message
    assert "local rank 0: all_gather call #1" in message and "waiting for local rank 1 (pid" in message, message
    assert TIMEOUT * 0.9 < elapsed < TIMEOUT + 3, elapsed
    kind, message, elapsed = scatter
    assert kind == BpsTimeoutError.__name__ and "local rank 0: reduce_scatter call #2" in message, message
    assert elapsed < TIMEOUT + 3, elapsed


def test_a_slow_network_stage_completes_when_every_request_answers_in_time(server, job_id):
    """The timeout bounds each request, not a collective: over a slow link a big collective's network stage outlasts
    TIMEOUT + 5 s, every request answering in time, and it must complete with the exact sum (not fail at the
    engine's bound while its partitions keep landing in the tensor afterwards)."""
    relay = TcpRelay(server.address, rate=SLOW_RATE)
    try:
        out = run("slow_network", server, job_id, address=relay.address, client_kwargs=SLOW_CLIENT)
    finally:
        relay.cut()
    for rank, (kind, detail, elapsed) in out.items():
        assert kind == "ok" and detail is True, (rank, kind, detail, elapsed)
        assert elapsed > TIMEOUT + 5, f"rank {rank}: {elapsed:.1f} s: too fast to outlast the old bound: slow the link"


def test_a_network_stage_that_stopped_fails_the_collective_in_time(server, job_id):
    """Nothing sent or acknowledged for longer than any request may take: the collective fails, naming its size and
    keys, within one such wait (TIMEOUT + 5 s), on both ranks."""
    for rank, (kind, message, elapsed) in run("network_stage_stopped", server, job_id).items():
        assert kind == BpsTimeoutError.__name__, (rank, kind, message)
        stage = f"local rank {rank}: the network stage of a collective of 400.0 kB in 1 tensor (keys 0x"
        assert stage in message, message
        assert "no partition was sent or acknowledged in the last 8.0 s" in message, message
        assert TIMEOUT + 5 <= elapsed < TIMEOUT + 5 + 3, (rank, elapsed)


def test_a_local_rank_whose_network_stage_fails_fails_its_peers_at_once(server, job_id):
    """Rank 1's client refuses its partitions: rank 1's collective fails with that error, and rank 0's, its sum back
    from the server, fails at the all-gather at once, naming rank 1, instead of waiting for it until the timeout;
    the local channels stay usable and the next collective sums on both."""
    out = run("network_refused_once", server, job_id)
    (kind, message, elapsed), ok = out[1]
    assert kind == BpsError.__name__ and "planted: the client refused the batch" in message, message
    assert elapsed < 1.0, elapsed
    (kind, message, elapsed), ok0 = out[0]
    assert kind == LocalPeerFailedError.__name__, message
    assert "local rank 0: all_gather call #1: local rank(s) [1] came with nothing to give" in message, message
    assert elapsed < 1.0, f"{elapsed:.1f} s: rank 0 waited for rank 1 (timeout {TIMEOUT} s)"
    assert ok[:2] == ok0[:2] == ("ok", True), (ok, ok0)
