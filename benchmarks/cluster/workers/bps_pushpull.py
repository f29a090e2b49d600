"""One worker of the torch_bps push/pull measurement: S bytes of fp32 summed through the servers per step.

    python -m benchmarks.cluster.workers.bps_pushpull --worker 0 --num-workers 4 --k 2 \
        --servers 10.77.0.101:9000,10.77.0.102:9000,10.77.0.1:9000,... --size-bytes 67108864

`--servers` lists the k dedicated servers, then the n colocated ones (worker host i's own server); a
server that gets no bytes may be given as `-`. Which bytes go where (`--placement`):
- `exact` (default): the paper's x / 1-x split to the byte (benchmarks/cluster/theory.py, a stand-in
  until the library's placement is the reference);
- `library`: partitions of `--partition-bytes` placed by torch_bps.engine.placement, as the library does.
- `engine` (the default): the library's whole worker pipeline, torch_bps.engine's PushPullEngine (its
  partitioning, placement, credit scheduler), exactly what the "byteps" backend runs per collective.
Uses `torch_bps.client.Client(servers, job_id, worker, num_workers).push_pull(tensor, key, server=i)`.
The first step checks the sum (every worker pushes worker + 1). `--trace DIR` records the timed steps into
DIR/worker-WORKER.json (torch_bps.timeline). `--pairs R --gloo-store ip:port` then runs gloo all_reduce of the
same bytes in this process too, in R pairs of blocks of `--steps` steps alternated with push/pull's (`paired`).
May import: the standard library, torch, torch_bps.client, torch_bps.engine.placement, torch_bps.timeline and
benchmarks.cluster.{cpu,placement,workers}.
"""

from __future__ import annotations

import argparse
import contextlib
import os

from benchmarks.cluster import theory
from benchmarks.cluster.cpu import CpuWindow
from benchmarks.cluster.workers.common import emit, fail, settle, store, timed_steps
from torch_bps.engine.placement import Placement, receive_buffers, server_weights


def exact_partitions(numel: int, n: int, k: int, servers: list[str], partition_bytes: int) -> tuple[list[str], list]:
    """Return (server addresses, [(server index, key, start, length)]) under the exact split."""
    parts = theory.split(numel, 4, n, k, partition_bytes)
    used = sorted({p.server for p in parts})
    if any(servers[s] == "-" for s in used):
        fail(f"the split sends bytes to servers {used}, but some were not started: {servers}")
    index = {s: i for i, s in enumerate(used)}
    return [servers[s] for s in used], [(index[p.server], p.key, p.start, p.length) for p in parts]


def library_servers(servers: list[str], k: int) -> list:
    """The servers of `--servers` (k dedicated, then one per worker or "-") as the library weights them."""
    return server_weights([s for s in servers[k:] if s != "-"], servers[:k])


