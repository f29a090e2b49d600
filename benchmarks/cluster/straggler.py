"""Training with a straggler on the emulated cluster: synchronous rounds against backup workers, bounded staleness
and asynchronous training.

    python -m benchmarks.cluster.straggler --json results/straggler.json    # root; n = 4, k = 4, 500 Mbit/s

Runs, alternated on one cluster (`--rounds` times each), a student MLP learning a teacher's labels
(benchmarks/cluster/workers/straggler_train.py) in these modes, each with and without one straggler machine:
synchronous (torch_bps.BackupWorkers, b = 0; without a straggler, the yardstick), backup workers (b = 1), and
torch_bps.AsyncTraining with staleness s = 0 (lockstep), 2 and unbounded (async), these two also with
`overlap=True` ("-overlap": a step returns while its round travels); SGD's momentum `--momentum` in every mode.
The straggler is `--slow-factor` times slower in compute, or with `--straggler link` its link runs at `--link-share`
of the rate (both ways) while the others keep theirs; with `--straggler rotating` the slow compute moves from machine
to machine every step (each is slow one step in n: the transient slowness a staleness bound absorbs). For each:
samples per second that entered a sum (benchmarks.metrics: the ranks' computed samples times the share of pushes
the servers summed, over the slowest rank's wall time) and the computed ones, the time to `--target` held-out
accuracy (rank 0's model, scored after every step, interpolated), each as median [min-max] over `--rounds` with
its ratio to the yardstick taken within each round, the accuracy once every rank did its steps, how many rounds
the ranks caught up on without computing, and whether every replica ended bit-identical.
Dedicated servers on the k server hosts, BPS_FAILOVER=0.
May import: the standard library and benchmarks.{metrics,cluster.byteps,cluster.procs,cluster.topology}.
"""

from __future__ import annotations

import argparse
import json
import os
import sys

from benchmarks import metrics
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


METRICS_PORT = 9600


def run_mode(cluster: Cluster, addresses: list[str], args, backups: int, staleness: str, straggler: bool,
             overlap: bool, port: int) -> dict:  # fmt: skip
    n = len(cluster.workers)
    slow = n - 1 if straggler else -1
    by_link = straggler and args.straggler == "link"
    flags = ["--rotate"] if straggler and args.straggler == "rotating" else []
    flags += ["--overlap"] if overlap else []
    cluster.set_rate(cluster.workers[-1], args.rate * args.link_share if by_link else None)
    factor = 1.0 if args.straggler == "link" else args.slow_factor
    metrics_at = [f"{a.rpartition(':')[0]}:{METRICS_PORT}" for a in addresses]
    ranks = [
        cluster.spawn(
            f"straggler rank {r}", h,
            [sys.executable, "-m", WORKER, "--rank", str(r), "--world", str(n), "--store",
             f"{cluster.workers[0].ip}:{port}", "--backups", str(backups), "--staleness", staleness,
             "--slow-rank", str(slow),
             "--slow-factor", str(factor), "--steps", str(args.steps), "--batch", str(args.batch),
             "--momentum", str(args.momentum), "--metrics", ",".join(metrics_at), *flags],
            {"GLOO_SOCKET_IFNAME": IFNAME, "OMP_NUM_THREADS": "1", "BPS_SERVERS": ",".join(addresses),
             "BPS_PLACEMENT": "dedicated", "BPS_FAILOVER": "0", "BPS_HOST": h.ip, "LOCAL_RANK": "0",
             "LOCAL_WORLD_SIZE": "1", "GROUP_RANK": str(r), "GROUP_WORLD_SIZE": str(n)},
        )
        for r, h in enumerate(cluster.workers)
    ]  # fmt: skip
    results = procs.wait_all(ranks, 600.0, f"straggler backups={backups}")
    counters = results[0]["counters"]
    computed = sum(r["computed"] for r in results) * args.batch
    contributed = computed * metrics.contributed_share(counters["before"], counters["after"])
    seconds = [r["seconds"] for r in results]
    return {
        "samples_per_s": metrics.job_rate(contributed, seconds),  # samples whose gradients entered a sum
        "computed_per_s": metrics.job_rate(computed, seconds),
        "seconds_to_target": metrics.time_to_target(results[0]["curve"], args.target),
        "final_accuracy": results[0]["final"],
        "caught_up": sum(r["caught_up"] for r in results),
        "identical": len({r["params"] for r in results}) == 1,
        "curve": results[0]["curve"],
    }


def report(runs: dict[str, list[dict]]) -> str:
    """One line a mode: contributed samples/s and time to target, each with its ratio to synchronous training
    with no straggler (paired within each round), and the final accuracy."""
    base = runs.get("sync")
    lines = []
    for mode, outs in runs.items():
        rates = [o["samples_per_s"] for o in outs]
        times = [o["seconds_to_target"] for o in outs]
        line = (f"{mode:24s} {metrics.Spread.of(rates).format(0)} samples/s, target in "
                f"{metrics.Spread.of(times).format(1)} s")  # fmt: skip
        if base and mode != "sync":
            rate_ratio = metrics.paired_ratios(rates, [o["samples_per_s"] for o in base])
            time_ratio = metrics.paired_ratios(times, [o["seconds_to_target"] for o in base])
            line += (f" ({metrics.Spread.of(rate_ratio).format()}x sync's samples/s, "
                     f"{metrics.Spread.of(time_ratio).format() if time_ratio else 'never'}x its time)")  # fmt: skip
        lines.append(line + f", final accuracy {metrics.Spread.of([o['final_accuracy'] for o in outs]).format(3)}")
    return "\n".join(lines)


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
    p.add_argument("--momentum", type=float, default=0.9, help="SGD's momentum, every mode alike (default 0.9)")
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
        server_procs, addresses = byteps.start_servers(
            cluster, cluster.servers[: args.servers], 9500, metrics_port=METRICS_PORT
        )
        try:
            port = 29800
            for r in range(args.rounds):
                for mode in modes:
                    port += 1
                    out = run_mode(cluster, addresses, args, *MODES[mode], port)
                    runs[mode].append(out)
                    print(f"{mode} run {r}: {out['samples_per_s']:.0f} samples/s ({out['computed_per_s']:.0f} "
                          f"computed), target at {out['seconds_to_target']} s, final accuracy "
                          f"{out['final_accuracy']:.3f}, caught up {out['caught_up']}, "
                          f"replicas {'identical' if out['identical'] else 'DIFFER'}", flush=True)  # fmt: skip
        finally:
            for proc in server_procs:
                proc.kill()
    slow = {
        "compute": f"{args.slow_factor:g}x slower in compute",
        "link": f"its link at {args.link_share:g} of the rate",
        "rotating": f"{args.slow_factor:g}x slower in compute, a different machine every step",
    }[args.straggler]
    print(
        f"\nn = {args.workers}, k = {args.servers} dedicated servers, {args.rate:g} Mbit/s, straggler {slow}, "
        f"target accuracy {args.target}, {args.rounds} rounds: median [min-max]; ratios to sync's, within a round"
    )
    print(report(runs))
    if args.json:
        with open(args.json, "w") as f:
            json.dump({"args": vars(args), "runs": runs}, f, indent=1)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
