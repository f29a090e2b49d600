"""Per point of cluster-benchmark JSONs: x t_opt, TCP's counters summed over the hosts, our processes' cores.

    python docs/results/session22/tcp_counters.py docs/results/session22/experiments/lw0_2.json ...

Scratch analysis (session 22). Runs made with the session's scratch counters carry more of /proc/net/netstat
(want/to zero window, prune) than the benchmark keeps (collapsed and receive-queue drops, since dfacfa0).
"""

import collections
import json
import sys

KEEP = ["retransmitted segments", "spurious (D-SACKed)", "timeouts", "want zero window", "to zero window",
        "collapsed", "rcvq drop", "receive-queue drops", "prune", "lost retransmit"]  # fmt: skip

for path in sys.argv[1:]:
    report = json.load(open(path))
    for k, point in report["byteps"]["points"].items():
        counts = collections.Counter()
        for key, value in point["tcp_losses"].items():
            counts[key.split(" ", 1)[1]] += value
        t_opt = next(row["t_opt_s"] for row in report["sweep"] if str(row["k"]) == k)
        cores = sum(c["process_cores"] for c in point["cpu"].values())
        shown = {label: counts[label] for label in KEEP if counts[label]}
        ratio = point["seconds_per_step"] / t_opt
        print(path.rsplit("/", 1)[-1], f"k={k}", f"{ratio:.3f}", shown, f"cores {cores:.2f}")
