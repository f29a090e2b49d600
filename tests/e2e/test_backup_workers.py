"""Backup workers (torch_bps.backup.BackupWorkers) with real ranks and a real server: a slow rank does not set the
pace, every rank applies the contributors' mean (never the sum over n), replicas stay bit-identical, a killed rank
does not stop the job, and settings the job cannot have are refused by name."""

from __future__ import annotations

import copy
import dataclasses
import functools
import os
import signal
import threading
import time

import pytest
import torch
from torch.nn.parallel import DistributedDataParallel

from tests.helpers import ServerProcess, quick_heartbeat_server, run_losing_last_rank, run_ranks
from torch_bps import BackupWorkers, Config
from torch_bps.client import Client
from torch_bps.errors import ConfigError, ServerError

pytestmark = pytest.mark.timeout(240)

STEPS = 12
SLOW = 2  # the straggler's rank
DELAY = 0.4  # its extra seconds per computed step


@pytest.fixture
def server():
    s = ServerProcess(auth=False)
    yield s
    s.stop()


def _config(server_address: str) -> Config:
    return Config.resolve(servers=(server_address,), placement="dedicated", failover=False, auth="off", timeout=30)


def _plain(rank, world, gloo, address):
    """p starts at 0; rank r's gradient is r + 1 everywhere; SGD with lr 1 subtracts the round's mean each step."""
    p = torch.nn.Parameter(torch.zeros(4))
    opt = torch.optim.SGD([p], lr=1.0)
    sync = BackupWorkers(torch.nn.ParameterList([p]), opt, backups=1, config=_config(address))
    deltas = []
    for _ in range(STEPS):
        opt.zero_grad()
        before = p.detach().clone()
        if sync.compute():
            if rank == SLOW:
                time.sleep(DELAY)
            ((rank + 1) * p.sum()).backward()
        sync.step()
        deltas.append((before - p.detach())[0].item())
    sync.close()
    return deltas, p.detach().numpy().tobytes(), sync.caught_up


def test_a_slow_rank_is_dropped_and_catches_up_and_every_rank_applies_the_contributors_mean(server):
    results = run_ranks(_plain, 3, server.address, backend="gloo")
    deltas, params, caught_up = zip(*results, strict=True)
    assert len(set(params)) == 1, "replicas differ"
    assert deltas[0] == deltas[1] == deltas[2]
    # Contributors {0,1,2}: (1+2+3)/3; two of them: 1.5, 2 or 2.5. Dividing by n instead would give 1, 4/3 or 5/3.
    assert set(deltas[0]) <= {2.0, 1.5, 2.5}, deltas[0]
    assert 1.5 in deltas[0], "the straggler was never dropped"
    assert caught_up[SLOW] >= 2 and caught_up[0] == caught_up[1] == 0, caught_up


def _ddp(rank, world, gloo, address, compressor=""):
    torch.manual_seed(0)  # DDP broadcasts rank 0's parameters anyway
    net = torch.nn.Sequential(torch.nn.Linear(8, 16), torch.nn.Tanh(), torch.nn.Linear(16, 1))
    model = DistributedDataParallel(net, process_group=gloo, bucket_cap_mb=0.0002)  # several buckets
    opt = torch.optim.SGD(model.parameters(), lr=0.05, momentum=0.9)
    config = dataclasses.replace(_config(address), compressor=compressor, compress_min_bytes=256)  # the first weight
    sync = BackupWorkers(model, opt, backups=1, config=config)
    data = torch.Generator().manual_seed(rank)
    for _ in range(STEPS):
        opt.zero_grad()
        if sync.compute():
            if rank == SLOW:
                time.sleep(DELAY)
            x = torch.randn(4, 8, generator=data)
            torch.nn.functional.mse_loss(model(x), x.sum(1, keepdim=True)).backward()
        sync.step()
    compressor = sync._connection.get()._engine.compressor
    encoded = len(compressor._residuals) if compressor is not None else 0  # keys this rank pushed compressed
    sync.close()
    return b"".join(p.detach().numpy().tobytes() for p in model.parameters()), sync.caught_up, encoded


@pytest.mark.parametrize("compressor", ["", "onebit", "topk:0.25", "randomk:0.25"])
def test_ddp_with_backup_workers_keeps_replicas_bit_identical(server, compressor):
    """With a compressor too: the rounds' weights travel compressed, and the straggler catches up by decoding the
    encoded sums the others made."""
    results = run_ranks(functools.partial(_ddp, compressor=compressor), 3, server.address, backend="gloo")
    params, caught_up, encoded = zip(*results, strict=True)
    assert len(set(params)) == 1, "replicas differ"
    assert caught_up[SLOW] >= 1, caught_up
    assert all(encoded) == bool(compressor), encoded


