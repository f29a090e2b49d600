"""Training with a straggler on the emulated cluster: synchronous rounds against backup workers, bounded staleness
and asynchronous training.

    python -m benchmarks.cluster.straggler --json results/straggler.json    # root; n = 4, k = 4, 500 Mbit/s

Runs, alternated on one cluster (`--rounds` times each), a student MLP learning a teacher's labels
(benchmarks/cluster/workers/straggler_train.py) in these modes, each with and without one straggler machine:
synchronous (torch_bps.BackupWorkers, b = 0; without a straggler, the yardstick), backup workers (b = 1), and
torch_bps.AsyncTraining with staleness s = 0 (lockstep), 2 and unbounded (async), these two also with
`overlap=True` ("-overlap": a step returns while its round travels), SGD's momentum `--async-momentum` there
(asynchrony adds momentum of its own: Mitliagkas et al. 2016, "Asynchrony begets momentum").
The straggler is `--slow-factor` times slower in compute, or with `--straggler link` its link runs at `--link-share`
of the rate (both ways) while the others keep theirs; with `--straggler rotating` the slow compute moves from machine
to machine every step (each is slow one step in n: the transient slowness a staleness bound absorbs). For each:
samples per second (each rank's computed samples over its own wall time, summed) and its ratio to the yardstick,
the time to `--target` held-out accuracy (rank 0's model) and its ratio, the accuracy once every rank did its
steps, how many rounds the ranks caught up on without computing, and whether every replica ended bit-identical.
Dedicated servers on the k server hosts, BPS_FAILOVER=0.
May import: the standard library and benchmarks.cluster.{byteps,procs,topology}.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys

from benchmarks.cluster import byteps, procs
from benchmarks.cluster.topology import IFNAME, Cluster

WORKER = "benchmarks.cluster.workers.straggler_train"
MODES = {  # name: (backups, staleness: "" for BackupWorkers, straggler, AsyncTraining's overlap)
    "sync": (0, "", False, False),
    "sync+straggler": (0, "", True, False),
    "backup": (1, "", False, False),
    "backup+straggler": (1, "", True, False),
    "stale0": (0, "0", False, False),
    "stale0+straggler": (0, "0", True, False),
    "stale2": (0, "2", False, False),
    "stale2+straggler": (0, "2", True, False),
    "stale2-overlap": (0, "2", False, True),
    "stale2-overlap+straggler": (0, "2", True, True),
    "async": (0, "inf", False, False),
    "async+straggler": (0, "inf", True, False),
    "async-overlap": (0, "inf", False, True),
    "async-overlap+straggler": (0, "inf", True, True),
}


def run_mode(cluster: Cluster, addresses: list[str], args, backups: int, staleness: str, straggler: bool,
             overlap: bool, port: int) -> dict:  # fmt: skip
    n = len(cluster.workers)
    slow = n - 1 if straggler else -1
    by_link = straggler and args.straggler == "link"
    flags = ["--rotate"] if straggler and args.straggler == "rotating" else []
    flags += ["--overlap"] if overlap else []
    cluster.set_rate(cluster.workers[-1], args.rate * args.link_share if by_link else None)
    factor = 1.0 if args.straggler == "link" else args.slow_factor
    ranks = [
        cluster.spawn(
            f"straggler rank {r}", h,
            [sys.executable, "-m", WORKER, "--rank", str(r), "--world", str(n), "--store",
             f"{cluster.workers[0].ip}:{port}", "--backups", str(backups), "--staleness", staleness,
             "--slow-rank", str(slow),
             "--slow-factor", str(factor), "--steps", str(args.steps), "--batch", str(args.batch),
             "--momentum", str(args.async_momentum if staleness else 0.9), *flags],
            {"GLOO_SOCKET_IFNAME": IFNAME, "OMP_NUM_THREADS": "1", "BPS_SERVERS": ",".join(addresses),
             "BPS_PLACEMENT": "dedicated", "BPS_FAILOVER": "0", "BPS_HOST": h.ip, "LOCAL_RANK": "0",
             "LOCAL_WORLD_SIZE": "1", "GROUP_RANK": str(r), "GROUP_WORLD_SIZE": str(n)},
        )
        for r, h in enumerate(cluster.workers)
    ]  # fmt: skip
    results = procs.wait_all(ranks, 600.0, f"straggler backups={backups}")
    curve = results[0]["curve"]
    reached = next((t for t, _, acc in curve if acc >= args.target), None)
    return {
        "samples_per_s": sum(r["computed"] * args.batch / r["seconds"] for r in results),
        "seconds_to_target": reached,
        "final_accuracy": results[0]["final"],
        "caught_up": sum(r["caught_up"] for r in results),
        "identical": len({r["params"] for r in results}) == 1,
        "curve": curve,
    }


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("-n", "--workers", type=int, default=4)
    p.add_argument("-k", "--servers", type=int, default=4)
    p.add_argument("--rate", type=float, default=500.0, help="link rate in Mbit/s (default 500)")
    p.add_argument("--steps", type=int, default=150)
    p.add_argument("--batch", type=int, default=256, help="samples per machine per round (default 256)")
    p.add_argument("--straggler", choices=["compute", "link", "rotating"], default="compute",
                   help="what is slow (default compute)")  # fmt: skip
    p.add_argument("--slow-factor", type=float, default=3.0, help="the straggler's compute time, times (default 3)")
    p.add_argument("--link-share", type=float, default=0.25, help="the straggler's link rate, share (default 0.25)")
    p.add_argument("--target", type=float, default=0.75, help="held-out accuracy to reach (default 0.75)")
    p.add_argument("--async-momentum", type=float, default=0.9, help="SGD's momentum under AsyncTraining (default 0.9)")
    p.add_argument("--rounds", type=int, default=1, help="runs per mode, alternated (default 1)")
    p.add_argument("--modes", default=",".join(MODES), help=f"of {', '.join(MODES)}")
    p.add_argument("--json", default="", help="write every run here")
    args = p.parse_args(argv)
    if os.geteuid() != 0:
        print("SKIPPED: the emulated cluster needs root")
        return 0
    modes = args.modes.split(",")
    runs: dict[str, list[dict]] = {m: [] for m in modes}
    with Cluster(args.workers, args.servers, args.rate) as cluster:
        server_procs, addresses = byteps.start_servers(cluster, cluster.servers[: args.servers], 9500)
        try:
            port = 29800
            for r in range(args.rounds):
                for mode in modes:
                    port += 1
                    out = run_mode(cluster, addresses, args, *MODES[mode], port)
                    runs[mode].append(out)
                    print(f"{mode} run {r}: {out['samples_per_s']:.0f} samples/s, target at {out['seconds_to_target']} "
                          f"s, final accuracy {out['final_accuracy']:.3f}, caught up {out['caught_up']}, "
                          f"replicas {'identical' if out['identical'] else 'DIFFER'}", flush=True)  # fmt: skip
        finally:
            for proc in server_procs:
                proc.kill()
    base = runs.get("sync")
    base_rate = statistics.median(o["samples_per_s"] for o in base) if base else None
    base_time = statistics.median(o["seconds_to_target"] or float("inf") for o in base) if base else None
    slow = {
        "compute": f"{args.slow_factor:g}x slower in compute",
        "link": f"its link at {args.link_share:g} of the rate",
        "rotating": f"{args.slow_factor:g}x slower in compute, a different machine every step",
    }[args.straggler]
    print(f"\nn = {args.workers}, k = {args.servers}, {args.rate:g} Mbit/s, straggler {slow}, target accuracy "
          f"{args.target}")  # fmt: skip
    for mode, outs in runs.items():
        rate = statistics.median(o["samples_per_s"] for o in outs)
        time_ = statistics.median(o["seconds_to_target"] or float("inf") for o in outs)
        ratios = f" ({rate / base_rate:.2f}x sync's samples/s, {time_ / base_time:.2f}x its time)" if base else ""
        print(f"{mode:18s} {rate:6.0f} samples/s, target in {time_:6.1f} s{ratios}, final accuracy "
              f"{statistics.median(o['final_accuracy'] for o in outs):.3f}")  # fmt: skip
    if args.json:
        with open(args.json, "w") as f:
            json.dump({"args": vars(args), "runs": runs}, f, indent=1)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
