"""Crossing the barrier on the emulated cluster: seconds per step of gloo DDP, DDP on "byteps", torch_bps.byteps's
DistributedOptimizer, and its CrossBarrier with priorities on and off, each against the overlap bound
max(compute, communication).

    python -m benchmarks.cluster.barrier --json results/barrier.json    # root; n = 4, k = 4 and 0, a conv net
    python -m benchmarks.cluster.barrier --rates 500 --ks 4 --steps 3   # a short one

Compute is the same model trained with no communication on every worker at once (`--wrap alone`: the 2 cores are
shared as in the other runs); communication is the paper's t_opt for the gradient bytes at the links' goodput
(0.957 x the rate). `--rates auto` is the rate where the two are equal at the largest k. Every point runs in fresh
processes (benchmarks/cluster/workers/ddp_train.py, `--model convnet`); dedicated servers on the first k server
hosts, the backend's embedded servers on the workers where k < n. "cores busy" is the machine's share of busy
cores over the timed steps: near 100%, the step is bound by the cores every emulated host shares.
May import: the standard library, torch_bps.engine.placement, benchmarks.cluster and
benchmarks.cluster.{ddp,topology}.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import sys

from benchmarks.cluster import BackendUnavailable
from benchmarks.cluster.ddp import DdpSpec, run_ddp, run_ddp_byteps
from benchmarks.cluster.topology import Cluster
from torch_bps.engine.placement import t_opt

GOODPUT = 0.957  # of the link rate, at MTU 1500 (benchmarks/cluster/README.md)
WAYS = ("ddp", "distopt", "crossbarrier", "crossbarrier-nopri")


def gradient_bytes(hidden: int) -> int:
    """fp32 bytes of the conv net's gradients (workers/ddp_train.py build_convnet)."""
    convs = (3 * 32 * 9 + 32) + (32 * 64 * 9 + 64) + (64 * 128 * 9 + 128)
    linears = (128 * 16 * hidden + hidden) + (hidden * hidden + hidden) + (hidden * 10 + 10)
    return 4 * (convs + linears)


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("-n", type=int, default=4, help="worker hosts")
    p.add_argument("--ks", default="4,0", help="dedicated server hosts, comma-separated")
    p.add_argument("--rates", default="auto,500", help="link rates in Mbit/s; auto: communication = compute")
    p.add_argument("--hidden", type=int, default=1024, help="the Linear layers' width")
    p.add_argument("--batch", type=int, default=16)
    p.add_argument("--steps", type=int, default=5)
    p.add_argument("--warmup", type=int, default=5)
    p.add_argument("--json", metavar="PATH")
    args = p.parse_args(argv)
    ks = [int(k) for k in args.ks.split(",")]
    spec = DdpSpec(hidden=args.hidden, batch=args.batch, steps=args.steps, warmup=args.warmup)
    nbytes = gradient_bytes(args.hidden)
    port = iter(range(29700, 29800))
    out: dict = {"n": args.n, "gradient_bytes": nbytes, "points": []}
    try:
        with Cluster(args.n, max(ks), rate_mbit=500.0) as cluster:

            def train(backend: str, wrap: str, k: int = 0) -> tuple[float, float]:
                """Seconds per step, and the share of the machine's cores busy over the timed steps."""
                s = _spec(spec, wrap)
                result = run_ddp(cluster, backend, s, next(port)) if backend == "gloo" else (
                    run_ddp_byteps(cluster, s, next(port), k))  # fmt: skip
                busy = max(c["machine_busy"] for c in result["cpu"].values())  # one machine: every rank sees it
                return result["seconds_per_step"], busy

            compute, out["compute_busy"] = train("gloo", "alone")
            out["compute_s"] = compute
            print(f"compute alone: {compute:.3f} s/step, {nbytes / 1e6:.1f} MB of gradients", flush=True)
            for rate_arg in args.rates.split(","):
                rate = (8 * t_opt(args.n, max(ks), nbytes, 1.0) / (GOODPUT * 1e6 * compute) if rate_arg == "auto"
                        else float(rate_arg))  # fmt: skip
                for host in cluster.hosts:
                    cluster.set_rate(host, rate)
                gloo, gloo_busy = train("gloo", "ddp")
                for k in ks:
                    comm = t_opt(args.n, k, nbytes, GOODPUT * rate * 1e6 / 8)
                    bound = max(compute, comm)
                    point = {"rate_mbit": rate, "k": k, "compute_s": compute, "communication_s": comm,
                             "bound_s": bound, "gloo-ddp": gloo, "busy": {"gloo-ddp": gloo_busy}}  # fmt: skip
                    for way in WAYS:
                        point[way], point["busy"][way] = train("byteps", way, k)
                    out["points"].append(point)
                    _print(point)
    except BackendUnavailable as e:
        print(f"SKIPPED: {e}")
        return 0
    if args.json:
        with open(args.json, "w") as f:
            json.dump(out, f, indent=1)
    return 0


def _spec(spec: DdpSpec, wrap: str) -> DdpSpec:
    return dataclasses.replace(spec, wrap=wrap, model="convnet")


def _print(point: dict) -> None:
    print(f"\n{point['rate_mbit']:.0f} Mbit/s, k = {point['k']}: compute {point['compute_s']:.3f} s, communication "
          f"{point['communication_s']:.3f} s, bound {point['bound_s']:.3f} s/step")  # fmt: skip
    print(f"{'':22} {'s/step':>8} {'/ bound':>8} {'DDP byteps /':>13} {'cores busy':>11}")
    for way in ("gloo-ddp", *WAYS):
        s = point[way]
        print(f"{way:22} {s:8.3f} {s / point['bound_s']:8.2f} {point['ddp'] / s:13.2f} {point['busy'][way]:11.0%}")
    print(
        f"priorities' share of CrossBarrier's gain over DDP on byteps: "
        f"{_share(point['ddp'], point['crossbarrier-nopri'], point['crossbarrier']):.0%}",
        flush=True,
    )


def _share(ddp: float, without: float, with_: float) -> float:
    """Of the time CrossBarrier saves against DDP, the part priorities save (1: all of it)."""
    gain = ddp - with_
    return (without - with_) / gain if gain > 0 else 0.0


if __name__ == "__main__":
    sys.exit(main())