def library_partitions(numel: int, n: int, k: int, servers: list[str], partition_bytes: int) -> tuple[list[str], list]:
    """Return (server addresses, [(server index, key, start, length)]) as torch_bps's placement puts them."""
    weighted = library_servers(servers, k)
    where = Placement(weighted)
    per_partition = max(1, partition_bytes // 4)
    parts = []
    for key, start in enumerate(range(0, numel, per_partition)):
        length = min(per_partition, numel - start)
        parts.append((where.assign(key, length * 4), key, start, length))
    return [s.address for s in weighted], parts


def library_engine(client, n: int, k: int, servers: list[str], partition_bytes: int, config):
    """The library's pipeline over `client` (which holds the credit), whose servers are in library_partitions'
    order, cut as `config` says (BPS_MIN_PARTITION_BYTES, BPS_MIDDLE_PARTITION_FACTOR)."""
    from torch_bps.engine.partition import KeyBook
    from torch_bps.engine.pipeline import PushPullEngine

    keys = KeyBook(
        Placement(library_servers(servers, k)),
        partition_bytes,
        lambda numel: [(0, numel)],
        min_partition_bytes=config.partition_floor(),
        middle_factor=config.middle_partition_factor,
    )
    return PushPullEngine(client, keys)


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__)
    p.add_argument("--worker", type=int, required=True)
    p.add_argument("--num-workers", type=int, required=True)
    p.add_argument("--k", type=int, required=True, help="number of dedicated servers")
    p.add_argument("--servers", required=True, help="comma-separated ip:port: k dedicated, then n colocated")
    p.add_argument("--size-bytes", type=int, required=True)
    p.add_argument("--steps", type=int, default=5)
    p.add_argument("--warmup", type=int, default=5, help="untimed steps, the sum's check included")
    p.add_argument("--placement", choices=["engine", "exact", "library"], default="engine")
    p.add_argument("--equal-receive-buffers", action="store_true",
                   help="every server's receive buffer BPS_SOCKET_BUFFER_BYTES, not sized by its share")  # fmt: skip
    p.add_argument("--credit-bytes", type=int, default=0, help="0: the library's (BPS_CREDIT_BYTES, else sized)")
    p.add_argument("--job-id", type=int, default=1)
    p.add_argument("--partition-bytes", type=int, default=4_096_000)
    p.add_argument("--timeout", type=float, default=300.0)
    p.add_argument("--trace", metavar="DIR", default="", help="record the timed steps into DIR/worker-WORKER.json")
    p.add_argument("--watch", default="", metavar="NAME=PID,...",
                   help="other processes (the servers) whose CPU to measure over the timed steps too")  # fmt: skip
    p.add_argument("--pairs", type=int, default=0, help="then R pairs of gloo / push/pull blocks (`paired`)")
    p.add_argument("--gloo-store", default="", help="ip:port of the gloo TCPStore, hosted by worker 0 (--pairs)")
    args = p.parse_args(argv)
    watch = {name: int(pid) for name, _, pid in (w.rpartition("=") for w in args.watch.split(",") if w)}

    import torch

    from torch_bps.client import Client
    from torch_bps.config import Config
    from torch_bps.timeline.recorder import recording

    torch.set_num_threads(1)
    n, k = args.num_workers, args.k
    servers = args.servers.split(",")
    if len(servers) != k + n:
        fail(f"worker {args.worker}: --servers has {len(servers)} entries, want k + n = {k + n}")
    tensor = torch.full((args.size_bytes // 4,), float(args.worker + 1), dtype=torch.float32)
    split = exact_partitions if args.placement == "exact" else library_partitions
    addresses, parts = split(tensor.numel(), n, k, servers, args.partition_bytes)  # engine: same servers as library
    slices = [(server, key, tensor[start : start + length]) for server, key, start, length in parts]

    engine = None
    # BPS_SERVER_CREDIT_BYTES, BPS_SOCKET_BUFFER_BYTES, BPS_MIN_PARTITION_BYTES, BPS_MIDDLE_PARTITION_FACTOR
    config = Config.resolve()
    credit = args.credit_bytes or config.credit(dedicated=k > 0)
    receive = ()  # each server's receive buffer by its share, in library_partitions' order (the library's)
    if args.placement != "exact" and not args.equal_receive_buffers:
        receive = receive_buffers(config.socket_buffer_bytes, library_servers(servers, k))
    auto_credit = not args.credit_bytes and config.auto_credit
    with Client(addresses, args.job_id, args.worker, n, timeout=args.timeout, connect_timeout=args.timeout,
                credit_bytes=credit, auto_credit=auto_credit, server_credit_bytes=config.server_credit_bytes,
                socket_buffer_bytes=config.socket_buffer_bytes, receive_buffer_bytes=receive) as client:  # fmt: skip
        if args.placement == "engine":
            engine = library_engine(client, n, k, servers, args.partition_bytes, config)

        def step() -> None:
            if engine is not None:
                engine.push_pull(tensor).wait()
                return
            # Sums land in place; every partition's future is waited before the next round starts.
            futures = [client.push_pull(t, key, server=server) for server, key, t in slices]
            for f in futures:
                f.wait()

        step()
        want = n * (n + 1) / 2  # worker i pushed i + 1 everywhere
        if not bool((tensor == want).all()):
            fail(f"worker {args.worker}: push_pull summed wrong: want {want}, got e.g. {tensor[0].item()}")
        for _ in range(args.warmup - 2):
            step()
        settle()
        if args.warmup > 1:  # a step ends for every worker at once: the timed steps start together
            step()
        path = os.path.join(args.trace, f"worker-{args.worker}.json")
        with recording(client, path, f"worker {args.worker}") if args.trace else contextlib.nullcontext():
            cpu = CpuWindow(watch).start()
            wakeups = client.scheduler_stats()["io_wakeups"]
            steps = timed_steps(step, args.steps)
            wakeups = client.scheduler_stats()["io_wakeups"] - wakeups
            cpu = cpu.stop()
        result = {"worker": args.worker, "seconds_per_step": sum(steps) / args.steps, "cpu": cpu}
        result["io_wakeups_per_step"] = wakeups / args.steps  # the client's IO thread's
        result["steps"] = [round(s, 4) for s in steps]
        result.update(partitions=len(parts), sent=client.bytes_sent(), received=client.bytes_received(),
                      scheduler=client.scheduler_stats(),
                      streams=[client.stream_ready(i) for i in range(len(addresses))],
                      local_streams=[client.stream_local(i) for i in range(len(addresses))],
                      shared_bytes=client.stream_shared_bytes(), stream_bytes=client.stream_bytes())  # fmt: skip
        if args.pairs:
            result["pairs"] = paired(args, step, lambda: tensor.fill_(args.worker + 1), watch)
    emit(result)
    return 0


def paired(args, bps_step, bps_reset, watch: dict[str, int]) -> list[dict]:
    """Alternate blocks of `args.steps` gloo all_reduce steps and push/pull steps, each measured like the timed
    steps, in `args.pairs` pairs (gloo first in even pairs, push/pull first in odd ones), and return the blocks.
    `bps_reset` refills push/pull's tensor before each of its blocks (its sums grow n-fold per step).

    Why: this machine's speed drifts within a minute (other tenants), so CPU measured a minute apart compares the
    machine with itself. Blocks seconds apart in the same processes compare the two runners.
    """
    from datetime import timedelta

    import torch
    import torch.distributed as dist

    rendezvous = store(args.gloo_store, args.worker, args.num_workers, args.timeout)
    dist.init_process_group("gloo", store=rendezvous, rank=args.worker, world_size=args.num_workers,
                            timeout=timedelta(seconds=args.timeout))  # fmt: skip
    tensor = torch.ones(args.size_bytes // 4, dtype=torch.float32)
    runners = {"gloo": lambda: dist.all_reduce(tensor), "byteps": bps_step}
    resets = {"gloo": lambda: tensor.fill_(1.0), "byteps": bps_reset}
    for _ in range(args.warmup):
        runners["gloo"]()
    settle()
    blocks = []
    for r in range(args.pairs):
        for name in ("gloo", "byteps") if r % 2 == 0 else ("byteps", "gloo"):
            resets[name]()
            dist.barrier()  # the block starts on every worker together, after the last block's end everywhere
            cpu = CpuWindow(watch).start()
            steps = timed_steps(runners[name], args.steps)
            blocks.append({"pair": r, "runner": name, "seconds_per_step": sum(steps) / args.steps, "cpu": cpu.stop()})
    dist.destroy_process_group()
    return blocks


if __name__ == "__main__":
    raise SystemExit(main())
