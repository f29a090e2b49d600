"""Asynchronous and bounded-staleness training (torch_bps.AsyncTraining) with real ranks and a real server: every
acknowledged update is in the servers' model exactly once, a pull respects the staleness bound (and with none, a
fast rank runs ahead), with overlap a step returns while its round travels, a killed or stopped rank holds
nobody back, and settings that cannot be are refused by name."""

from __future__ import annotations

import os
import signal
import threading
import time

import pytest
import torch
import torch.distributed as dist

from tests.helpers import (
    ServerProcess,
    quick_heartbeat_server,
    run_losing_last_rank,
    run_ranks,
    start_servers,
    stop_servers,
)
from torch_bps import AsyncTraining, Config
from torch_bps.client import Client
from torch_bps.errors import ConfigError

pytestmark = pytest.mark.timeout(240)

WORLD = 4  # a power of two: every update (r + 1) / WORLD and every sum of them is exact in fp32
STEPS = 10
SLOW = 3  # the straggler's rank
DELAY = 0.15  # its extra seconds per step


@pytest.fixture
def server():
    s = ServerProcess(auth=False)
    yield s
    s.stop()


def _config(address: str) -> Config:
    return Config.resolve(servers=(address,), placement="dedicated", failover=False, auth="off", timeout=30)


def _counts(model: torch.Tensor) -> list[int]:
    """How many updates of each rank a model holds: rank r's each subtract (r + 1) / WORLD from element r only."""
    return [round(-model[r].item() * WORLD / (r + 1)) for r in range(WORLD)]


def _train(rank, world, gloo, address, staleness, overlap):
    """p starts at 0; rank r's gradient is r + 1 on element r only; SGD with lr 1. Returns, per step, how many
    updates of each rank the pulled model held, then the model after every rank finished."""
    p = torch.nn.Parameter(torch.zeros(WORLD))
    opt = torch.optim.SGD([p], lr=1.0)
    trainer = AsyncTraining(torch.nn.ParameterList([p]), opt, staleness=staleness, overlap=overlap,
                            config=_config(address))  # fmt: skip
    seen = []
    for _ in range(STEPS):
        opt.zero_grad()
        if rank == SLOW:
            time.sleep(DELAY)
        ((rank + 1) * p[rank]).backward()
        trainer.step()
        seen.append(_counts(p.detach()))
    trainer.flush()  # this rank's updates are in
    dist.barrier(group=gloo)  # every update is in: one more pull reads them all
    trainer.flush()
    trainer.close()
    return seen, p.detach().numpy().tobytes()


@pytest.mark.parametrize("staleness, overlap", [(0, False), (1, False), (1, True), (None, False), (None, True)],
                         ids=["s0", "s1", "s1-overlap", "async", "async-overlap"])  # fmt: skip
def test_every_update_is_in_the_model_once_and_pulls_respect_the_bound(server, staleness, overlap):
    results = run_ranks(_train, WORLD, server.address, staleness, overlap, backend="gloo")
    final = torch.tensor([-(r + 1) * STEPS / WORLD for r in range(WORLD)], dtype=torch.float32)
    for _, params in results:
        assert params == final.numpy().tobytes(), _counts(torch.frombuffer(bytearray(params), dtype=torch.float32))
    for rank, (seen, _) in enumerate(results):
        for t, counts in enumerate(seen):
            assert counts[rank] == t + 1, (rank, t, counts)  # its own update is in, once
            if staleness is not None:  # the pull of round t waited for every rank's round t - s
                assert min(counts) >= t + 1 - staleness, (rank, t, counts)
    if staleness is None:  # no waiting: a fast rank finished before the slow one had pushed most of its rounds
        assert min(seen[-1][SLOW] for seen, _ in results[:SLOW]) < STEPS - 2, [s[-1] for s, _ in results]


def _overlapping(rank, world, gloo, address, pid, staleness, overlap):
    """One step while rank 0 holds the server stopped: whether rank 0's came back within 2 s, and the model after
    every rank flushed."""
    p = torch.nn.Parameter(torch.zeros(2))
    opt = torch.optim.SGD([p], lr=1.0)
    trainer = AsyncTraining(torch.nn.ParameterList([p]), opt, staleness=staleness, overlap=overlap,
                            config=_config(address))  # fmt: skip
    p.sum().backward()
    trainer.step()
    trainer.flush()  # connected, nothing in flight
    dist.barrier(group=gloo)
    opt.zero_grad()
    p.sum().backward()
    came_back = None
    if rank == 0:
        returned = threading.Event()
        os.kill(pid, signal.SIGSTOP)
        try:
            stepping = threading.Thread(target=lambda: (trainer.step(), returned.set()), daemon=True)
            stepping.start()
            came_back = returned.wait(2.0)
        finally:
            os.kill(pid, signal.SIGCONT)
        stepping.join(60)
    else:
        trainer.step()
    trainer.flush()
    dist.barrier(group=gloo)
    trainer.flush()
    trainer.close()
    return came_back, p.detach().tolist()


