"""What a failover costs: step times on the emulated cluster around the SIGKILL of a dedicated server.

n worker hosts all_reduce through the "byteps" backend with k dedicated servers (and, as the paper's split
wants at k < n, colocated ones); at step --kill-at the orchestrator SIGKILLs the first dedicated server. The
table gives the steady state before, the step that lost the server, and the steady state after (the keys moved
to the servers that remain, or to a standby host with --standby), each against t_opt of its placement.
Needs root and iproute2.

    python benchmarks/failover_cost.py --workers 4 --servers 2 --rate 500 --mb 16 --json results/failover_cost.json

`--overhead N` measures instead what failover costs when nothing fails, on loopback: 2 ranks (torchrun, one
machine, BPS_LOCAL_REDUCE=0) and 2 dedicated servers, BPS_FAILOVER=1 and =0 alternated N times; median step
time and the ranks' CPU-seconds per step.

May import: the standard library, benchmarks.cluster.
"""

from __future__ import annotations

import argparse
import json
import os
import signal
import statistics
import sys
import time

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, REPO)

from benchmarks.cluster import byteps, netns, procs  # noqa: E402
from benchmarks.cluster.theory import t_opt_s  # noqa: E402
from benchmarks.cluster.topology import IFNAME, Cluster  # noqa: E402

STORE_PORT, SERVER_PORT = 29565, 9600


def run(n: int, k: int, standby: bool, rate: float, mb: float, steps: int, kill_at: int, timeout: float) -> dict:
    with Cluster(n_workers=n, n_servers=k + standby, rate_mbit=rate) as cluster:
        servers, addresses = byteps.start_servers(cluster, cluster.servers, SERVER_PORT)
        dedicated, spare = addresses[:k], addresses[k:]
        argv = [sys.executable, "-m", "benchmarks.cluster.workers.failover_steps", "--mb", str(mb),
                "--steps", str(steps)]  # fmt: skip
        env = {"MASTER_ADDR": cluster.workers[0].ip, "MASTER_PORT": str(STORE_PORT), "WORLD_SIZE": str(n),
               "LOCAL_RANK": "0", "LOCAL_WORLD_SIZE": "1", "BPS_SERVERS": ",".join(dedicated),
               "BPS_STANDBY_SERVERS": ",".join(spare), "GLOO_SOCKET_IFNAME": IFNAME,
               "OMP_NUM_THREADS": "1"}  # fmt: skip
        ranks = [cluster.spawn(f"rank {r}", h, argv, env | {"RANK": str(r), "BPS_HOST": h.ip})
                 for r, h in enumerate(cluster.workers)]  # fmt: skip
        try:
            procs.wait_for_line(ranks[0], f"step {kill_at - 1}", timeout)
            os.killpg(servers[0].pid, signal.SIGKILL)  # a crash: no goodbye on any connection
            killed = time.time()
            results = procs.wait_all(ranks, timeout, "failover_steps")
        finally:
            for p in [*ranks, *servers]:
                p.kill()
    seconds = [max(r["seconds"][i] for r in results) for i in range(steps)]  # the slowest rank's step
    before, after = seconds[2:kill_at], seconds[kill_at + 2 :]
    m = mb * 1e6
    k_after = k if standby else k - 1
    row = {"n": n, "k": k, "standby": standby, "rate_mbit": rate, "mb": mb, "killed_at": killed,
           "steps": seconds, "failovers": results[0]["failovers"],
           "before_s": statistics.median(before), "failover_step_s": max(seconds[kill_at : kill_at + 2]),
           "after_s": statistics.median(after), "t_opt_before_s": t_opt_s(n, k, m, rate * 1e6),
           "t_opt_after_s": t_opt_s(n, k_after, m, rate * 1e6)}  # fmt: skip
    return row


