"""Print the A/B runs of a directory of cluster JSONs (NAME_RUN.json): per run and per variant's median, gloo's
CPU-s per step and, per k, x t_opt, our CPU-s per step, its ratio to gloo's in the same run, and the mean cores of
a worker / of a server.

    python docs/results/session26/ab_summary.py docs/results/session26/ab
"""

import glob
import json
import os
import statistics
import sys


def rows(directory: str) -> dict:
    out: dict = {}
    for path in sorted(glob.glob(os.path.join(directory, "*.json"))):
        variant, run = os.path.basename(path)[:-5].rsplit("_", 1)
        d = json.load(open(path))
        m = d["cpu"]["measurements"]
        r = {"gloo": m["gloo all_reduce"]["cpu_s_per_step"]}
        for k, point in d["byteps"]["points"].items():
            t_opt = next(p["t_opt_s"] for p in d["sweep"] if str(p["k"]) == k)
            workers = [c["process_cores"] for n, c in point["cpu"].items() if "server" not in n]
            servers = [c["process_cores"] for n, c in point["cpu"].items() if "server" in n]
            r[k] = (
                point["seconds_per_step"] / t_opt,
                m[f"byteps k={k}"]["cpu_s_per_step"],
                m[f"byteps k={k}"]["cpu_vs_gloo"],
                statistics.mean(workers),
                statistics.mean(servers),
            )
        out.setdefault(variant, []).append((run, r))
    return out


def main() -> None:
    for variant, runs in rows(sys.argv[1]).items():
        ks = [k for k in runs[0][1] if k != "gloo"]
        median = {"gloo": statistics.median(r["gloo"] for _, r in runs)}
        for k in ks:
            median[k] = tuple(statistics.median(r[k][i] for _, r in runs) for i in range(5))
        for run, r in runs + [("med", median)]:
            cells = [f"k={k}: x {r[k][0]:.3f} cpu {r[k][1]:.3f} ({r[k][2]:.2f}x) cores {r[k][3]:.4f} / {r[k][4]:.4f}"
                     for k in ks]  # fmt: skip
            print(f"{variant:6} {run:3} gloo {r['gloo']:.3f} | " + " | ".join(cells))


if __name__ == "__main__":
    main()
