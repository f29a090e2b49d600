"""A/B of DDP runs: settings, backends, hooks or whole checkouts alternated on one emulated cluster.

    python -m benchmarks.cluster.ddp_ab --rounds 3 now= off=BPS_FAILOVER=0 before=ROOT=/tmp/old-checkout
    python -m benchmarks.cluster.ddp_ab --rounds 3 --baseline gloo+fp16 gloo=BACKEND=gloo \
        gloo+fp16=BACKEND=gloo,HOOK=fp16 byteps= byteps-bf16=BPS_WIRE_DTYPE=bf16

Each variant is NAME=[VAR=VALUE,...]: environment variables for its ranks; ROOT=DIR runs them from another
checkout of this repository (its torch_bps, built, and its benchmarks), so two builds meet in one run;
BACKEND=gloo trains on gloo instead of "byteps"; HOOK=fp16 registers torch's fp16_compress_hook; VIEW=1 wraps the
model with DDP's gradient_as_bucket_view (no gradient allocated per step, none copied out of a bucket). With no gloo
variant, gloo runs once before and once after. On this shared machine one run differs from the next by about ±5%:
alternating variants within one cluster, and reading every run rather than one, is what makes a few percent
visible. Prints s/step, samples/s, the bytes each worker link carried per step (both ways, headers included), the
ranks' cores and minor page faults per step (all ranks), the machine's busy share; with --baseline, each variant's
samples/s over the baseline's, taken within each round.
May import: the standard library and benchmarks.cluster.{ddp,procs,topology}.
"""

from __future__ import annotations

import argparse
import contextlib
import dataclasses
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


def _run(cluster: Cluster, spec: DdpSpec, port: int, k: int, env: dict[str, str]) -> dict:
    """One DDP run of a variant: its backend, hook and buckets (BACKEND, HOOK, VIEW), the rest of `env` for its
    ranks."""
    env = dict(env)
    backend, hook, view = env.pop("BACKEND", "byteps"), env.pop("HOOK", ""), env.pop("VIEW", "") == "1"
    spec = dataclasses.replace(spec, hook=hook, bucket_view=view)
    with _variant(env):
        return run_ddp_byteps(cluster, spec, port, k) if backend == "byteps" else run_ddp(cluster, backend, spec, port)


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("variants", nargs="+", type=parse_variant,
                   help="NAME=[VAR=VALUE,...] (ROOT=DIR: a checkout; BACKEND=gloo; HOOK=fp16; VIEW=1)")  # fmt: skip
    p.add_argument("--rounds", type=int, default=3, help="runs per variant, alternated (default 3)")
    p.add_argument("-n", "--workers", type=int, default=4)
    p.add_argument("-k", "--servers", type=int, default=4, help="dedicated server hosts (default 4)")
    p.add_argument("--rate", type=float, default=500.0, help="link rate in Mbit/s (default 500)")
    p.add_argument("--tcp-congestion", default="reno", help="as benchmarks.cluster's (default reno; '': the machine's)")
    p.add_argument("--baseline", help="a variant's NAME: print every variant's samples/s over it, per round")
    args = p.parse_args(argv)
    names = [name for name, _ in args.variants]
    if args.baseline is not None and args.baseline not in names:
        p.error(f"--baseline {args.baseline!r} is not one of the variants {names}")
    spec = DdpSpec(timeout_s=300.0)
    runs: dict[str, list[dict]] = {name: [] for name in names}
    bookends = all(env.get("BACKEND", "byteps") == "byteps" for _, env in args.variants)
    with Cluster(args.workers, args.servers, args.rate, tcp_congestion=args.tcp_congestion) as cluster:
        port = 29700
        if bookends:
            print(f"gloo {run_ddp(cluster, 'gloo', spec, port)['seconds_per_step']:.3f} s/step", flush=True)
        for r in range(args.rounds):
            for name, env in args.variants:
                port += 1
                out = _run(cluster, spec, port, args.servers, env)
                runs[name].append(out)
                cores = sum(c["process_cores"] for c in out["cpu"].values())
                busy = max(c["machine_busy"] for c in out["cpu"].values())
                link = statistics.mean(d["tx"] + d["rx"] for d in out["link_bytes_per_step"].values())
                print(
                    f"{name} run {r}: {out['seconds_per_step']:.3f} s/step, {out['samples_per_s']:.1f} samples/s, "
                    f"{link / 1e6:.0f} MB/step per worker link, ranks {cores:.2f} cores, "
                    f"{out['minor_faults_per_step']:.0f} minor faults/step, machine {busy:.0%}",
                    flush=True,
                )
        if bookends:
            print(f"gloo {run_ddp(cluster, 'gloo', spec, port + 1)['seconds_per_step']:.3f} s/step", flush=True)
    for name, outs in runs.items():
        seconds = [o["seconds_per_step"] for o in outs]
        samples = statistics.median(o["samples_per_s"] for o in outs)
        line = f"{name}: median {statistics.median(seconds):.3f} s/step, {samples:.1f} samples/s"
        if args.baseline is not None:
            ratios = [o["samples_per_s"] / b["samples_per_s"] for o, b in zip(outs, runs[args.baseline], strict=True)]
            each = ", ".join(f"{x:.2f}" for x in ratios)
            line += f", {statistics.median(ratios):.2f}x {args.baseline} (rounds {each})"
        print(f"{line}; runs {', '.join(f'{s:.3f}' for s in seconds)} s/step")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
