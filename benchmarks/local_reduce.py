"""Benchmark the shared-memory local reduce-scatter + all-gather (torch_bps.local) against memcpy.

For each local size L, L real processes (multiprocessing spawn, one torch thread each) repeat one step
on an S-byte tensor, in two forms: "fresh", `all_gather(reduce_scatter(x), out)` (a new result tensor
and a separate output), and "in-place", `reduce_scatter(x, out=x[lo:hi]); all_gather(x[lo:hi], x)`
(the engine's pattern: no allocation, no copy of the own slice). Each iteration also times a
`dst.copy_(src)` of S bytes in the same rank, interleaved with the steps, so the memcpy figure is taken
under the very same conditions (the other ranks, whatever else the machine runs) and the ratio
"step / memcpy" is meaningful even on a busy machine. Figures per L are the slowest rank's medians.
CPU ms is the step's CPU time in the rank (wall minus waiting and preemption).

A tiny-tensor row per wait mode (futex, poll) measures the synchronisation and per-call overhead:
two rounds (barriers) per step and no data to speak of.

Usage: python benchmarks/local_reduce.py [--quick] [--sizes-mb 1,16,64] [--local-sizes 2,4] [--json out.json]
May import: torch, torch.distributed (a TCPStore) and torch_bps.local.
"""

from __future__ import annotations

import argparse
import json
import multiprocessing as mp
import os
import statistics
import sys
import time

import torch
import torch.distributed as dist

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from torch_bps.local import LocalComm  # noqa: E402

DTYPES = {"float32": torch.float32, "float16": torch.float16, "bfloat16": torch.bfloat16, "float64": torch.float64}


def _measure(lc: LocalComm, case: dict, local_size: int) -> dict:
    """Warm up, align with the peers, then alternate timed steps and timed memcpys of the same size."""
    dtype = DTYPES[case["dtype"]]
    numel = case["nbytes"] // torch.empty(0, dtype=dtype).element_size()
    x, out = torch.ones(numel, dtype=dtype), torch.empty(numel, dtype=dtype)
    src, dst = torch.ones(numel, dtype=dtype), torch.empty(numel, dtype=dtype)
    lo, hi = lc.slice_range(numel)

    def run_step():
        if case["in_place"]:  # the engine's pattern: no result allocation, no own-slice copy
            lc.reduce_scatter(x, out=x[lo:hi])
            lc.all_gather(x[lo:hi], x)
        else:  # the default: a fresh result, a separate output
            lc.all_gather(lc.reduce_scatter(x), out)

    for _ in range(case["warmup"]):
        run_step()
        dst.copy_(src)
    lc.all_gather(lc.reduce_scatter(torch.zeros(local_size)), torch.empty(local_size))  # align the ranks
    step, cpu, copy = [], [], []
    for _ in range(case["iters"]):
        x.fill_(1)
        wall, proc = time.perf_counter(), time.process_time()
        run_step()
        step.append(time.perf_counter() - wall)
        cpu.append(time.process_time() - proc)
        if case["memcpy"]:
            wall = time.perf_counter()
            dst.copy_(src)
            copy.append(time.perf_counter() - wall)
    result = x if case["in_place"] else out
    if result[0].item() != local_size or result[-1].item() != local_size:
        raise AssertionError(f"wrong sum {result[0].item()} (expected {local_size})")
    median = statistics.median
    return dict(step_s=median(step), cpu_s=median(cpu), memcpy_s=median(copy) if copy else None)


def _rank(local_rank: int, local_size: int, port: int, cases: list[dict], capacity: int, results) -> None:
    """One local rank: run every case in a LocalComm of its own and report the medians."""
    torch.set_num_threads(1)
    store = dist.TCPStore("127.0.0.1", port, is_master=False)
    try:
        for case in cases:
            with LocalComm(store, local_rank, local_size, f"bench{local_size}", timeout=120,
                           capacity_bytes=capacity, wait_mode=case["wait_mode"]) as lc:  # fmt: skip
                results.put((local_rank, case["name"], {**_measure(lc, case, local_size), "wait_mode": lc.wait_mode}))
    except BaseException as e:
        results.put((local_rank, "error", repr(e)))
        raise
    finally:
        store.set(f"done/{local_rank}", "1")