@pytest.mark.parametrize("staleness, overlap", [(0, False), (1, False), (1, True), (None, True)],
                         ids=["s0", "s1", "s1-overlap", "async-overlap"])  # fmt: skip
def test_a_step_returns_while_its_round_travels_with_overlap(server, staleness, overlap):
    results = run_ranks(_overlapping, 2, server.address, server.proc.pid, staleness, overlap, backend="gloo")
    assert results[0][0] == overlap  # the round goes on while the next gradient is computed
    assert [model for _, model in results] == [[-2.0, -2.0]] * 2  # every update in the servers' model, once


def _alone(rank, world, gloo, staleness, overlap):
    p = torch.nn.Parameter(torch.zeros(2))
    opt = torch.optim.SGD([p], lr=1.0)
    trainer = AsyncTraining(torch.nn.ParameterList([p]), opt, staleness=staleness, overlap=overlap,
                            config=_config("127.0.0.1:1"))  # fmt: skip
    for _ in range(3):
        opt.zero_grad()
        p.sum().backward()
        trainer.step()
    trainer.flush()
    trainer.close()
    return p.detach().tolist()


@pytest.mark.parametrize("staleness, overlap", [(0, False), (None, True)], ids=["s0", "async-overlap"])
def test_a_job_of_one_worker_keeps_every_update(staleness, overlap):
    assert run_ranks(_alone, 1, staleness, overlap, backend="gloo") == [[-3.0, -3.0]]


def _until_lost(rank, world, address, how):
    p = torch.nn.Parameter(torch.zeros(world))
    opt = torch.optim.SGD([p], lr=1.0)
    trainer = AsyncTraining(torch.nn.ParameterList([p]), opt, staleness=1, overlap=True, config=_config(address))
    for step in range(3 * STEPS):
        if rank == world - 1 and step == 4:
            trainer.flush()  # its updates of steps 0-3 acknowledged (a step returns with its round in flight)
            os.kill(os.getpid(), how)
        opt.zero_grad()
        (world * (rank + 1) * p[rank]).backward()  # each update is -(rank + 1) on element rank: exact
        trainer.step()
    return p.detach().tolist()


@pytest.fixture
def quick_server():
    s = quick_heartbeat_server()
    yield s
    s.stop()


@pytest.mark.parametrize("how", [signal.SIGKILL, signal.SIGSTOP], ids=["killed", "stopped"])
def test_a_lost_rank_holds_nobody_back_and_its_acknowledged_updates_stay_once(quick_server, how):
    world = 3
    got = run_losing_last_rank(_until_lost, world, quick_server.address, how)
    assert [got[r][0] for r in range(world - 1)] == ["ok", "ok"], got
    for r in range(world - 1):
        model = got[r][1]
        # Its own updates, once each; the lost rank's 4 acknowledged ones (steps 0-3), once each, and no more.
        assert model[r] == -(r + 1) * 3 * STEPS, (r, model)
        assert model[world - 1] == -world * 4, (r, model)


BLOCK = 4096  # elements per rank: several partitions of 4 KiB, on both servers


def _assert_every_update_once(model: bytes, world: int = 3) -> None:
    """A final model of _through_failover or _through_rebalance: rank r's STEPS updates of -(r + 1), each once."""
    got = torch.frombuffer(bytearray(model), dtype=torch.float32).view(world, BLOCK)
    want = torch.tensor([[-(r + 1) * STEPS] * BLOCK for r in range(world)], dtype=torch.float32)
    assert torch.equal(got, want), [sorted(set(row.tolist())) for row in got]


