"""One line per cluster-benchmark JSON: each byteps point's x t_opt, our cores, tbf drops, TCP timeouts,
receive-queue drops, zero windows advertised and the workers' mean credit.

    python docs/results/session23/summary.py docs/results/session23/experiments/g32_*.json
"""

import json
import os
import sys

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", "..", ".."))
from benchmarks.cluster.report import tcp_total as total  # noqa: E402

for path in sys.argv[1:]:
    with open(path) as f:
        run = json.load(f)
    points = run["byteps"].get("points", {})
    t_opt = {str(row["k"]): row["t_opt_s"] for row in run["sweep"]}
    cells = []
    for k, p in sorted(points.items(), key=lambda kv: int(kv[0])):
        x = p["seconds_per_step"] / t_opt[k]
        cores = sum(v.get("process_cores", 0) for v in p["cpu"].values())
        credits = [v["credit_bytes"] for v in p["cpu"].values() if "credit_bytes" in v]
        losses = p.get("tcp_losses")
        cells.append(
            f"k={k} {x:.3f} cores {cores:.2f} drops {sum((p.get('tbf_drops') or {}).values())} "
            f"timeouts {total(losses, 'timeouts')} rq-drops {total(losses, 'receive-queue drops')} "
            f"zero-win {total(losses, 'zero windows')} credit {sum(credits) // max(1, len(credits))}"
        )
    print(os.path.basename(path), " | ".join(cells))
