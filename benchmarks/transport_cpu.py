"""CPU per partition of the stream transport against ZeroMQ, worker and server, on loopback.

One `bps-server` process and one worker (this process, a `Client`) push_pull 40 keys of S bytes at once, round
after round, for `--seconds` per measurement, over ZeroMQ (`stream=False`) and over a stream (`stream=True`)
alternated in each repeat. The figures are CPU microseconds per partition (one PUSH + one PULL) of the worker
process (every thread) and of the server process, and the goodput; ratios stream / ZeroMQ are taken within a
repeat, then their median.

    python benchmarks/transport_cpu.py --sizes-kib 64,256,1024 --repeats 3 --json docs/results/transport_cpu.json
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

from benchmarks.cluster.cpu import process_cpu_seconds  # noqa: E402
from tests.helpers import ServerProcess  # noqa: E402
from torch_bps.client import Client  # noqa: E402

KEYS = 40


def _own_cpu() -> float:
    r = resource.getrusage(resource.RUSAGE_SELF)
    return r.ru_utime + r.ru_stime


def measure(server: ServerProcess, job_id: int, size: int, stream: bool, seconds: float) -> dict:
    """Push_pull KEYS keys of `size` bytes for `seconds`; return CPU us per partition and MB/s."""
    with Client([server.address], job_id, 0, 1, timeout=30, stream=stream) as client:
        if stream and not client.stream_ready(0):
            raise SystemExit("the stream did not open: is the server offering one?")
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
    p.add_argument("--json", metavar="PATH")
    args = p.parse_args(argv)
    torch.set_num_threads(1)
    server = ServerProcess()
    results: dict = {}
    job = 1
    try:
        for kib in (int(s) for s in args.sizes_kib.split(",")):
            runs = []
            for _ in range(args.repeats):
                pair = {}
                for stream in (False, True):
                    pair["stream" if stream else "zmq"] = measure(server, job, kib << 10, stream, args.seconds)
                    job += 1
                runs.append(pair)
            med = {
                f"{t}_{m}": statistics.median(r[t][m] for r in runs)
                for t in ("zmq", "stream")
                for m in ("worker_us", "server_us", "mb_s")
            }
            for m in ("worker_us", "server_us", "mb_s"):
                med[f"ratio_{m}"] = statistics.median(r["stream"][m] / r["zmq"][m] for r in runs)
            results[kib] = {"median": med, "runs": runs}
            cells = [
                f"{name} {med['zmq_' + m]:6.0f} -> {med['stream_' + m]:6.0f} ({med['ratio_' + m]:.2f})"
                for name, m in (("worker us/partition", "worker_us"), ("server", "server_us"), ("MB/s", "mb_s"))
            ]
            print(f"{kib:5d} KiB, zmq -> stream: " + "  ".join(cells), flush=True)
    finally:
        server.stop()
    if args.json:
        with open(args.json, "w") as f:
            json.dump(
                {"keys": KEYS, "seconds": args.seconds, "load_before": os.getloadavg(), "sizes": results}, f, indent=2
            )
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
