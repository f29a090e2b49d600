"""A model of torch_bps's push/pull step time past what one machine can emulate (docs/benchmarks.md, "Scaling
past what one machine can emulate").

    python -m benchmarks.cluster.scaling_model --plot results/scaling.png --json results/scaling_model.json

Step time = max(network, busiest server's CPU, a worker's CPU) + pipeline fill and drain, where
- network: the paper's t_opt = 2n(n-1)M / ((n^2 + kn - 2k) B), over the goodput TCP reaches (0.95 B);
- a server's CPU: per message (PUSH or PULL) `SERVER_US_PER_MESSAGE` plus per byte pushed into it the
  add + copy floor, `SERVER_NS_PER_BYTE` (benchmarks/server_cpu.py on loopback);
- a worker's CPU per partition, `WORKER_US_PER_PARTITION`, interpolated between the sizes measured
  (benchmarks/engine_cpu.py on loopback);
- fill and drain: a partition's sum exists only once all n workers pushed it, and a worker's uplink is shared by
  the partitions of all servers it feeds, so the first sum takes about n p / B and so does the last pull:
  2 n p / B, with p the engine's partition size (torch_bps.engine.partition: at least 128 KiB, 64 per server).
On the emulated cluster every process shares 2 cores, so there the CPU term is everyone's CPU over 2 cores.
May import: the standard library, benchmarks.cluster.theory, torch_bps.config and torch_bps.engine.partition (the
engine's partition sizes); matplotlib for --plot.
"""

from __future__ import annotations

import argparse
import bisect
import json
import os

from benchmarks.cluster import theory
from torch_bps.config import DEFAULT_MIN_PARTITION_BYTES as MIN_PARTITION
from torch_bps.engine.partition import PARTS_PER_SERVER

GOODPUT = 0.95  # TCP over tbf at MTU 1500 (the calibration stream: 0.93-0.96)
# The costs the model charges, from these commands with the stream transport (medians of 3 repeats):
# `python benchmarks/server_cpu.py --sizes 65536,131072,262144,1048576 --mib 64`: the add + copy floor 0.50-0.65 ns
# per byte pushed, and 3-30 us per message (PUSH or PULL) beyond it;
SERVER_NS_PER_BYTE = 0.57
SERVER_US_PER_MESSAGE = 15.0
# `python benchmarks/engine_cpu.py --partitions 65536,131072,262144,1048576`: the worker's CPU (engine, client,
# kernel) per partition of a size, in us. Not linear in the size (a 256 KiB partition costs nearly what 1 MiB
# does), hence interpolated, not fitted.
WORKER_US_PER_PARTITION = {64 << 10: 58.0, 128 << 10: 92.0, 256 << 10: 150.0, 1 << 20: 161.0}
MAX_PARTITION = 4_096_000  # the backend's default BPS_PARTITION_BYTES


def partition_bytes(n: int, k: int, size: float) -> float:
    """The engine's partition size, as torch_bps.engine.partition cuts it: the smallest server share cut into
    PARTS_PER_SERVER, within [MIN_PARTITION, MAX_PARTITION]."""
    x = theory.dedicated_fraction(n, k)
    shares = ([x / k] if k else []) + ([(1 - x) / n] if x < 1 else [])
    smallest = size * min(shares)
    return max(MIN_PARTITION, min(MAX_PARTITION, smallest / PARTS_PER_SERVER))


def worker_us_per_partition(p: float) -> float:
    """A worker's CPU per partition of p bytes: WORKER_US_PER_PARTITION interpolated (beyond the sizes
    measured, the nearest pair's slope).

    Example: `worker_us_per_partition(192 << 10)` -> 121.0.
    """
    sizes = sorted(WORKER_US_PER_PARTITION)
    i = min(max(bisect.bisect_left(sizes, p), 1), len(sizes) - 1)  # the measured pair around p, else the nearest
    lo, hi = sizes[i - 1], sizes[i]
    ulo, uhi = WORKER_US_PER_PARTITION[lo], WORKER_US_PER_PARTITION[hi]
    return ulo + (uhi - ulo) * (p - lo) / (hi - lo)


