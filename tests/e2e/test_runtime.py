"""The runtime end to end: rendezvous through a real TCPStore, real worker processes, real servers."""

from __future__ import annotations

import multiprocessing as mp
import os
import socket
import time
import traceback
from datetime import timedelta

import pytest
import torch
import torch.distributed as dist

from tests.helpers import ServerProcess
from torch_bps.address import split_host_port
from torch_bps.config import DEFAULT_CREDIT_BYTES

pytestmark = pytest.mark.timeout(180)

DTYPES = [torch.float32, torch.float64, torch.int32, torch.int64, torch.float16, torch.bfloat16]


def _store(port: int) -> dist.TCPStore:
    return dist.TCPStore("127.0.0.1", port, is_master=False, timeout=timedelta(seconds=60))


def _data(rank: int, numel: int, dtype: torch.dtype, step: int) -> torch.Tensor:
    return ((torch.arange(numel) % 13) * (rank + 1) + step).to(dtype)


def _wait_until_refused(address: str, timeout: float = 30) -> None:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        try:
            socket.create_connection(split_host_port(address), timeout=1).close()
        except OSError:
            return
        time.sleep(0.05)
    raise TimeoutError(f"{address} still accepts connections after {timeout} s")


def _worker(rank, world, port, env, scenario, results):
    try:
        os.environ.update(env)
        torch.set_num_threads(1)
        from torch_bps.runtime import Runtime

        rt = Runtime.create(_store(port), rank, world)
        out = {}
        if scenario == "sums":
            for step in range(3):
                futs = []
                for i, dtype in enumerate(DTYPES):
                    for numel in (1, 1000, 40_000):
                        t = _data(rank, numel, dtype, step)
                        futs.append(((i, numel, step), rt.push_pull(t, priority=numel % 3)))
                for (i, numel, step_), f in futs:
                    check_sum(f.wait(), world, DTYPES[i], numel, step_)
            out["addresses"] = rt.addresses
            out["credit"] = rt._client.scheduler_stats()["credit_bytes"]
        elif scenario == "bytes_per_machine":
            numel, steps = 300_000, 3  # 1.2 MB of fp32: 1 partition of 4 MB per local slice
            before = sum(rt._client.bytes_sent())
            for step in range(steps):
                t = _data(rank, numel, torch.float32, step)
                check_sum(rt.push_pull(t).wait(), world, torch.float32, numel, step)
            out["sent"] = sum(rt._client.bytes_sent()) - before
            out["payload"] = steps * numel * 4
        elif scenario == "priorities_differ":
            # Rank 0 sees the urgent collective later than rank 1 does, so their schedulers pick partitions in
            # different orders under a one-partition credit. Credit held until the sums came back would
            # leave each rank waiting for a partition the other has not pushed: a deadlock.
            a, b = _data(rank, 20_000, torch.float32, 0), _data(rank, 20_000, torch.float32, 1)
            fa = rt.push_pull(a, priority=0)
            if rank == 0:
                time.sleep(0.3)
            fb = rt.push_pull(b, priority=10)
            check_sum(fa.wait(), world, torch.float32, 20_000, 0)
            check_sum(fb.wait(), world, torch.float32, 20_000, 1)
        elif scenario == "server_killed":
            rt.push_pull(torch.ones(10)).wait()
            results.put((rank, "ready"))
            _wait_until_refused(rt.addresses[0])  # the test kills the server meanwhile
            start = time.monotonic()
            try:
                rt.push_pull(torch.ones(10)).wait()
                out["error"] = None
            except Exception as e:
                out["error"] = f"{type(e).__name__}: {e}"
            out["seconds"] = time.monotonic() - start
        elif scenario == "again":
            # A second runtime of the same name in the same store and launch attempt; rank 1 comes first, so it
            # reads the store before rank 0 wrote anything of the second runtime.
            rt.push_pull(torch.ones(10)).wait()
            first = rt._client.job_id
            rt.close()
            if rank == 0:
                time.sleep(1.0)
            rt = Runtime.create(_store(port), rank, world)
            check_sum(rt.push_pull(_data(rank, 1000, torch.float32, 0)).wait(), world, torch.float32, 1000, 0)
            out["job_ids"] = (first, rt._client.job_id)
        rt.close()
        results.put((rank, out))
    except Exception:
        results.put((rank, traceback.format_exc()))


def run(world, env, scenario="sums", on_ready=None, timeout=120, store=None):
    store = store or dist.TCPStore("127.0.0.1", 0, is_master=True, timeout=timedelta(seconds=60))
    ctx = mp.get_context("spawn")
    results = ctx.Queue()
    # Daemonic: at exit multiprocessing terminates them instead of waiting for them (a rank stuck in a collective).
    procs = [ctx.Process(target=_worker, args=(r, world, store.port, env(r), scenario, results), daemon=True)
             for r in range(world)]  # fmt: skip
    for p in procs:
        p.start()
    try:
        if on_ready is not None:
            for _ in range(world):
                assert results.get(timeout=timeout)[1] == "ready"
            on_ready()
        out = dict(results.get(timeout=timeout) for _ in range(world))
    finally:
        for p in procs:
            p.join(timeout=30)
            if p.is_alive():
                p.kill()
    for rank, value in out.items():
        assert isinstance(value, dict), f"rank {rank} failed:\n{value}"
    return out


def check_sum(got, world, dtype, numel, step):
    """Exact in every dtype: the sums are integers of at most 12 x (1 + 2 + 3) + 2 x 3 = 78, which bf16 and fp16
    hold exactly. (A tolerance would let a round summed with the next one's data pass: it is off by `world`.)"""
    expected = sum(_data(r, numel, dtype, step).double() for r in range(world)).to(dtype)
    assert torch.equal(got, expected), (dtype, numel, step)


