"""`python -m torch_bps.doctor`, under torchrun on the job's real machines, with the job's BPS_* settings.

Measures every machine's path to every server, the servers' summation rate, the local hierarchy and the
collective itself (against gloo), then prints what the paper's formula predicts for this job, which k would be
best, and what limits it (verdict.py). Rank 0 prints; `--json` writes the measurements and the verdict.

    torchrun --nnodes 4 --nproc-per-node 8 ... -m torch_bps.doctor --mb 64 --json doctor.json

May import: the standard library, torch and torch_bps.doctor.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import sys
from datetime import timedelta

import torch.distributed as dist

from torch_bps.doctor.measure import measure
from torch_bps.doctor.verdict import judge


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="python -m torch_bps.doctor", description=__doc__.split("\n\n")[0])
    p.add_argument("--mb", type=float, default=64.0, help="MB per collective and per path measurement (default 64)")
    p.add_argument("--repeats", type=int, default=3, help="timed runs of each measurement; the median counts")
    p.add_argument("--json", metavar="PATH", help="write the measurements and the verdict here (rank 0)")
    p.add_argument("--timeout", type=float, default=600.0, help="seconds any wait of the doctor may take")
    args = p.parse_args(argv)
    dist.init_process_group("gloo", timeout=timedelta(seconds=args.timeout))
    try:
        m = measure(int(args.mb * 1e6), args.repeats)
    finally:
        dist.destroy_process_group()
    if m is None:
        return 0
    verdict = judge(m)
    print(verdict.text(m), flush=True)
    if args.json:
        with open(args.json, "w") as f:
            json.dump({"measurements": dataclasses.asdict(m), "verdict": dataclasses.asdict(verdict)}, f, indent=1)
    return 0


if __name__ == "__main__":
    sys.exit(main())
