"""Time to a target test accuracy with and without gradient compression, on the emulated cluster.

    python -m benchmarks.cluster.compress --rates 100,500 --json results/compress.json   # root; n = 4, k = 4

Runs, alternated on one cluster per link rate, DDP training straggler_train's student MLP (a teacher's labels, a
held-out set of 2,000; benchmarks/cluster/workers/compress_train.py) in each mode: gloo fp32, gloo with torch's
fp16 hook and PowerSGD hook, and "byteps" fp32, bf16 on the wire, onebit and top-k (bps_hook, error feedback on
both sides) and torch's PowerSGD hook on "byteps". For each, as median [min-max] over `--rounds`
(benchmarks.metrics): seconds to `--target` held-out accuracy (rank 0's model scored after every step,
interpolated, evaluation outside the clock) and its speed-up over gloo fp32's within each round, steps per second
(the slowest rank's), final accuracy, bytes per step on a worker's link (both ways, headers included),
whether every replica ended bit-identical. Dedicated servers on the k server hosts, BPS_FAILOVER=0.
May import: the standard library and benchmarks.{metrics,cluster.byteps,cluster.procs,cluster.topology}.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys

from benchmarks import metrics
from benchmarks.cluster import byteps, procs
from benchmarks.cluster.topology import IFNAME, Cluster

WORKER = "benchmarks.cluster.workers.compress_train"
MODES = {  # name: extra environment of the workers
    "gloo": {},
    "gloo-fp16": {},
    "gloo-powersgd": {},
    "byteps": {},
    "byteps-bf16": {"BPS_WIRE_DTYPE": "bf16"},
    "byteps-onebit": {"BPS_COMPRESSOR": "onebit"},
    "byteps-topk": {"BPS_COMPRESSOR": "topk:0.01"},
    "byteps-powersgd": {},
}


def run_mode(cluster: Cluster, addresses: list[str], args, mode: str, port: int) -> dict:
    n = len(cluster.workers)
    ranks = [
        cluster.spawn(
            f"compress {mode} rank {r}", h,
            [sys.executable, "-m", WORKER, "--rank", str(r), "--world", str(n), "--store",
             f"{cluster.workers[0].ip}:{port}", "--mode", mode, "--steps", str(args.steps), "--batch", str(args.batch)],
            {"GLOO_SOCKET_IFNAME": IFNAME, "OMP_NUM_THREADS": "1", "BPS_SERVERS": ",".join(addresses),
             "BPS_PLACEMENT": "dedicated", "BPS_FAILOVER": "0", "BPS_HOST": h.ip, "LOCAL_RANK": "0",
             "LOCAL_WORLD_SIZE": "1", "GROUP_RANK": str(r), "GROUP_WORLD_SIZE": str(n), **MODES[mode]},
        )
        for r, h in enumerate(cluster.workers)
    ]  # fmt: skip
    drops, losses = sum(cluster.link_drops().values()), cluster.tcp_losses()
    try:
        results = procs.wait_all(ranks, args.run_timeout, f"compress {mode}")
    except Exception as e:  # noqa: BLE001 - a mode that fails is reported, the others still run
        return {"error": str(e)[-2000:]}
    after = cluster.tcp_losses()
    curve = results[0]["curve"]
    return {
        "steps_per_s": args.steps / max(r["seconds"] for r in results),
        "seconds_to_target": metrics.time_to_target(curve, args.target),
        "final_accuracy": curve[-1][2] if curve else None,
        "link_bytes_per_step": statistics.mean(r["link_bytes_per_step"] for r in results),
        "identical": len({r["params"] for r in results}) == 1,
        "link_drops": sum(cluster.link_drops().values()) - drops,  # packets the shaped links' queues dropped
        "tcp_timeouts": sum(v - losses[k] for k, v in after.items() if k.endswith(" timeouts")),
        "curve": curve,
    }


def report(rate: float, runs: dict[str, list[dict]], target: float) -> None:
    ok = {m: [o for o in outs if "error" not in o] for m, outs in runs.items()}
    base = runs.get("gloo")
    print(f"\n{rate:g} Mbit/s, target held-out accuracy {target}: median [min-max] of {len(base or [])} rounds; "
          f"speed-ups over gloo fp32's time to target, within each round")  # fmt: skip
    for mode, outs in ok.items():
        if not outs:
            print(f"{mode:16s} FAILED: {runs[mode][-1]['error'][-300:]}")
            continue
        times = [o.get("seconds_to_target") for o in runs[mode]]  # a failed run pairs as never
        line = f"{mode:16s} target in {metrics.Spread.of([o['seconds_to_target'] for o in outs]).format(1)} s"
        if base and mode != "gloo":
            speedups = metrics.paired_ratios([o.get("seconds_to_target") for o in base], times)
            line += f" ({metrics.Spread.of(speedups).format() if speedups else 'never'}x gloo fp32's speed)"
        print(f"{line}, {metrics.Spread.of([o['steps_per_s'] for o in outs]).format()} steps/s, final accuracy "
              f"{metrics.Spread.of([o['final_accuracy'] for o in outs]).format(3)}, "
              f"{statistics.median(o['link_bytes_per_step'] for o in outs) / 1e6:6.2f} MB/step on a worker link, "
              f"replicas {'identical' if all(o['identical'] for o in outs) else 'DIFFER'}")  # fmt: skip


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("-n", "--workers", type=int, default=4)
    p.add_argument("-k", "--servers", type=int, default=4)
    p.add_argument("--rates", default="100,500", help="link rates in Mbit/s, one cluster each (default 100,500)")
    p.add_argument("--steps", type=int, default=200)
    p.add_argument("--batch", type=int, default=256, help="samples per machine per step (default 256)")
    p.add_argument("--target", type=float, default=0.75, help="held-out accuracy to reach (default 0.75)")
    p.add_argument("--rounds", type=int, default=1, help="runs per mode, alternated (default 1)")
    p.add_argument("--modes", default=",".join(MODES), help=f"of {', '.join(MODES)}")
    p.add_argument("--queue-ms", type=float, default=20.0, help="every link's queue, in ms at the rate (default 20)")
    p.add_argument("--host-queue-ms", type=float, help="the hosts' own egress queues apart (default: --queue-ms)")
    p.add_argument("--run-timeout", type=float, default=900.0)
    p.add_argument("--json", default="", help="write every run here")
    args = p.parse_args(argv)
    if os.geteuid() != 0:
        print("SKIPPED: the emulated cluster needs root")
        return 0
    modes = args.modes.split(",")
    every: dict[str, dict] = {}
    for rate in (float(r) for r in args.rates.split(",")):
        runs: dict[str, list[dict]] = {m: [] for m in modes}
        with Cluster(
            args.workers, args.servers, rate, queue_ms=args.queue_ms, host_queue_ms=args.host_queue_ms
        ) as cluster:
            server_procs, addresses = byteps.start_servers(cluster, cluster.servers[: args.servers], 9500)
            try:
                port = 29800
                for r in range(args.rounds):
                    for mode in modes:
                        port += 1
                        out = run_mode(cluster, addresses, args, mode, port)
                        runs[mode].append(out)
                        print(f"{rate:g} Mbit/s {mode} run {r}: " + (f"FAILED {out['error'][-300:]}" if "error" in out
                              else f"target at {out['seconds_to_target']} s, {out['steps_per_s']:.2f} steps/s, final "
                              f"accuracy {out['final_accuracy']:.3f}, {out['link_bytes_per_step'] / 1e6:.2f} MB/step, "
                              f"{out['link_drops']} packets dropped, {out['tcp_timeouts']} TCP timeouts"),
                              flush=True)  # fmt: skip
            finally:
                for proc in server_procs:
                    proc.kill()
        report(rate, runs, args.target)
        every[f"{rate:g}"] = runs
        if args.json:
            with open(args.json, "w") as f:
                json.dump({"args": vars(args), "runs": every}, f, indent=1)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
