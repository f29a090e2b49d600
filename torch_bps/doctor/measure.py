"""The doctor's measurements, taken on the job's real machines (every rank of a torchrun job calls `measure`).

1. Paths, one at a time: local rank 0 of each machine in turn, each server not on its own machine in turn,
   through a one-worker job of its own (`Runtime.solo_client`): a tiny push_pull's round trip, then M bytes
   pushed and pulled back in 16 partitions (the link's goodput: each way at once, pipelined).
2. The collective: M bytes summed over the whole job through the summation service, and gloo's all_reduce of
   the same tensor, each the slowest rank's time, median of the repeats.
3. The servers' summation rate, from their counters (bytes summed per second of adds) after 2.
4. The local hierarchy, with several ranks per machine: a reduce-scatter and all-gather of M bytes.

May import: torch, torch_bps.config, runtime, local, wire and torch_bps.doctor.
"""

from __future__ import annotations

import statistics
import time

import torch
import torch.distributed as dist

from torch_bps.config import Config
from torch_bps.doctor.verdict import Measurements, Path
from torch_bps.runtime import Runtime
from torch_bps.wire import Mode

_RTT_SAMPLES = 20
_PATH_PARTS = 16


def measure(nbytes: int, repeats: int, config: Config | None = None) -> Measurements | None:
    """Measure this job (the default group must be gloo's, already initialized); rank 0 gets the Measurements,
    every other rank None."""
    rank, world = dist.get_rank(), dist.get_world_size()
    rt = Runtime.create(dist.distributed_c10d._get_default_store(), rank, world, name="doctor", config=config)
    try:
        topo = rt.topology
        paths = _paths(rt, nbytes, repeats)
        tensor = torch.ones(max(1, nbytes // 4))
        collective = _timed(lambda: rt.push_pull(tensor).wait(), repeats)
        gloo = _timed(lambda: dist.all_reduce(tensor), repeats)
        local = _local(rt, nbytes, repeats) if topo.local_size > 1 else None
        sums = _sum_rates(rt) if rank == 0 else {}
    finally:
        rt.close()
    if rank != 0:
        return None
    return Measurements(topo.num_nodes, rt.dedicated, tensor.numel() * 4, paths, collective, gloo, sums, local)


def _paths(rt: Runtime, nbytes: int, repeats: int) -> list[Path]:
    """Every machine's path to every server on another host, measured alone; all of them, on every rank."""
    topo, colocated = rt.topology, rt.colocated
    mine: list[Path] = []
    for machine in range(topo.num_nodes):
        dist.barrier()
        if machine != topo.node_rank or topo.local_rank != 0:
            continue
        for address in rt.addresses:
            home = colocated.index(address) if address in colocated else None
            if home == machine:
                continue  # loopback: no link to measure
            end = f"machine {home}" if home is not None else address
            with rt.solo_client(address) as client:
                rtt, goodput = _path(client, nbytes, repeats, rt.config.partition_bytes)
            mine.append(Path(machine, address, end, goodput, rtt))
    dist.barrier()
    everyone: list[list[Path]] = [[] for _ in range(dist.get_world_size())]
    dist.all_gather_object(everyone, mine)
    return [p for paths in everyone for p in paths]


def _path(client, nbytes: int, repeats: int, partition_bytes: int) -> tuple[float, float]:
    """(round trip seconds, goodput bytes/s) of one server through a one-worker client."""
    tiny = torch.zeros(1)
    rtts = []
    for _ in range(_RTT_SAMPLES):
        start = time.perf_counter()
        client.push_pull_batch([(tiny, 0)]).wait()  # a batch of one partition, as the engine sends
        rtts.append(time.perf_counter() - start)
    data = torch.ones(max(1, nbytes // 4))
    # 16 partitions or more: the pull of one overlaps the push of the next, as in a collective, so the time is
    # the link's, not twice it.
    per = max(1, min(partition_bytes, max(64 << 10, nbytes // _PATH_PARTS)) // 4)
    starts = range(0, data.numel(), per)
    parts = [(data[s : s + per], 1 + i, 0, None, Mode.SUM, None, 0, 0) for i, s in enumerate(starts)]
    seconds = _timed(lambda: client.push_pull_batch(parts).wait(), repeats, barrier=False)
    return statistics.median(rtts), data.numel() * 4 / seconds


def _timed(fn, repeats: int, *, barrier: bool = True) -> float:
    """Median seconds of fn over `repeats` runs after one warm-up; with `barrier`, every rank starts together and
    a run's time is the slowest rank's."""
    fn()
    times = []
    for _ in range(repeats):
        if barrier:
            dist.barrier()
        start = time.perf_counter()
        fn()
        elapsed = torch.tensor([time.perf_counter() - start], dtype=torch.float64)
        if barrier:
            dist.all_reduce(elapsed, op=dist.ReduceOp.MAX)
        times.append(elapsed.item())
    return statistics.median(times)


def _local(rt: Runtime, nbytes: int, repeats: int) -> float:
    """Seconds of a local reduce-scatter + all-gather of nbytes among this machine's ranks (slowest rank)."""
    from torch_bps.local import LocalComm

    topo = rt.topology
    store = dist.PrefixStore("torch_bps/doctor", dist.distributed_c10d._get_default_store())
    tensor = torch.ones(max(1, nbytes // 4))
    with LocalComm(store, topo.local_rank, topo.local_size, f"doctor-{topo.node_rank}", timeout=rt.config.timeout,
                   capacity_bytes=16 << 20, job=rt.launch.run_id) as comm:  # fmt: skip

        def once() -> None:
            comm.all_gather(comm.reduce_scatter(tensor), tensor)

        return _timed(once, repeats)


def _sum_rates(rt: Runtime) -> dict[str, float]:
    """Each server's bytes summed per second of adds, from its counters (every job it served since it started)."""
    rates = {}
    for i, address in enumerate(rt.addresses):
        stats = rt.server_stats(i)
        if stats["sum_ns"]:
            rates[address] = stats["bytes_summed"] / (stats["sum_ns"] / 1e9)
    return rates
