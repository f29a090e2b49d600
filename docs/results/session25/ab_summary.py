"""One row per A/B run of session 25 (VARIANT_RUN.json, `--ks 0,4`), then each variant's medians: gloo's CPU-s per
step; at k = 0 and 4 x t_opt, our CPU-s per step, its ratio to gloo's, the machine-wide ratio; streams on a local
stream at k = 0.

    python docs/results/session25/ab_summary.py docs/results/session25/ab
"""

import glob
import json
import os
import statistics
import sys

d = sys.argv[1]
rows = {}
for path in sorted(glob.glob(os.path.join(d, "*.json"))):
    name = os.path.basename(path)[:-5]
    v, i = name.rsplit("_", 1)
    run = json.load(open(path))
    m = run["cpu"]["measurements"]
    t_opt = {str(r["k"]): r["t_opt_s"] for r in run["sweep"]}
    pts = run["byteps"]["points"]
    g = m["gloo all_reduce"]["cpu_s_per_step"]
    r = {"gloo": g}
    for k in ("0", "4"):
        mk = m[f"byteps k={k}"]
        r[f"x{k}"] = pts[k]["seconds_per_step"] / t_opt[k]
        r[f"cpu{k}"] = mk["cpu_s_per_step"]
        r[f"ratio{k}"] = mk["cpu_s_per_step"] / g
        gloo_busy = m["gloo all_reduce"]["machine_busy"] * run["gloo"]["seconds_per_step"]
        r[f"mach{k}"] = mk["machine_busy"] * pts[k]["seconds_per_step"] / gloo_busy  # all cores, per step
        r[f"local{k}"] = sum(c.get("streams_local", 0) for c in pts[k]["cpu"].values())
    rows.setdefault(v, []).append((i, r))
keys = ["gloo", "x0", "cpu0", "ratio0", "mach0", "x4", "cpu4", "ratio4", "mach4", "local0"]
print("variant run " + " ".join(f"{k:>7}" for k in keys))
for v, runs in rows.items():
    for i, r in sorted(runs):
        print(f"{v:7} {i:3} " + " ".join(f"{r[k]:7.3f}" for k in keys))
    print(f"{v:7} med " + " ".join(f"{statistics.median(r[k] for _, r in runs):7.3f}" for k in keys))
