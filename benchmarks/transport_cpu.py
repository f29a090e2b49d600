"""CPU per partition of the transports, worker and server, on loopback.

One `bps-server` process and one worker (this process, a `Client`) push_pull 40 keys of S bytes at once, round
after round, for `--seconds` per measurement, over each transport of `--transports` alternated in each repeat:
`zmq` (ZeroMQ only), `tcp` (the TCP stream), `unix` (the server's local stream, a unix socket) and `stream` (the
default: the local stream, big frames through shared memory). The figures are CPU microseconds per partition (one
PUSH + one PULL) of the worker process (every thread) and of the server process, and the goodput; ratios against
the first transport are taken within a repeat, then their median.

    python benchmarks/transport_cpu.py --sizes-kib 64,256,1024 --repeats 3 --json results/transport_cpu.json
"""

from __future__ import annotations

import argparse
import json
import os
import resource
import statistics
import sys
import time

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

import torch  # noqa: E402

from benchmarks._harness import Server  # noqa: E402
from benchmarks.cluster.cpu import process_cpu_seconds  # noqa: E402
from torch_bps.client import Client  # noqa: E402
from torch_bps.config import TRANSPORTS, transport_options  # noqa: E402

KEYS = 40


def _own_cpu() -> float:
    r = resource.getrusage(resource.RUSAGE_SELF)
    return r.ru_utime + r.ru_stime


def measure(server: Server, job_id: int, size: int, transport: str, seconds: float) -> dict:
    """Push_pull KEYS keys of `size` bytes for `seconds`; return CPU us per partition and MB/s."""
    how = transport_options(transport)
    with Client([server.address], job_id, 0, 1, timeout=30, **how) as client:
        got = (client.stream_ready(0), client.stream_local(0), client.stream_shared(0))
        want = (how["stream"], how["stream"] and how["local_stream"], how["local_stream"] and how["shared_memory"])
        if got != want:
            raise SystemExit(f"{transport}: stream ready, local, shared are {got}, not {want}")
        tensors = [torch.ones(size // 4) for _ in range(KEYS)]
        for key, t in enumerate(tensors):  # INIT every key first
            client.push_pull(t, key).wait()
        parts, start, own0, srv0 = 0, time.perf_counter(), _own_cpu(), process_cpu_seconds(server.proc.pid)
        while time.perf_counter() - start < seconds:
            futures = [client.push_pull(t, key) for key, t in enumerate(tensors)]
            for f in futures:
                f.wait()
            parts += KEYS
        wall = time.perf_counter() - start
        worker, srv = _own_cpu() - own0, process_cpu_seconds(server.proc.pid) - srv0
    return {"worker_us": worker / parts * 1e6, "server_us": srv / parts * 1e6, "mb_s": parts * size / wall / 1e6}


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--sizes-kib", default="64,256,1024")
    p.add_argument("--repeats", type=int, default=3)
    p.add_argument("--seconds", type=float, default=3.0)
    p.add_argument("--transports", default="zmq,tcp,unix,stream", help=f"some of {', '.join(TRANSPORTS)}")
    p.add_argument("--json", metavar="PATH")
    args = p.parse_args(argv)
    transports = args.transports.split(",")
    if not transports or any(t not in TRANSPORTS for t in transports):
        p.error(f"--transports {args.transports!r}: use some of {', '.join(TRANSPORTS)}")
    base = transports[0]
    metrics = ("worker_us", "server_us", "mb_s")
    torch.set_num_threads(1)
    server = Server()
    results: dict = {}
    job = 1
    try:
        for kib in (int(s) for s in args.sizes_kib.split(",")):
            runs = []
            for _ in range(args.repeats):
                run = {}
                for t in transports:
                    run[t] = measure(server, job, kib << 10, t, args.seconds)
                    job += 1
                runs.append(run)
            med = {f"{t}_{m}": statistics.median(r[t][m] for r in runs) for t in transports for m in metrics}
            for t in transports[1:]:
                for m in metrics:
                    med[f"ratio_{t}_{m}"] = statistics.median(r[t][m] / r[base][m] for r in runs)
            results[kib] = {"median": med, "runs": runs}
            for t in transports:
                r = {m: "" if t == base else f" ({med[f'ratio_{t}_{m}']:.2f})" for m in metrics}
                print(f"{kib:5d} KiB {t:>6}: worker {med[t + '_worker_us']:6.0f} us/partition{r['worker_us']}"
                      f"  server {med[t + '_server_us']:6.0f}{r['server_us']}"
                      f"  {med[t + '_mb_s']:6.0f} MB/s{r['mb_s']}", flush=True)  # fmt: skip
    finally:
        server.stop()
    if args.json:
        os.makedirs(os.path.dirname(args.json) or ".", exist_ok=True)
        with open(args.json, "w") as f:
            run = {"keys": KEYS, "seconds": args.seconds, "transports": transports, "load_before": os.getloadavg()}
            json.dump({**run, "sizes": results}, f, indent=2)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