def run_local_size(local_size: int, cases: list[dict], capacity: int) -> dict[str, dict]:
    """Spawn local_size ranks running every case; return {case: the slowest rank's figures}."""
    ctx = mp.get_context("spawn")
    store = dist.TCPStore("127.0.0.1", 0, is_master=True, wait_for_workers=False)
    results = ctx.Queue()
    args = [(r, local_size, store.port, cases, capacity, results) for r in range(local_size)]
    procs = [ctx.Process(target=_rank, args=a) for a in args]
    for p in procs:
        p.start()
    got: dict[str, list[dict]] = {}
    while sum(len(v) for v in got.values()) < local_size * len(cases):
        rank, name, value = results.get(timeout=600)
        if name == "error":
            for p in procs:
                p.kill()
            raise RuntimeError(f"local rank {rank} of {local_size} failed: {value}")
        got.setdefault(name, []).append(value)
    for p in procs:
        p.join(60)
    return {name: max(vals, key=lambda v: v["step_s"]) for name, vals in got.items()}


def main(argv: list[str] | None = None) -> dict:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--sizes-mb", default="1,16,64", help="tensor sizes in MiB, comma separated")
    parser.add_argument("--local-sizes", default="2,4", help="local ranks per node, comma separated")
    parser.add_argument("--dtype", default="float32", choices=sorted(DTYPES))
    parser.add_argument("--capacity-mb", type=float, default=64.0, help="LocalComm capacity_bytes in MiB")
    parser.add_argument("--iters", type=int, default=20)
    parser.add_argument("--warmup", type=int, default=3)
    parser.add_argument("--latency-iters", type=int, default=2000, help="steps of the tiny-tensor rows")
    parser.add_argument("--quick", action="store_true", help="small sizes and few iterations (CI smoke run)")
    parser.add_argument("--json", metavar="PATH", help="write the results here as JSON")
    args = parser.parse_args(argv)
    if args.quick:
        args.sizes_mb, args.iters, args.warmup, args.latency_iters = "1,8", 8, 2, 300
    sizes = [int(float(s) * (1 << 20)) for s in args.sizes_mb.split(",")]
    local_sizes = [int(s) for s in args.local_sizes.split(",")]
    capacity = int(args.capacity_mb * (1 << 20))

    common = dict(dtype=args.dtype, wait_mode="auto", iters=args.iters, warmup=args.warmup, memcpy=True)
    cases = [dict(name=f"{n}-{p}", nbytes=n, in_place=p == "in-place", **common)
             for n in sizes for p in ("fresh", "in-place")]  # fmt: skip
    cases += [
        dict(name=f"tiny-{mode}", nbytes=64, dtype="float32", wait_mode=mode, iters=args.latency_iters, warmup=50,
             memcpy=False, in_place=False)
        for mode in ("futex", "poll")
    ]  # fmt: skip
    rows = []
    for L in local_sizes:
        measured = run_local_size(L, cases, capacity)
        for case in cases:
            m = measured[case["name"]]
            row = dict(local_size=L, bytes=case["nbytes"], dtype=case["dtype"], in_place=case["in_place"], **m)
            row["gbps"] = case["nbytes"] / m["step_s"] / 1e9
            if m["memcpy_s"]:
                row["memcpy_gbps"] = case["nbytes"] / m["memcpy_s"] / 1e9
                row["step_over_memcpy"] = m["step_s"] / m["memcpy_s"]
            rows.append(row)

    load = os.getloadavg()[0] if hasattr(os, "getloadavg") else float("nan")
    print(f"local reduce-scatter + all-gather: {os.cpu_count()} cores (load {load:.1f}), one torch thread per rank, "
          f"capacity {args.capacity_mb:g} MiB, {args.dtype}")  # fmt: skip
    print(f"{'L':>2} {'size':>7} {'result':>8} {'step ms':>8} {'cpu ms':>7} {'GB/s':>6} {'memcpy GB/s':>11} "
          f"{'step/memcpy':>11}")  # fmt: skip
    for r in rows:
        if "memcpy_gbps" in r:
            kind = "in-place" if r["in_place"] else "fresh"
            print(f"{r['local_size']:>2} {r['bytes'] / (1 << 20):>5.0f}MB {kind:>8} {r['step_s'] * 1e3:>8.2f} "
                  f"{r['cpu_s'] * 1e3:>7.2f} {r['gbps']:>6.2f} {r['memcpy_gbps']:>11.2f} "
                  f"{r['step_over_memcpy']:>10.1f}x")  # fmt: skip
    print("tiny tensor (16 floats): per-step overhead, two rounds per step")
    for r in rows:
        if "memcpy_gbps" not in r:
            print(f"{r['local_size']:>2} {r['wait_mode']:>6}: {r['step_s'] * 1e6:8.1f} us wall, "
                  f"{r['cpu_s'] * 1e6:7.1f} us cpu per step")  # fmt: skip
    report = dict(benchmark="local_reduce", cores=os.cpu_count(), load=load, capacity_bytes=capacity, rows=rows)
    if args.json:
        with open(args.json, "w") as f:
            json.dump(report, f, indent=2)
    return report


if __name__ == "__main__":
    main(sys.argv[1:])
