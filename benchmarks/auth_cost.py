"""What authentication (token, the default) and encryption (CURVE) cost on push/pull throughput, in one run.

Three servers on loopback, with `--auth token`, `--auth curve` and `--auth off`; per tensor size, the
library's engine push_pull (4 MB partitions, pipelined: what the backend and the DDP hook run) with one
worker, and the 2-worker round time (the server really adds), alternated in short bursts between the
servers so drifting machine load hits all alike. Prints goodput on each and the ratios to off.

Usage: python benchmarks/auth_cost.py [--quick] [--json out.json]
May import: the standard library, torch and torch_bps (and benchmarks.pushpull's helpers).
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys

import torch

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, REPO)

from benchmarks.pushpull import KB, MB, human, library_engine, start_server, stop, timed  # noqa: E402
from torch_bps.client import Client, job_id_from_name  # noqa: E402
from torch_bps.security import ClientCredentials  # noqa: E402

FULL_SIZES = [64 * KB, 1 * MB, 4 * MB, 16 * MB, 64 * MB]
QUICK_SIZES = [1 * MB, 16 * MB]
MODES = ("token", "curve", "off")
ON = MODES[:2]


class Setup:
    """One server and its clients: one worker's engine, and a 2-worker job that makes the server add."""

    def __init__(self, auth: str):
        self.auth = auth
        self.server, address = start_server(16 * MB, auth)
        tag = f"{auth}-{os.getpid()}"

        def client(job: str, worker: int, n: int) -> Client:
            job_id = job_id_from_name(f"{job}-{tag}")
            pool = os.environ["BPS_POOL_CREDENTIAL"]
            credentials = auth != "off" and ClientCredentials.for_pool(pool, job_id, 1, auth)
            return Client([address], job_id, worker, n, auth=credentials)

        self.engine_client = client("engine", 0, 1)
        self.engine = library_engine(self.engine_client, address)
        self.pair = [client("pair", w, 2) for w in range(2)]
        self.engines2 = [library_engine(c, address) for c in self.pair]

    def one_worker(self, t: torch.Tensor) -> None:
        self.engine.push_pull(t).wait()

    def two_workers(self, ts: list[torch.Tensor]) -> None:
        futures = [e.push_pull(t) for e, t in zip(self.engines2, ts, strict=True)]
        for f in futures:
            f.wait()

    def close(self) -> None:
        for e in [self.engine, *self.engines2]:
            e.close()
        for c in [self.engine_client, *self.pair]:
            c.close()
        stop(self.server)


def measure(sizes: list[int], budget: float) -> list[dict]:
    torch.set_num_threads(1)
    setups = {auth: Setup(auth) for auth in MODES}
    rows = []
    try:
        for size in sizes:
            t = torch.ones(size // 4)
            pair = [torch.ones(size // 4) for _ in range(2)]
            # Medians of three bursts per server, alternated so drifting load hits both alike.
            one: dict[str, list[float]] = {a: [] for a in MODES}
            two: dict[str, list[float]] = {a: [] for a in MODES}
            for _ in range(3):
                for auth, s in setups.items():
                    one[auth].append(timed(lambda s=s, t=t: s.one_worker(t), budget / 6))
                    two[auth].append(timed(lambda s=s, pair=pair: s.two_workers(pair), budget / 6))
            row = {"size": size}
            for auth in MODES:
                row[f"one_worker_{auth}_Bps"] = size / statistics.median(one[auth])
                row[f"two_workers_{auth}_Bps"] = size / statistics.median(two[auth])
            for auth in ON:
                for what in ("one_worker", "two_workers"):
                    row[f"{what}_{auth}_ratio"] = row[f"{what}_{auth}_Bps"] / row[f"{what}_off_Bps"]
            rows.append(row)
            print_row(row)
    finally:
        for s in setups.values():
            s.close()
    return rows


def rate(n: float) -> str:
    return human(n) + "/s"


def print_row(r: dict) -> None:
    size = f"{r['size'] // MB} MB" if r["size"] >= MB else f"{r['size'] // KB} KB"
    cells = []
    for what in ("one_worker", "two_workers"):
        rates = " ".join(f"{rate(r[f'{what}_{a}_Bps']):>11}" for a in MODES)
        cells.append(rates + " " + " ".join(f"{r[f'{what}_{a}_ratio']:>6.2f}" for a in ON))
    print(f"{size:>7} | {cells[0]} | {cells[1]}", flush=True)


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--quick", action="store_true", help="two sizes, short budgets")
    p.add_argument("--json", metavar="PATH", help="write the per-size rows here")
    p.add_argument("--sizes", help="comma-separated sizes in bytes")
    p.add_argument("--budget", type=float, help="seconds per size (default 6, quick 2)")
    args = p.parse_args(argv)
    sizes = [int(s) for s in args.sizes.split(",")] if args.sizes else QUICK_SIZES if args.quick else FULL_SIZES
    budget = args.budget or (2.0 if args.quick else 6.0)
    print(f"engine push_pull on loopback, auth token / curve / off in this run; torch {torch.__version__}")
    heads = " ".join(f"{a:>11}" for a in MODES) + " " + " ".join(f"{a + '/off':>9}" for a in ON)
    print(f"{'size':>7} | 1 worker: {heads} | 2 workers: {heads}")
    rows = measure(sizes, budget)
    largest = max(rows, key=lambda r: r["size"])
    for a in ON:
        print(
            f"largest size {human(largest['size'])}: {a} keeps {largest[f'one_worker_{a}_ratio']:.2f} of one "
            f"worker's goodput and {largest[f'two_workers_{a}_ratio']:.2f} of the 2-worker round rate"
        )
    if args.json:
        with open(args.json, "w") as f:
            json.dump({"rows": rows}, f, indent=2)
    return 0


if __name__ == "__main__":
    sys.exit(main())
