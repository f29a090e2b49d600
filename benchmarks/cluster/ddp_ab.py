"""A/B of the byteps DDP run: settings or whole checkouts alternated on one emulated cluster, gloo before and after.

    python -m benchmarks.cluster.ddp_ab --rounds 3 now= off=BPS_FAILOVER=0 before=ROOT=/tmp/old-checkout

Each variant is NAME=[VAR=VALUE,...]: environment variables for its ranks; ROOT=DIR runs them from another
checkout of this repository (its torch_bps, built, and its benchmarks), so two builds meet in one run. On this
shared machine one run differs from the next by about ±5%: alternating variants within one cluster, and
reading every run rather than one, is what makes a few percent visible. Prints s/step, the ranks' cores and
minor page faults per step (all ranks), the machine's busy share.
May import: the standard library and benchmarks.cluster.{ddp,procs,topology}.
"""

from __future__ import annotations

import argparse
import contextlib
import os
import statistics

from benchmarks.cluster import procs
from benchmarks.cluster.ddp import DdpSpec, run_ddp, run_ddp_byteps
from benchmarks.cluster.topology import Cluster


@contextlib.contextmanager
def _variant(env: dict[str, str]):
    """Set a variant's environment (inherited by the ranks) and checkout root; restore both after."""
    env = dict(env)
    root = env.pop("ROOT", procs.REPO_ROOT)
    saved = {k: os.environ.get(k) for k in env}
    saved_root, procs.REPO_ROOT = procs.REPO_ROOT, os.path.abspath(root)  # the ranks' cwd and PYTHONPATH
    os.environ.update(env)
    try:
        yield
    finally:
        procs.REPO_ROOT = saved_root
        for k, v in saved.items():
            if v is None:
                os.environ.pop(k, None)
            else:
                os.environ[k] = v


def parse_variant(text: str) -> tuple[str, dict[str, str]]:
    name, _, assignments = text.partition("=")
    env = dict(a.split("=", 1) for a in assignments.split(",") if a)
    if not name or any(not k for k in env):
        raise argparse.ArgumentTypeError(f"{text!r}: expected NAME=[VAR=VALUE,...]")
    return name, env


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("variants", nargs="+", type=parse_variant, help="NAME=[VAR=VALUE,...] (ROOT=DIR: a checkout)")
    p.add_argument("--rounds", type=int, default=3, help="runs per variant, alternated (default 3)")
    p.add_argument("-n", "--workers", type=int, default=4)
    p.add_argument("-k", "--servers", type=int, default=4, help="dedicated server hosts (default 4)")
    p.add_argument("--rate", type=float, default=500.0, help="link rate in Mbit/s (default 500)")
    p.add_argument("--tcp-congestion", default="reno", help="as benchmarks.cluster's (default reno; '': the machine's)")
    args = p.parse_args(argv)
    spec = DdpSpec(timeout_s=300.0)
    runs: dict[str, list[float]] = {name: [] for name, _ in args.variants}
    with Cluster(args.workers, args.servers, args.rate, tcp_congestion=args.tcp_congestion) as cluster:
        port = 29700
        print(f"gloo {run_ddp(cluster, 'gloo', spec, port)['seconds_per_step']:.3f} s/step", flush=True)
        for r in range(args.rounds):
            for name, env in args.variants:
                port += 1
                with _variant(env):
                    out = run_ddp_byteps(cluster, spec, port, args.servers)
                runs[name].append(out["seconds_per_step"])
                cores = sum(c["process_cores"] for c in out["cpu"].values())
                busy = max(c["machine_busy"] for c in out["cpu"].values())
                print(
                    f"{name} run {r}: {out['seconds_per_step']:.3f} s/step, ranks {cores:.2f} cores, "
                    f"{out['minor_faults_per_step']:.0f} minor faults/step, machine {busy:.0%}",
                    flush=True,
                )
        print(f"gloo {run_ddp(cluster, 'gloo', spec, port + 1)['seconds_per_step']:.3f} s/step", flush=True)
    for name, seconds in runs.items():
        print(f"{name}: median {statistics.median(seconds):.3f} s/step, runs {', '.join(f'{s:.3f}' for s in seconds)}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
