"""`python -m benchmarks.cluster`: the emulated-cluster benchmark (root only; skips with a message otherwise).

    python -m benchmarks.cluster --quick --json out.json --plot out.png    # n=2, k in {0,2}, < 3 min
    python -m benchmarks.cluster                                            # n=4, k=0..4, 64 MiB, 500 Mbit/s
    python -m benchmarks.cluster --ks 0,4 --fsdp                            # + FSDP2 on gloo and byteps per k
    python -m benchmarks.cluster --cleanup-leftovers                        # remove namespaces of crashed runs

May import: the standard library and benchmarks.cluster.{byteps,ddp,netns,report,sweep,tcp_matrix}.
"""

from __future__ import annotations

import argparse
import dataclasses
import functools
import os
import sys

from benchmarks.cluster import netns, report
from benchmarks.cluster.byteps import WARMUP, run_torch_bps
from benchmarks.cluster.ddp import DdpSpec
from benchmarks.cluster.sweep import Plan, run
from benchmarks.cluster.tcp_matrix import run_tcp_matrix

QUICK = {"n": 2, "size_mb": 16.0, "steps": 3, "warmup": 1, "repeats": 1, "calibration_s": 2.0, "ddp_layers": 3}


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    p = argparse.ArgumentParser(
        prog="python -m benchmarks.cluster",
        description="Workers and summation servers as network namespaces behind tc-shaped links: gloo "
        "all_reduce and torch_bps push/pull per number of server hosts k, next to the BytePS theory.",
    )
    p.add_argument("--quick", action="store_true", help="n=2, 16 MiB, k in {0, n}, fewer steps (< 3 minutes)")
    p.add_argument("-n", "--workers", type=int, help="worker hosts (default 4; --quick 2)")
    p.add_argument("--ks", help="comma-separated k values to sweep (default 0..n; --quick 0,n)")
    p.add_argument("--size-mb", type=float, help="MiB summed per step (default 64; --quick 16)")
    p.add_argument("--rate", type=float, default=500.0, help="link rate B in Mbit/s, each direction (default 500)")
    p.add_argument(
        "--tcp-congestion",
        default="reno",
        help="every host's TCP congestion control (default reno; '' keeps the machine's: bbr here)",
    )
    p.add_argument("--steps", type=int, help="timed steps per measurement (default 5; --quick 3)")
    p.add_argument(
        "--warmup",
        type=int,
        help="untimed steps first (default 5: every torch_bps key slot has had its first round; --quick 1)",
    )
    p.add_argument(
        "--repeats", type=int, help="runs per gloo, byteps and DDP point, the median is reported (default 3; --quick 1)"
    )
    p.add_argument(
        "--placement",
        choices=["engine", "exact", "library"],
        default="engine",
        help="byteps side: the library's engine (partitioning, placement, credit scheduler; default), or a "
        "hand-made split: exact x / 1-x to the byte, or the library's placement of plain partitions",
    )
    p.add_argument("--partition-bytes", type=int, default=4_096_000, help="byteps partition size (default 4096000)")
    p.add_argument(
        "--runner",
        choices=["torch_bps", "tcp-rounds", "tcp-free"],
        default="torch_bps",
        help="what runs the byteps points: torch_bps push/pull (default), or plain TCP moving the same bytes over "
        "the same connections, to show what the transport alone allows (benchmarks/cluster/tcp_matrix.py): "
        "tcp-rounds releases each partition's replies once every worker pushed it, tcp-free has no dependency",
    )
    p.add_argument(
        "--tcp-pace",
        type=float,
        default=0.0,
        metavar="F",
        help="plain TCP runners: cap every connection at its bytes per step / (F x t_opt), the rates t_opt needs "
        "(default 0: not paced)",
    )
    p.add_argument(
        "--tcp-lead",
        type=int,
        default=0,
        metavar="BYTES",
        help="tcp-rounds: a server reads no worker's pushes more than BYTES ahead of the slowest worker's (default 0: "
        "no limit)",
    )
    p.add_argument(
        "--tcp-partition-bytes",
        type=int,
        default=128 << 10,
        metavar="BYTES",
        help="plain TCP runners: the partition whose replies a round releases (default 131072, the library's floor)",
    )
    p.add_argument(
        "--tcp-buffers-by-share",
        action="store_true",
        help="plain TCP runners: each connection's socket buffers in proportion to its server's share of the bytes",
    )
    p.add_argument(
        "--equal-receive-buffers",
        action="store_true",
        help="torch_bps: every worker connection's receive buffer the socket buffer, instead of each by its server's "
        "share of the bytes (the library's way, engine.placement.receive_buffers)",
    )
    p.add_argument(
        "--server-receive-buffers",
        action="store_true",
        help="torch_bps: each server's receive buffer by its share too (bps-server --receive-buffer-bytes; default: "
        "the kernel's): no drops, for more CPU",
    )
    p.add_argument(
        "--credit-bytes",
        type=int,
        default=0,
        help="byteps bytes in flight per worker (default 0: the library default, Config.credit)",
    )
    p.add_argument(
        "--socket-buffer-bytes",
        type=int,
        default=-1,
        help="byteps workers' BPS_SOCKET_BUFFER_BYTES, push/pull, DDP and FSDP (default -1: byteps.socket_buffer_for, "
        "the kernel's where the links' queue holds 128 KiB per connection sharing an uplink, else sized from the queue "
        "so that every connection's bytes in flight fit in it; 0: the kernel's autotuned buffers)",
    )
    p.add_argument(
        "--paired-cpu",
        type=int,
        default=0,
        metavar="R",
        help="torch_bps push/pull: after its timed steps, R pairs of blocks of --steps steps, gloo all_reduce and "
        "push/pull alternated in the same worker processes, and their CPU-s per step compared pair by pair (this "
        "machine's speed drifts too much for runs a minute apart to compare CPU)",
    )
    p.add_argument(
        "--trace",
        metavar="DIR",
        default="",
        help="byteps push/pull: record every worker's timed steps and every server into DIR/kK, one directory per k "
        "(merge one with `python -m torch_bps.timeline DIR/kK -o timeline.json`)",
    )
    p.add_argument("--no-ddp", action="store_true", help="skip the DDP samples/s part")
    p.add_argument(
        "--no-gloo", action="store_true", help="skip the gloo all_reduce point (A/B runs of byteps settings)"
    )
    p.add_argument("--ddp-k", type=int, help="server hosts of the byteps DDP run (default n)")
    p.add_argument("--ddp-hidden", type=int, default=2048, help="MLP width (default 2048; DDP and --fsdp)")
    p.add_argument("--ddp-layers", type=int, help="MLP depth (default 6 = 25 M params; --quick 3)")
    p.add_argument("--ddp-batch", type=int, default=16, help="samples per rank per step (default 16)")
    p.add_argument(
        "--fsdp",
        action="store_true",
        help="also train the same MLP sharded with FSDP2 fully_shard: gloo, and byteps at every k of --ks; "
        "steps/s and bytes per step (worker links; byteps servers' STATS against the ideal)",
    )
    p.add_argument("--json", metavar="PATH", help="write the report as JSON")
    p.add_argument("--plot", metavar="PATH", help="write a PNG: step time vs k, measured vs theory vs gloo")
    p.add_argument("--cleanup-leftovers", action="store_true", help="delete bps-* namespaces of dead runs, exit")
    return p.parse_args(argv)