def _through_failover(rank, world, gloo, addresses, victim, flag, overlap):
    """As _train, on a parameter of a block per rank, while rank 0 SIGKILLs server `victim` at step 4. With `flag`
    (a path), the last rank waits after its step 2 until rank 0 killed it, then lags: a round behind rank 0 at the
    failover, and slower after it. Every rank checks the staleness bound at every step."""
    p = torch.nn.Parameter(torch.zeros(world * BLOCK))
    opt = torch.optim.SGD([p], lr=1.0)
    config = Config.resolve(servers=tuple(addresses), placement="dedicated", failover=True, auth="off", timeout=30,
                            failover_timeout=30, min_partition_bytes=4096)  # fmt: skip
    trainer = AsyncTraining(torch.nn.ParameterList([p]), opt, staleness=1, overlap=overlap, config=config)
    for step in range(STEPS):
        if rank == 0 and step == 4:
            os.kill(victim, signal.SIGKILL)
            if flag:
                open(flag, "w").close()
        if flag and rank == world - 1 and step >= 3:
            while step == 3 and not os.path.exists(flag):
                time.sleep(0.01)
            time.sleep(0.2)
        opt.zero_grad()
        (world * (rank + 1) * p[rank * BLOCK : (rank + 1) * BLOCK].sum()).backward()  # updates of -(rank + 1)
        trainer.step()
        # Staleness 1: this pull holds every rank's updates of steps 0 .. step - 1 at least, in every partition.
        worst = p.detach().view(world, BLOCK).max(dim=1).values
        bound = torch.tensor([-(r + 1) * step for r in range(world)], dtype=worst.dtype)
        assert bool((worst <= bound).all()), f"rank {rank} after step {step}: {worst.tolist()} > {bound.tolist()}"
    trainer.flush()
    dist.barrier(group=gloo)
    trainer.flush()
    failovers = len(trainer._connection.get()._engine.router.failovers)
    trainer.close()
    return p.detach().numpy().tobytes(), failovers  # bytes: a tensor would go by a file descriptor, gone at exit


@pytest.mark.parametrize("lagging, overlap", [(False, False), (True, False), (True, True)],
                         ids=["together", "a-rank-lags", "a-rank-lags-overlap"])  # fmt: skip
def test_a_killed_server_loses_no_update_and_adds_none_twice(tmp_path, lagging, overlap):
    servers = start_servers(2, auth=False)
    flag = str(tmp_path / "killed") if lagging else None
    try:
        results = run_ranks(_through_failover, 3, [s.address for s in servers], servers[0].proc.pid, flag, overlap,
                            backend="gloo")  # fmt: skip
    finally:
        stop_servers(servers)
    for model, failovers in results:
        assert failovers == 1
        _assert_every_update_once(model)


def _through_rebalance(rank, world, gloo, addresses, standby, overlap):
    """As _through_failover with no server lost: every rank calls `rebalance()` after step 5, with a standby
    (`standby`) that the job does not use until then."""
    p = torch.nn.Parameter(torch.zeros(world * BLOCK))
    opt = torch.optim.SGD([p], lr=1.0)
    config = Config.resolve(servers=tuple(addresses), standby_servers=(standby,), placement="dedicated",
                            failover=True, auth="off", timeout=30, failover_timeout=30,
                            min_partition_bytes=4096)  # fmt: skip
    trainer = AsyncTraining(torch.nn.ParameterList([p]), opt, staleness=1, overlap=overlap, config=config)
    record = None
    for step in range(STEPS):
        if step == 6:
            record = trainer.rebalance()
        if rank == world - 1:
            time.sleep(0.1)  # the last rank lags: the others wait at the staleness bound, then in the rebalance
        opt.zero_grad()
        (world * (rank + 1) * p[rank * BLOCK : (rank + 1) * BLOCK].sum()).backward()
        trainer.step()
    trainer.flush()
    dist.barrier(group=gloo)
    trainer.flush()
    trainer.close()
    return p.detach().numpy().tobytes(), record


@pytest.mark.parametrize("overlap", [False, True], ids=["", "overlap"])
def test_a_rebalance_moves_the_model_with_its_keys_and_loses_no_update(overlap):
    """The servers' model is a running total: a rebalance onto a new placement (a standby taken in) must carry it,
    or the model loses the updates before it."""
    servers = start_servers(3, auth=False)
    try:
        results = run_ranks(_through_rebalance, 3, [s.address for s in servers[:2]], servers[2].address, overlap,
                            backend="gloo")  # fmt: skip
    finally:
        stop_servers(servers)
    for model, record in results:
        assert record["rebalance"] == 1 and sorted(record["servers"]) == sorted(s.address for s in servers), record
        _assert_every_update_once(model)


def test_settings_that_cannot_be_are_refused_by_name(server, monkeypatch):
    with pytest.raises(ConfigError, match="staleness=-1"):
        Config.resolve(staleness=-1)
    with pytest.raises(ConfigError, match="a job has one or the other"):
        Config.resolve(staleness=2, backup_workers=1)
    with pytest.raises(ConfigError, match="BPS_STALENESS"):
        Config.resolve(staleness=-2)
    monkeypatch.setenv("BPS_STALENESS", "inf")
    assert Config.resolve().staleness is None
    with pytest.raises(ConfigError, match="overlap=True needs staleness >= 1"):
        AsyncTraining(torch.nn.Linear(1, 1), torch.optim.SGD([torch.zeros(1)]), staleness=0, overlap=True)
    with pytest.raises(ValueError, match="staleness=-1 must be None"):
        Client([server.address], 7, 0, 2, staleness=-1, auth=False)
