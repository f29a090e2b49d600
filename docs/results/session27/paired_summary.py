"""Print the paired CPU comparisons of a directory of cluster JSONs (VARIANT_RUN.json, each from `python -m
benchmarks.cluster ... --paired-cpu R`): per run and per variant's median, for each k the median over the run's pairs
of push/pull's CPU-s per step against gloo's (our processes alone / with the kernel's softirq threads), our workers'
CPU-s per step against gloo's workers' (the servers left out), the timed steps' x t_opt and, in brackets, the mean
x t_opt of the paired push/pull blocks' steps; then, per run, the tbf drops on the senders' side of the links
("up") and the receivers' ("down"), and TCP's timeouts, over the whole point.

    python docs/results/session27/paired_summary.py docs/results/session27/ab
"""

import collections
import glob
import json
import os
import statistics
import sys


def workers_ratio(blocks: list[dict]) -> float:
    def mean(runner: str) -> float:
        return statistics.mean(b["workers_cores"] * b["seconds_per_step"] for b in blocks if b["runner"] == runner)

    return mean("byteps") / mean("gloo")


def _losses(point: dict) -> tuple[int, int, int]:
    drops = point.get("tbf_drops") or {}
    up = sum(v for link, v in drops.items() if link.endswith(" up"))
    rto = sum(v for name, v in (point.get("tcp_losses") or {}).items() if name.endswith(" timeouts"))
    return up, sum(drops.values()) - up, rto


def main() -> None:
    by_variant = collections.defaultdict(list)
    losses = collections.defaultdict(list)
    for path in sorted(glob.glob(os.path.join(sys.argv[1], "*.json"))):
        variant, run = os.path.basename(path)[:-5].rsplit("_", 1)
        d = json.load(open(path))
        row = {}
        for k, point in d["byteps"]["points"].items():
            if "paired" not in point:
                continue
            t_opt = next(s["t_opt_s"] for s in d["sweep"] if str(s["k"]) == k)
            p = point["paired"]
            blocks = statistics.mean(b["seconds_per_step"] for b in p["blocks"] if b["runner"] == "byteps") / t_opt
            row[k] = (p["median_cpu_vs_gloo"], p["median_with_softirq_threads_vs_gloo"],
                      workers_ratio(p["blocks"]), point["seconds_per_step"] / t_opt, blocks)  # fmt: skip
        by_variant[variant].append((run, row))
        losses[variant].append((run, {k: _losses(point) for k, point in d["byteps"]["points"].items()}))
    for variant, runs in by_variant.items():
        ks = list(runs[0][1])
        median = {k: tuple(statistics.median(r[k][i] for _, r in runs) for i in range(5)) for k in ks}
        for run, row in runs + [("med", median)]:
            cells = [
                f"k={k}: {a:.2f} / {b:.2f} (workers {w:.2f}) x {x:.3f} ({y:.3f})" for k, (a, b, w, x, y) in row.items()
            ]
            print(f"{variant:5} {run:3} " + " | ".join(cells))
        for run, row in losses[variant]:
            cells = [f"k={k}: drops {up} up / {down} down, timeouts {rto}" for k, (up, down, rto) in row.items()]
            print(f"{variant:5} {run:3} " + " | ".join(cells))


if __name__ == "__main__":
    main()