def overhead(repeats: int, mb: float, steps: int) -> list[dict]:
    """Failover on vs off with nothing failing: loopback, 2 ranks, 2 dedicated servers; alternated."""
    import resource
    import subprocess

    from benchmarks._harness import Server, free_port

    rows = []
    servers = [Server(), Server()]  # the first sets BPS_POOL_CREDENTIAL if unset: the ranks' env below carries it
    try:
        for _ in range(repeats):
            for failover in ("1", "0"):
                env = {**os.environ, "PYTHONPATH": REPO, "OMP_NUM_THREADS": "1", "BPS_LOCAL_REDUCE": "0",
                       "BPS_SERVERS": ",".join(s.address for s in servers), "BPS_FAILOVER": failover}  # fmt: skip
                # Rank 0's output only: two ranks' RESULT lines would interleave.
                cmd = [sys.executable, "-m", "torch.distributed.run", "--nproc-per-node", "2", "--master-addr",
                       "127.0.0.1", "--master-port", str(free_port()), "--tee", "1", "--local-ranks-filter", "0", "-m",
                       "benchmarks.cluster.workers.failover_steps", "--mb", str(mb), "--steps", str(steps)]  # fmt: skip
                before = resource.getrusage(resource.RUSAGE_CHILDREN)
                done = subprocess.run(cmd, env=env, capture_output=True, text=True, timeout=600, cwd=REPO)
                after = resource.getrusage(resource.RUSAGE_CHILDREN)
                if done.returncode != 0:
                    raise RuntimeError(done.stdout[-3000:] + done.stderr[-6000:])
                line = next(line for line in done.stdout.splitlines() if "RESULT " in line)  # "[default0]:RESULT"
                result = json.loads(line.split("RESULT ", 1)[1])
                cpu = (after.ru_utime + after.ru_stime) - (before.ru_utime + before.ru_stime)
                rows.append({"failover": failover == "1", "median_step_s": statistics.median(result["seconds"][3:]),
                             "cpu_s_per_step": cpu / steps})  # fmt: skip
    finally:
        for s in servers:
            s.stop()
    return rows


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--workers", type=int, default=4)
    p.add_argument("--servers", type=int, default=2, help="dedicated servers k (the first one is killed)")
    p.add_argument("--rate", type=float, default=500.0, help="link rate in Mbit/s")
    p.add_argument("--mb", type=float, default=16.0, help="MB summed per step")
    p.add_argument("--steps", type=int, default=30)
    p.add_argument("--kill-at", type=int, default=12, help="the server dies during this step")
    p.add_argument("--timeout", type=float, default=300.0)
    p.add_argument("--overhead", type=int, default=0, metavar="N", help="loopback, nothing failing: N alternations")
    p.add_argument("--json", metavar="PATH")
    args = p.parse_args(argv)
    if args.overhead:
        rows = overhead(args.overhead, args.mb, args.steps)
        print(
            f"loopback, 2 ranks, 2 dedicated servers, {args.mb:g} MB per step: failover | median step (s) | "
            "CPU-s per step (ranks, whole run)"
        )
        for r in rows:
            print(f"{'on' if r['failover'] else 'off'} | {r['median_step_s']:.4f} | {r['cpu_s_per_step']:.4f}")
        if args.json:
            os.makedirs(os.path.dirname(args.json) or ".", exist_ok=True)
            with open(args.json, "w") as f:
                json.dump(rows, f, indent=1)
        return 0
    if reason := netns.unavailable_reason():
        print(f"SKIPPED: {reason}")
        return 0
    rows = [run(args.workers, args.servers, standby, args.rate, args.mb, args.steps, args.kill_at, args.timeout)
            for standby in (False, True)]  # fmt: skip
    print(
        f"n = {args.workers}, k = {args.servers}, {args.rate:g} Mbit/s, {args.mb:g} MB per step; server 0 killed "
        f"during step {args.kill_at}"
    )
    print(
        "standby | before (s) | x t_opt | failover step (s) | x before | after (s) | x t_opt after | failover took (s)"
    )
    for r in rows:
        took = r["failovers"][0]["seconds"] if r["failovers"] else float("nan")
        print(
            f"{'yes' if r['standby'] else 'no'} | {r['before_s']:.3f} | {r['before_s'] / r['t_opt_before_s']:.2f} | "
            f"{r['failover_step_s']:.3f} | {r['failover_step_s'] / r['before_s']:.2f} | {r['after_s']:.3f} | "
            f"{r['after_s'] / r['t_opt_after_s']:.2f} | {took:.2f}"
        )
    if args.json:
        os.makedirs(os.path.dirname(args.json) or ".", exist_ok=True)
        with open(args.json, "w") as f:
            json.dump(rows, f, indent=1)
    return 0


if __name__ == "__main__":
    sys.exit(main())