def test_embedded_servers_one_machine_tiny_partitions():
    """No servers configured: the job starts its own; 3 KB partitions make many keys per tensor."""
    env = lambda r: {"BPS_PARTITION_BYTES": "3000", "BPS_CREDIT_BYTES": "20000", "BPS_LOCAL_REDUCE": "0",  # noqa: E731
                     "BPS_MIDDLE_PARTITION_FACTOR": "2"}  # fmt: skip
    out = run(2, env)
    assert [len(o["addresses"]) for o in out.values()] == [1, 1]  # one machine: one colocated server
    assert out[0]["addresses"] == out[1]["addresses"]
    assert [o["credit"] for o in out.values()] == [20000, 20000]  # an explicit credit wins


def test_dedicated_servers_from_env():
    servers = [ServerProcess(), ServerProcess()]
    try:
        addrs = ",".join(s.address for s in servers)
        env = lambda r: {"BPS_SERVERS": addrs, "BPS_PARTITION_BYTES": "65536", "BPS_LOCAL_REDUCE": "0",  # noqa: E731
                         "BPS_MIDDLE_PARTITION_FACTOR": "2"}  # fmt: skip
        out = run(3, env)
        assert [o["addresses"] for o in out.values()] == [[s.address for s in servers]] * 3
        assert [o["credit"] for o in out.values()] == [2 * DEFAULT_CREDIT_BYTES] * 3  # dedicated: 2 MiB x F
    finally:
        for s in servers:
            s.stop()


def test_emulated_machines_each_start_a_colocated_server():
    """2 machines x 1 rank, told apart by torchrun's variables: two embedded servers, all-reduce traffic."""
    env = lambda r: {"LOCAL_RANK": "0", "LOCAL_WORLD_SIZE": "1", "GROUP_RANK": str(r), "GROUP_WORLD_SIZE": "2",  # noqa: E731
                     "BPS_MIDDLE_PARTITION_FACTOR": "2"}  # fmt: skip
    out = run(2, env)
    assert [len(o["addresses"]) for o in out.values()] == [2, 2] and out[0]["addresses"] == out[1]["addresses"]
    assert [o["credit"] for o in out.values()] == [DEFAULT_CREDIT_BYTES] * 2  # colocated only: 2 MiB at any F


def test_killed_server_fails_the_collective_not_hangs():
    server = ServerProcess()
    try:
        # Failover off: with it, training goes on (tests/faults/test_failover.py).
        env = {"BPS_SERVERS": server.address, "BPS_TIMEOUT": "60", "BPS_LOCAL_REDUCE": "0", "BPS_FAILOVER": "0"}
        out = run(2, lambda r: env, "server_killed", on_ready=server.kill)
        for rank in range(2):
            # At once, not at the request timeout: the connection is known to be gone.
            assert out[rank]["error"].startswith(f"TransportError: server {server.address} is unreachable"), out[rank]
            assert out[rank]["seconds"] < 3, out[rank]
    finally:
        server.stop()


def test_two_machines_two_local_ranks_push_one_copy_per_machine():
    """2 emulated machines x 2 local ranks: local reduce-scatter, one push per machine, local all-gather."""

    def env(r):
        return {"LOCAL_RANK": str(r % 2), "LOCAL_WORLD_SIZE": "2", "GROUP_RANK": str(r // 2), "GROUP_WORLD_SIZE": "2"}

    out = run(4, env, "bytes_per_machine")
    payload = 3 * 300_000 * 4
    assert [o["payload"] for o in out.values()] == [payload] * 4
    for node in range(2):
        sent = out[2 * node]["sent"] + out[2 * node + 1]["sent"]
        # Each machine sends its gradients once (its two local ranks one half each), plus 96-byte headers:
        # not the two copies a machine without local reduction would send.
        assert payload <= sent <= payload * 1.01, (node, sent, payload)


def test_workers_scheduling_partitions_in_different_orders_do_not_deadlock():
    def env(r):
        return {"BPS_PARTITION_BYTES": "4096", "BPS_CREDIT_BYTES": "4096", "BPS_TIMEOUT": "15", "BPS_LOCAL_REDUCE": "0"}

    run(2, env, "priorities_differ")


def test_dedicated_servers_register_themselves_in_the_job_store():
    """`bps-server --register HOST:PORT` + BPS_NUM_SERVERS: no address is configured on the workers."""
    store = dist.TCPStore("127.0.0.1", 0, is_master=True, timeout=timedelta(seconds=60))
    servers = [ServerProcess(extra_args=("--register", f"127.0.0.1:{store.port}", "--advertise", "127.0.0.1"))
               for _ in range(2)]  # fmt: skip
    try:
        out = run(2, lambda r: {"BPS_NUM_SERVERS": "2", "BPS_LOCAL_REDUCE": "0"}, store=store)
        assert [sorted(o["addresses"]) for o in out.values()] == [sorted(s.address for s in servers)] * 2
    finally:
        for s in servers:
            s.stop()


def test_a_second_runtime_of_the_same_name_is_a_new_job_on_every_rank():
    """Keys of the first runtime (its job id, its count of ranks closed) must not answer for the second's."""
    server = ServerProcess()
    try:
        env = {"BPS_SERVERS": server.address, "BPS_TIMEOUT": "10", "BPS_LOCAL_REDUCE": "0", "BPS_FAILOVER": "0"}
        out = run(2, lambda r: env, "again")
        (first0, second0), (first1, second1) = out[0]["job_ids"], out[1]["job_ids"]
        assert first0 == first1 and second0 == second1 and first0 != second0, out
    finally:
        server.stop()
