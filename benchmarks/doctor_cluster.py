"""The doctor on the emulated cluster: its prediction against the collective it measured, for k = 0..n.

For each k, a fresh cluster of n worker hosts and k dedicated server hosts (benchmarks/cluster, tc-shaped
links; `--slow w1=50` shapes one host's link slower), `python -m torch_bps.doctor` on every worker host; the
table gives the doctor's predicted communication time (the paper's t_opt at the links it measured), the
push_pull it measured, gloo's all_reduce, and what it named as the limit. Needs root and iproute2.

    python benchmarks/doctor_cluster.py --workers 4 --rate 500 --mb 32 --json doctor_cluster.json

May import: the standard library, benchmarks.cluster.
"""

from __future__ import annotations

import argparse
import json
import os
import sys

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, REPO)

from benchmarks.cluster import byteps, netns  # noqa: E402
from benchmarks.cluster.topology import IFNAME, Cluster  # noqa: E402

STORE_PORT, SERVER_PORT = 29555, 9500


def run_doctor(cluster: Cluster, k: int, mb: float, repeats: int, timeout: float = 300.0) -> dict:
    """Run the doctor with the first k server hosts as dedicated servers; return its JSON report."""
    _, addresses = byteps.start_servers(cluster, cluster.servers[:k], SERVER_PORT) if k else ([], [])
    out = os.path.join(cluster.logdir, f"doctor-k{k}.json")
    argv = [sys.executable, "-m", "torch_bps.doctor", "--mb", str(mb), "--repeats", str(repeats), "--json", out,
            "--timeout", str(timeout)]  # fmt: skip
    env = {"MASTER_ADDR": cluster.workers[0].ip, "MASTER_PORT": str(STORE_PORT), "LOCAL_RANK": "0",
           "WORLD_SIZE": str(len(cluster.workers)), "LOCAL_WORLD_SIZE": "1", "BPS_SERVERS": ",".join(addresses),
           "GLOO_SOCKET_IFNAME": IFNAME, "OMP_NUM_THREADS": "1"}  # fmt: skip
    ranks = [cluster.spawn(f"doctor rank {r}", h, argv, env | {"RANK": str(r), "BPS_HOST": h.ip})
             for r, h in enumerate(cluster.workers)]  # fmt: skip
    for rank in ranks:
        rank.popen.wait(timeout=timeout + 30)
    if any(r.poll() != 0 for r in ranks):
        raise RuntimeError("the doctor failed:\n" + "\n".join(f"{r.name}:\n{r.stderr_tail(30)}" for r in ranks))
    with open(out) as f:
        report = json.load(f)
    report["text"] = ranks[0].stdout()
    return report


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--workers", type=int, default=4, help="worker hosts n (default 4)")
    p.add_argument("--rate", type=float, default=500.0, help="link rate in Mbit/s (default 500)")
    p.add_argument("--slow", default="", help="HOST=MBIT: one host's link at another rate, e.g. w1=100")
    p.add_argument("--ks", default="", help="comma-separated k (default 0..n)")
    p.add_argument("--mb", type=float, default=32.0, help="MB per collective (default 32)")
    p.add_argument("--repeats", type=int, default=3)
    p.add_argument("--json", metavar="PATH")
    args = p.parse_args(argv)
    if reason := netns.unavailable_reason():
        print(f"SKIPPED: {reason}")
        return 0
    n = args.workers
    ks = [int(k) for k in args.ks.split(",")] if args.ks else list(range(n + 1))
    rates = {}
    if args.slow:
        host, _, mbit = args.slow.partition("=")
        rates[host] = float(mbit)
    rows = []
    print(f"n = {n}, {args.rate:g} Mbit/s{f', {args.slow}' if args.slow else ''}, {args.mb:g} MB per collective")
    print("k | predicted (ms) | measured (ms) | measured / predicted | gloo (ms) | first limit named")
    for k in ks:
        with Cluster(n_workers=n, n_servers=k, rate_mbit=args.rate, rates=rates) as cluster:
            report = run_doctor(cluster, k, args.mb, args.repeats)
        v, m = report["verdict"], report["measurements"]
        row = {"k": k, "predicted_s": v["predicted"], "measured_s": m["collective"], "gloo_s": m["gloo"],
               "ratio": m["collective"] / v["predicted"], "limits": v["limits"],
               "link_rates": v["link_rates"]}  # fmt: skip
        rows.append(row)
        print(f"{k} | {v['predicted'] * 1e3:.0f} | {m['collective'] * 1e3:.0f} | {row['ratio']:.2f} | "
              f"{m['gloo'] * 1e3:.0f} | {v['limits'][0]}", flush=True)  # fmt: skip
    if args.json:
        with open(args.json, "w") as f:
            json.dump({"command": " ".join(sys.argv), "args": vars(args), "rows": rows}, f, indent=1)
    return 0


if __name__ == "__main__":
    sys.exit(main())