def _ddp_until_the_server_dies(rank, world, gloo, address, pid):
    """DDP under BackupWorkers, its one server stopped by rank 0 at step 2 and killed a second later (failover off),
    so that the rounds of the step fail while DDP waits for them: what each rank got."""
    torch.manual_seed(0)
    model = DistributedDataParallel(torch.nn.Linear(8, 1), process_group=gloo)
    opt = torch.optim.SGD(model.parameters(), lr=0.05)
    sync = BackupWorkers(model, opt, backups=1, config=_config(address))
    for step in range(8):
        if step == 2 and rank == 0:
            os.kill(pid, signal.SIGSTOP)
            threading.Timer(1.0, os.kill, (pid, signal.SIGKILL)).start()
        opt.zero_grad()
        try:
            if sync.compute():
                model(torch.randn(4, 8)).sum().backward()
            sync.step()
        except Exception as e:  # noqa: BLE001 - the error is the result
            return type(e).__name__, str(e)
    return "", ""


def test_a_failed_round_under_ddp_reaches_every_rank_as_an_error_naming_the_server(server):
    """The round's future fails in C++ (torch_bps.futures), so DDP's reducer raises our typed error, not "Unable to
    cast <the exception> to Tensor" (a future failed with set_exception holds the exception as its value)."""
    for kind, message in run_ranks(_ddp_until_the_server_dies, 3, server.address, server.proc.pid, backend="gloo"):
        assert kind == "TransportError" and server.address in message, (kind, message)


def _sparse_embedding(rank, world, gloo, address):
    """A plain module with nn.Embedding(sparse=True) under BackupWorkers (b = 0: every round whole) against DDP on
    gloo: the same parameters; DDP with such a bucket is refused by name."""
    torch.manual_seed(0)
    base = torch.nn.Embedding(50, 4, sparse=True)
    ours, ref = copy.deepcopy(base), DistributedDataParallel(copy.deepcopy(base), process_group=gloo)
    opts = [torch.optim.SGD(m.parameters(), lr=0.5) for m in (ours, ref)]
    sync = BackupWorkers(ours, opts[0], backups=0, config=_config(address))
    data = torch.Generator().manual_seed(rank)
    for _ in range(4):
        ids = torch.randint(0, 50, (6,), generator=data)
        assert sync.compute()  # b = 0: every step is computed
        for m, opt in zip((ours, ref), opts, strict=True):
            opt.zero_grad()
            m(ids).pow(2).sum().backward()
        sync.step()
        opts[1].step()
    sync.close()
    refused = ""
    ddp = DistributedDataParallel(copy.deepcopy(base), process_group=gloo)
    opt = torch.optim.SGD(ddp.parameters(), lr=0.5)
    sync = BackupWorkers(ddp, opt, backups=0, config=_config(address))
    try:
        ddp(torch.tensor([1, 2])).sum().backward()
    except Exception as e:  # noqa: BLE001 - DDP's reducer rethrows the hook's error
        refused = str(e)
    sync.close()
    return torch.equal(ours.weight, ref.module.weight), refused


def test_a_sparse_embedding_is_summed_dense_on_a_plain_module_and_refused_by_name_in_ddp(server):
    for equal, refused in run_ranks(_sparse_embedding, 2, server.address, backend="gloo"):
        assert equal
        assert "sparse gradients (nn.Embedding(sparse=True)) is not supported" in refused, refused


def _train_until_killed(rank, world, address, how):
    p = torch.nn.Parameter(torch.zeros(4))
    opt = torch.optim.SGD([p], lr=1.0)
    sync = BackupWorkers(torch.nn.ParameterList([p]), opt, backups=1, config=_config(address))
    # Long enough to pass the servers' window many times over (each of a step's 4 key slots keeps 4 rounds).
    for step in range(5 * STEPS):
        if rank == SLOW and step == 4:
            os.kill(os.getpid(), how)
        opt.zero_grad()
        if sync.compute():
            ((rank + 1) * p.sum()).backward()
        sync.step()
    return p.detach().numpy().tobytes()


@pytest.fixture
def quick_server():
    s = quick_heartbeat_server()
    yield s
    s.stop()


@pytest.mark.parametrize("how", [signal.SIGKILL, signal.SIGSTOP], ids=["killed", "stopped"])
def test_a_lost_rank_does_not_stop_a_job_with_a_backup(quick_server, how):
    got = run_losing_last_rank(_train_until_killed, SLOW + 1, quick_server.address, how)
    assert got[0][0] == got[1][0] == "ok", got
    assert got[0][1] == got[1][1]


def test_settings_a_job_cannot_have_are_refused_by_name(server):
    with pytest.raises(ConfigError, match="BPS_BACKUP_WINDOW"):
        Config.resolve(backup_workers=1, backup_window=1)
    with pytest.raises(ConfigError, match="backup_workers=-1"):
        Config.resolve(backup_workers=-1)
    with pytest.raises(ValueError, match="backups=2 must be in"):
        Client([server.address], 7, 0, 2, backups=2, auth=False)
    # Every worker of a job must say the same: mixing modes within one job is refused, naming both.
    with Client([server.address], 7, 0, 3, backups=1, window=3, auth=False):
        with pytest.raises(ServerError, match="3 workers, 0 backup workers, 2 live rounds and staleness 0, but the "
                                              "job was declared with 3, 1, 3 and 0"):  # fmt: skip
            Client([server.address], 7, 1, 3, auth=False)
