"""`make demo`'s yardstick: the share of the no-communication bound that "byteps" reaches on examples/train_ddp.py.

Each round runs the example three times on --nproc processes of this machine, alternated: on "byteps", on gloo, and
on gloo with a comm hook that sends nothing (`--no-comm`: the step with free communication, the most any backend can
reach on this model). Printed per round: each run's steps/s, "byteps" / bound and gloo / bound; then the median
share over the rounds. The target is at least 97%.

Usage: python benchmarks/demo_share.py [--rounds 3] [--steps 100] [--json FILE] [-- extra train_ddp.py arguments]
May import: the standard library.
"""

from __future__ import annotations

import argparse
import json
import os
import re
import statistics
import subprocess
import sys
import time

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
RUNS = {"byteps": ["--backend", "byteps"], "gloo": ["--backend", "gloo"], "bound": ["--backend", "gloo", "--no-comm"]}


def steps_per_second(nproc: int, steps: int, args: list[str], extra: list[str], echo: bool) -> float:
    """Run the example once under torchrun; return the steps/s rank 0 prints."""
    torchrun = os.path.join(os.path.dirname(sys.executable), "torchrun")
    cmd = [torchrun, "--standalone", "--nproc-per-node", str(nproc), os.path.join(REPO, "examples", "train_ddp.py"),
           "--steps", str(steps), *args, *extra]  # fmt: skip
    out = subprocess.run(cmd, capture_output=True, text=True, timeout=900, cwd=REPO)
    if echo:
        print(out.stdout, end="", flush=True)
    found = re.search(r"([\d.]+) steps/s", out.stdout)
    if out.returncode != 0 or found is None:
        raise RuntimeError(f"{' '.join(cmd)} failed ({out.returncode}):\n{out.stdout[-2000:]}\n{out.stderr[-3000:]}")
    return float(found.group(1))


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    extra = argv[argv.index("--") + 1 :] if "--" in argv else []
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--rounds", type=int, default=3)
    p.add_argument("--steps", type=int, default=100)
    p.add_argument("--nproc", type=int, default=2)
    p.add_argument("--quiet", action="store_true", help="do not echo the runs' own output")
    p.add_argument("--json", default="")
    args = p.parse_args(argv[: argv.index("--")] if "--" in argv else argv)

    rounds = []
    for i in range(args.rounds):
        r = {name: steps_per_second(args.nproc, args.steps, run, extra, not args.quiet) for name, run in RUNS.items()}
        r["share"], r["gloo_share"] = r["byteps"] / r["bound"], r["gloo"] / r["bound"]
        rounds.append(r)
        print(f"round {i + 1}: byteps {r['byteps']:.2f}, gloo {r['gloo']:.2f}, no communication {r['bound']:.2f} "
              f"steps/s: byteps at {r['share']:.1%} of the bound (gloo {r['gloo_share']:.1%})", flush=True)  # fmt: skip
    share = statistics.median(r["share"] for r in rounds)
    print(f"byteps reaches {share:.1%} of the no-communication bound (median of {len(rounds)} rounds; target 97%)")
    if args.json:
        meta = dict(when=time.strftime("%Y-%m-%d %H:%M UTC", time.gmtime()), command=" ".join(["demo_share.py", *argv]))
        with open(args.json, "w") as f:
            json.dump(dict(meta=meta, rounds=rounds, share=share), f, indent=1)
    return 0


if __name__ == "__main__":
    sys.exit(main())
