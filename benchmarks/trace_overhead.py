"""What the timeline costs: the engine's push/pull on loopback with tracing off, BPS_TRACE on, torch.profiler on.

Per partition size P, one worker (a job of one) runs `PushPullEngine.run` of a tensor of --size-bytes cut into
partitions of P against a `bps-server` on loopback for --seconds, in one of three modes:
- off: nothing recorded;
- trace: what BPS_TRACE does: a torch_bps.timeline Recorder wraps every collective (the window covers the whole
  measurement), the client's IO thread records every partition's steps, and the server runs with --trace DIR;
  the worker's file is written after the timed loop (its time is reported apart, as write_s);
- profiler: the loop inside torch.profiler.profile (CPU activities), whose spans torch_bps opens per collective.
Each measurement is a child process of its own with its own server; the modes alternate within each repeat and
the ratios mode / off are taken within a repeat (the machine is shared and noisy).

Reported: goodput (bytes summed per second of wall time), the worker's CPU per partition (all its threads) and
the server process's CPU per partition.

Usage: python benchmarks/trace_overhead.py [--partitions 65536,1048576] [--repeats 3] [--json out.json]
May import: the standard library, torch, torch_bps and benchmarks.cluster.cpu.
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import statistics
import subprocess
import sys
import tempfile
import time

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, REPO)

from benchmarks._harness import Server  # noqa: E402
from benchmarks.cluster.cpu import process_cpu_seconds  # noqa: E402

KB, MB = 1 << 10, 1 << 20
MODES = ("off", "trace", "profiler")
FIELDS = ("goodput_gbps", "worker_cpu_us_per_part", "server_cpu_us_per_part")


def child(mode: str, partition: int, size: int, seconds: float) -> dict:
    """Measure one mode at one partition size; runs in its own process."""
    import contextlib

    import torch

    from torch_bps.client import Client
    from torch_bps.engine.partition import KeyBook
    from torch_bps.engine.pipeline import PushPullEngine
    from torch_bps.engine.placement import Placement, server_weights
    from torch_bps.futures import completer
    from torch_bps.timeline.recorder import Recorder

    torch.set_num_threads(1)
    directory = tempfile.mkdtemp(prefix="bps-trace-overhead-")
    server = Server("--auth", "off", *(["--trace", directory] if mode == "trace" else []))
    try:
        address = server.address
        with Client([address], 1, 0, 1, timeout=60, auth=False) as client:
            keys = KeyBook(Placement(server_weights([address], [])), partition, lambda n: [(0, n)])
            engine = PushPullEngine(client, keys)
            t = torch.ones(size // 4)
            parts = len(keys.plan(t.numel(), t.dtype)[0])
            for _ in range(3):  # warm-up: INIT of every key, first allocations
                engine.push_pull(t).wait()
            recorder = Recorder.create(f"{directory},0:{1 << 40}" if mode == "trace" else "", client, 0, "default")
            profiling = (torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CPU])
                         if mode == "profiler" else contextlib.nullcontext())  # fmt: skip
            with profiling:
                steps, cpu0, wall0 = 0, time.process_time(), time.perf_counter()
                server0 = process_cpu_seconds(server.pid)
                while steps < 3 or time.perf_counter() - wall0 < seconds:
                    future = torch.futures.Future()
                    engine.run([t], recorder.wrap([t], completer(future, t)))
                    future.wait()
                    steps += 1
                cpu, wall = time.process_time() - cpu0, time.perf_counter() - wall0
                server_cpu = process_cpu_seconds(server.pid) - server0
            write0 = time.perf_counter()
            recorder.close()
            write_s = time.perf_counter() - write0
            engine.close()
    finally:
        server.stop()
        files = os.listdir(directory)
        shutil.rmtree(directory, ignore_errors=True)
    if mode == "trace":
        assert sorted(f.split("-")[0] for f in files) == ["server", "worker"], files
    n = steps * parts
    return dict(goodput_gbps=steps * size / wall / 1e9, worker_cpu_us_per_part=cpu / n * 1e6,
                server_cpu_us_per_part=server_cpu / n * 1e6, parts=n, write_s=write_s)  # fmt: skip


def run_child(mode: str, partition: int, args) -> dict:
    cmd = [sys.executable, os.path.abspath(__file__), "--child", mode, "--partition", str(partition),
           "--size-bytes", str(args.size_bytes), "--seconds", str(args.seconds)]  # fmt: skip
    out = subprocess.run(cmd, capture_output=True, text=True, timeout=300, cwd=REPO)
    if out.returncode != 0:
        raise RuntimeError(f"mode {mode} at {partition} bytes failed:\n{out.stderr[-3000:]}")
    return json.loads(out.stdout.strip().splitlines()[-1])


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--partitions", default=f"{64 * KB},{1 * MB}", help="partition sizes in bytes")
    p.add_argument("--size-bytes", type=int, default=16 * MB, help="the tensor of one collective")
    p.add_argument("--seconds", type=float, default=3.0, help="per measurement")
    p.add_argument("--repeats", type=int, default=3)
    p.add_argument("--json", default="")
    p.add_argument("--child", default="", help=argparse.SUPPRESS)
    p.add_argument("--partition", type=int, default=0, help=argparse.SUPPRESS)
    args = p.parse_args(argv)
    if args.child:
        print(json.dumps(child(args.child, args.partition, args.size_bytes, args.seconds)))
        return 0
    rows = []
    for partition in (int(x) for x in args.partitions.split(",")):
        runs = []
        for _ in range(args.repeats):  # alternating, so drifting load hits every mode alike
            runs.append({mode: run_child(mode, partition, args) for mode in MODES})
        row = dict(partition=partition, size=args.size_bytes, runs=runs)
        for mode in MODES[1:]:
            for field in FIELDS:
                ratios = [r[mode][field] / r["off"][field] for r in runs]
                row[f"{field}_{mode}_vs_off"] = dict(median=statistics.median(ratios), min=min(ratios), max=max(ratios))
        rows.append(row)
        med = {m: {f: statistics.median(r[m][f] for r in runs) for f in runs[0][m]} for m in MODES}
        off = med["off"]
        print(f"P={partition >> 10} KiB: off {off['goodput_gbps']:.2f} GB/s, CPU per partition: worker "
              f"{off['worker_cpu_us_per_part']:.0f} us, server {off['server_cpu_us_per_part']:.0f} us")  # fmt: skip
        for mode in MODES[1:]:
            r = {
                f: row[f"{f}_{mode}_vs_off"]
                for f in ("goodput_gbps", "worker_cpu_us_per_part", "server_cpu_us_per_part")
            }
            print(f"  {mode:8s} goodput x{r['goodput_gbps']['median']:.2f} ({r['goodput_gbps']['min']:.2f}-"
                  f"{r['goodput_gbps']['max']:.2f}), worker CPU x{r['worker_cpu_us_per_part']['median']:.2f} "
                  f"({r['worker_cpu_us_per_part']['min']:.2f}-{r['worker_cpu_us_per_part']['max']:.2f}), server CPU "
                  f"x{r['server_cpu_us_per_part']['median']:.2f} ({r['server_cpu_us_per_part']['min']:.2f}-"
                  f"{r['server_cpu_us_per_part']['max']:.2f})"
                  + (f"; then writing the file {med['trace']['write_s']:.2f} s" if mode == "trace" else ""),
                  flush=True)  # fmt: skip
    if args.json:
        meta = dict(when=time.strftime("%Y-%m-%d %H:%M UTC", time.gmtime()),
                    command=" ".join(["python benchmarks/trace_overhead.py"] + (argv or sys.argv[1:])))  # fmt: skip
        with open(args.json, "w") as f:
            json.dump(dict(meta=meta, rows=rows), f, indent=1)
    return 0


if __name__ == "__main__":
    sys.exit(main())
