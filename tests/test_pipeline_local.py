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
import signal
import time
import traceback
import uuid
from datetime import timedelta

import pytest
import torch
import torch.distributed as dist

from torch_bps.client import Client
from torch_bps.engine.partition import KeyBook
from torch_bps.engine.pipeline import PushPullEngine
from torch_bps.engine.placement import Placement, server_weights
from torch_bps.errors import BpsTimeoutError
from torch_bps.local import LocalComm, shm

pytestmark = pytest.mark.timeout(60)

TIMEOUT = 3.0  # the engine's, the client's and the LocalComms' (Config.timeout, as the runtime passes it)
HUNG = 12.0  # a collective not complete by then is hung: past every bound the engine sets (TIMEOUT + 5 s)
PARTITION = 64 << 10  # several partitions per local slice


def _data(local_rank: int, step: int, numel: int, dtype: torch.dtype) -> torch.Tensor:
    return ((torch.arange(numel) % 11) * (local_rank + 1) + step).to(dtype)  # small integers: exact sums


def _finish(future: torch.futures.Future) -> torch.Tensor:
    """Future.wait() with a bound: it has none of its own."""
    deadline = time.monotonic() + HUNG
    while not future.done():
        if time.monotonic() > deadline:
            raise AssertionError(f"collective not complete after {HUNG} s (timeout {TIMEOUT} s): a stage hangs")
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
        engine.local[1].all_gather = lambda *args, **kwargs: os.kill(os.getpid(), signal.SIGSTOP)
    outcomes = []
    for _ in range(2):  # the second collective finds rank 1 missing at the reduce-scatter
        started = time.monotonic()
        try:
            _finish(engine.push_pull(torch.ones(100_000)))
            outcomes.append(("ok", "", time.monotonic() - started))
        except Exception as e:  # noqa: BLE001 - reported to the test process, which decides
            outcomes.append((type(e).__name__, str(e), time.monotonic() - started))
    return outcomes


SCENARIOS = {"sums": _sums, "all_gather_never_met": _all_gather_never_met}


def _rank(local_rank, port, server, job_id, node, scenario, results):
    """A local rank: wired as Runtime.create wires one of a machine's ranks; runs `scenario`, reports."""
    torch.set_num_threads(1)
    store = dist.TCPStore("127.0.0.1", port, is_master=False, timeout=timedelta(seconds=30))
    local, client, engine = (), None, None
    try:
        local = tuple(LocalComm(store, local_rank, 2, f"{node}-{stage}", timeout=TIMEOUT) for stage in ("rs", "ag"))
        client = Client([server], job_id, 0, 1, timeout=TIMEOUT)
        slices = lambda n: [local[0].slice_range(n, r) for r in range(2)]  # noqa: E731
        keys = KeyBook(Placement(server_weights([], [server])), PARTITION, slices)
        engine = PushPullEngine(client, keys, local=local, local_rank=local_rank, timeout=TIMEOUT)
        results.put((local_rank, "ok", SCENARIOS[scenario](engine, local_rank)))
    except BaseException as e:  # noqa: BLE001
        results.put((local_rank, type(e).__name__, f"{e}\n{traceback.format_exc()}"))
    finally:
        for closing in (engine, client, *local):
            if closing is not None:
                closing.close()


def run(scenario: str, server, job_id: int, reporting: tuple[int, ...] = (0, 1)) -> dict[int, object]:
    """Run `scenario` on two local ranks; return each reporting rank's result. Kills what is left at the end."""
    ctx = mp.get_context("forkserver")
    ctx.set_forkserver_preload([__name__])  # no effect if another test module started the forkserver first
    store = dist.TCPStore("127.0.0.1", 0, is_master=True, wait_for_workers=False)
    node, results = f"e{uuid.uuid4().hex[:8]}", ctx.Queue()
    args = (store.port, server.address, job_id, node, scenario, results)
    procs = [ctx.Process(target=_rank, args=(r, *args), daemon=True) for r in range(2)]
    for p in procs:
        p.start()
    out = {}
    try:
        while set(reporting) - out.keys():
            rank, status, payload = results.get(timeout=HUNG + 30)
            assert status == "ok" and rank in reporting, f"local rank {rank}: {status}: {payload}"
            out[rank] = payload
    except queue.Empty:
        raise AssertionError(f"{scenario}: no report within {HUNG + 30} s; so far {out}") from None
    finally:
        for p in procs:
            if p.is_alive():
                p.kill()  # a SIGSTOPped rank too
            p.join(10)
    assert [n for n in os.listdir(shm.SHM_DIR) if node in n] == []  # no segment left, killed rank or not
    return out


def test_two_local_ranks_sum_through_the_local_stages_and_the_server(server, job_id):
    assert run("sums", server, job_id) == {0: 12, 1: 12}


def test_a_local_rank_that_never_reaches_the_all_gather_fails_the_collective_in_time(server, job_id):
    """Rank 1 stops at the all-gather: rank 0's collective fails with a timeout naming the stage, both ranks and the
    round, its Future raising it (what DDP waits on), and the engine lives on: the next one fails, too."""
    gather, scatter = run("all_gather_never_met", server, job_id, reporting=(0,))[0]
    kind, message, elapsed = gather
    assert kind == BpsTimeoutError.__name__, message
    assert "local rank 0: all_gather call #1" in message and "waiting for local rank 1 (pid" in message, message
    assert TIMEOUT * 0.9 < elapsed < TIMEOUT + 3, elapsed
    kind, message, elapsed = scatter
    assert kind == BpsTimeoutError.__name__ and "local rank 0: reduce_scatter call #2" in message, message
    assert elapsed < TIMEOUT + 3, elapsed