def step(n: int, k: int, size: float, rate_bps: float, cores: float | None = None) -> dict:
    """Model one step of n workers and k servers summing `size` bytes over links of `rate_bps`.

    `cores`: if given, all processes share that many cores (the emulated cluster); else every host has its own.
    """
    k_eff = min(k, n)
    net = theory.t_opt_s(n, k, size, rate_bps) / GOODPUT
    p = partition_bytes(n, k, size)
    # The busiest server: at k >= n each dedicated one gets size / k from every worker; at k < n the split
    # puts x of the bytes on the k dedicated servers and the rest on the n colocated ones.
    x = theory.dedicated_fraction(n, k)
    per_server = max(x * size / k_eff if k_eff else 0.0, (1 - x) * size / n if x < 1 else 0.0)
    server_cpu = n * per_server * SERVER_NS_PER_BYTE * 1e-9 + 2 * n * (per_server / p) * SERVER_US_PER_MESSAGE * 1e-6
    worker_cpu = (size / p) * worker_us_per_partition(p) * 1e-6
    if k < n:
        worker_cpu += server_cpu  # a worker host also runs a colocated server
    if cores is None:
        cpu = max(server_cpu, worker_cpu)
    else:
        servers = k + (n if k < n else 0)
        total = n * (size / p) * worker_us_per_partition(p) * 1e-6 + servers * server_cpu
        cpu = total / cores
    fill = 2 * n * p * 8 / (rate_bps * GOODPUT)
    total_s = max(net, cpu) + fill
    return {"n": n, "k": k, "size": size, "rate_bps": rate_bps, "partition": p, "network_s": net,
            "server_cpu_s": server_cpu, "worker_cpu_s": worker_cpu, "cpu_s": cpu, "fill_drain_s": fill,
            "step_s": total_s, "t_opt_s": theory.t_opt_s(n, k, size, rate_bps),
            "all_reduce_s": theory.allreduce_bound_s(n, size, rate_bps) / GOODPUT,
            "bound": "cpu" if cpu > net else "network"}  # fmt: skip


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--size-mb", type=float, default=256.0, help="MiB summed per step (default 256)")
    p.add_argument("--json", metavar="PATH")
    p.add_argument("--plot", metavar="PATH")
    args = p.parse_args(argv)
    size = args.size_mb * 2**20
    rows = [step(n, n, size, gbit * 1e9) for gbit in (25, 100) for n in (16, 32, 64, 128, 256)]
    print("Gbit/s    n  part KiB  network s  server CPU s  worker CPU s  fill+drain s  step s  / t_opt  AR/step  bound")
    for r in rows:
        print(
            f"{r['rate_bps'] / 1e9:6.0f} {r['n']:4d} {r['partition'] / 1024:9.0f} {r['network_s']:10.3f} "
            f"{r['server_cpu_s']:13.3f} {r['worker_cpu_s']:13.3f} {r['fill_drain_s']:13.3f} {r['step_s']:7.3f} "
            f"{r['step_s'] / r['t_opt_s']:8.2f} {r['all_reduce_s'] / r['step_s']:8.2f}  {r['bound']}"
        )
    if args.json:
        os.makedirs(os.path.dirname(args.json) or ".", exist_ok=True)
        with open(args.json, "w") as f:
            json.dump({"size_bytes": size, "rows": rows}, f, indent=1)
    if args.plot:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt

        fig, ax = plt.subplots(figsize=(7, 4))
        for gbit, style in ((25, "-"), (100, "--")):
            sel = [r for r in rows if r["rate_bps"] == gbit * 1e9]
            ns = [r["n"] for r in sel]
            ax.plot(ns, [r["step_s"] / r["t_opt_s"] for r in sel], "o" + style, label=f"model, {gbit} Gbit/s, k = n")
            ax.plot(ns, [(r["network_s"] + r["fill_drain_s"]) / r["t_opt_s"] for r in sel], "s" + style,
                    label=f"if the CPU kept up (network + fill/drain), {gbit}")  # fmt: skip
            ax.plot(ns, [r["all_reduce_s"] / r["t_opt_s"] for r in sel], "x" + style, label=f"ring all-reduce, {gbit}")
        ax.set_xscale("log", base=2)
        ax.set_yscale("log")
        ax.set_xlabel("worker machines n (k = n CPU servers)")
        ax.set_ylabel("step time / t_opt")
        ax.set_title(f"torch_bps push/pull of {args.size_mb:.0f} MiB: model")
        ax.legend(fontsize=8, loc="center right")
        fig.tight_layout()
        os.makedirs(os.path.dirname(args.plot) or ".", exist_ok=True)
        fig.savefig(args.plot, dpi=110)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
