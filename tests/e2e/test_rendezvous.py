"""Dedicated servers joining a job started with torchrun's c10d rendezvous (`bps-server --register` and
BPS_REGISTRY), with real processes: torchrun on loopback and a real bps-server."""

from __future__ import annotations

import os
import subprocess
import sys

import pytest
import torch
import torch.distributed as dist

import torch_bps
from tests.helpers import REPO, ServerProcess, _free_port

pytestmark = pytest.mark.timeout(240)


def _worker() -> None:
    """Each torchrun rank's program (this file run as a script): one all_reduce on "byteps", then print the servers
    it used."""
    dist.init_process_group("byteps")
    t = torch.full((1000,), float(dist.get_rank() + 1))
    dist.all_reduce(t)
    world = dist.get_world_size()
    assert torch.equal(t, torch.full((1000,), world * (world + 1) / 2)), t
    print(f"rank {dist.get_rank()} servers {','.join(torch_bps.implementation().runtime.addresses)}", flush=True)
    dist.destroy_process_group()


def _torchrun(endpoint: str, env: dict[str, str], timeout: float = 150) -> subprocess.CompletedProcess:
    cmd = [sys.executable, "-m", "torch.distributed.run", "--nnodes", "1", "--nproc-per-node", "2",
           "--rdzv-backend", "c10d", "--rdzv-endpoint", endpoint, "--max-restarts", "0", __file__]  # fmt: skip
    env = {**os.environ, "PYTHONPATH": REPO, "OMP_NUM_THREADS": "1", "BPS_NUM_SERVERS": "1",
           "BPS_PLACEMENT": "dedicated", **env}  # fmt: skip
    return subprocess.run(cmd, env=env, capture_output=True, text=True, timeout=timeout)


def test_a_registered_server_joins_a_c10d_rendezvous_job():
    """The server registers at the rendezvous endpoint; the workers, told it by BPS_REGISTRY, find it there.
    The server starts first: its registration waits for the endpoint's store to listen."""
    endpoint = f"127.0.0.1:{_free_port()}"
    server = ServerProcess(extra_args=("--register", endpoint))
    try:
        done = _torchrun(endpoint, {"BPS_REGISTRY": endpoint, "BPS_CONNECT_TIMEOUT": "60"})
        assert done.returncode == 0, done.stdout[-2000:] + done.stderr[-4000:]
        for rank in (0, 1):
            assert f"rank {rank} servers {server.address}" in done.stdout, done.stdout
        assert server.alive()
    finally:
        server.stop()


def test_without_a_registry_the_timeout_says_what_to_do():
    """The old recipe (register at the endpoint, workers read their own store) cannot work under c10d: the
    workers' store is on another port. They fail after BPS_CONNECT_TIMEOUT naming BPS_REGISTRY."""
    endpoint = f"127.0.0.1:{_free_port()}"
    server = ServerProcess(extra_args=("--register", endpoint))
    try:
        done = _torchrun(endpoint, {"BPS_CONNECT_TIMEOUT": "5"})
        assert done.returncode != 0
        assert "waited 5.0s for 1 dedicated servers to register in the job's store" in done.stderr, done.stderr[-3000:]
        assert "set BPS_REGISTRY" in done.stderr
    finally:
        server.stop()


if __name__ == "__main__":
    _worker()