def make_plan(args: argparse.Namespace) -> Plan:
    """Resolve the options (explicit values win over --quick, which wins over defaults) into a Plan."""

    def pick(value, quick_key: str, default):
        if value is not None:
            return value
        return QUICK[quick_key] if args.quick else default

    n = pick(args.workers, "n", 4)
    if n < 2:
        raise SystemExit("need at least 2 workers")
    if args.ks:
        ks = tuple(int(k) for k in args.ks.split(","))
    else:
        ks = (0, n) if args.quick else tuple(range(n + 1))
    if any(k < 0 for k in ks):
        raise SystemExit(f"--ks {args.ks}: k must be >= 0")
    steps, warmup = pick(args.steps, "steps", 5), pick(args.warmup, "warmup", WARMUP)
    model = DdpSpec(hidden=args.ddp_hidden, layers=pick(args.ddp_layers, "ddp_layers", 6), batch=args.ddp_batch,
                    steps=steps, warmup=warmup)  # fmt: skip
    return Plan(
        n=n,
        ks=ks,
        size_bytes=int(pick(args.size_mb, "size_mb", 64.0) * 2**20) // 4 * 4,
        rate_mbit=args.rate,
        tcp_congestion=args.tcp_congestion,
        steps=steps,
        warmup=warmup,
        repeats=max(1, pick(args.repeats, "repeats", 3)),
        gloo=not args.no_gloo,
        calibration_s=QUICK["calibration_s"] if args.quick else 3.0,
        ddp=None if args.no_ddp else model,
        ddp_k=args.ddp_k if args.ddp_k is not None else n,
        fsdp=dataclasses.replace(model, wrap="fsdp") if args.fsdp else None,
        socket_buffer_bytes=args.socket_buffer_bytes,
    )


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    reason = netns.unavailable_reason()
    if reason:
        print(f"benchmarks.cluster: SKIPPED: {reason}")
        return 0
    if args.cleanup_leftovers:
        removed = netns.cleanup_leftovers()
        print(f"removed {len(removed)} leftover namespace(s)")
        return 0
    plan = make_plan(args)
    if args.runner == "torch_bps":
        runner = functools.partial(run_torch_bps, placement_mode=args.placement, partition_bytes=args.partition_bytes,
                                   credit_bytes=args.credit_bytes,
                                   socket_buffer_bytes=args.socket_buffer_bytes, trace_dir=args.trace,
                                   equal_receive_buffers=args.equal_receive_buffers,
                                   server_receive_buffers=args.server_receive_buffers,
                                   pairs=args.paired_cpu)  # fmt: skip
    else:
        runner = functools.partial(run_tcp_matrix, mode=args.runner.removeprefix("tcp-"),
                                   socket_buffer_bytes=args.socket_buffer_bytes, pace=args.tcp_pace,
                                   buffers_by_share=args.tcp_buffers_by_share, lead_bytes=args.tcp_lead,
                                   partition_bytes=args.tcp_partition_bytes)  # fmt: skip
    try:
        result = run(plan, runner)
    except KeyboardInterrupt:  # the cluster's __exit__ has already removed everything by now
        print("interrupted; the emulated cluster was torn down", file=sys.stderr)
        return 130
    result["plan"].update(
        runner=args.runner,
        tcp_pace=args.tcp_pace,
        tcp_buffers_by_share=args.tcp_buffers_by_share,
        tcp_lead=args.tcp_lead,
        tcp_partition_bytes=args.tcp_partition_bytes,
        equal_receive_buffers=args.equal_receive_buffers,
        server_receive_buffers=args.server_receive_buffers,
        placement=args.placement,
        partition_bytes=args.partition_bytes,
        credit_bytes=args.credit_bytes,
        socket_buffer_bytes=args.socket_buffer_bytes,
        paired_cpu=args.paired_cpu,
        trace=args.trace,
        # What the runs inherited (BPS_TRANSPORT, BPS_MIDDLE_PARTITION_FACTOR...), never a secret.
        environment={
            k: v for k, v in os.environ.items() if k.startswith("BPS_") and "CREDENTIAL" not in k and "SECRET" not in k
        },
    )
    print(report.format_table(result), flush=True)
    if args.json:
        report.write_json(result, args.json)
        print(f"wrote {args.json}")
    if args.plot:
        why_not = report.plot(result, args.plot)
        print(f"plot not written: {why_not}" if why_not else f"wrote {args.plot}")
    return 1 if result["errors"] else 0


if __name__ == "__main__":
    sys.exit(main())
