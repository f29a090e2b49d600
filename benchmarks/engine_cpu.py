"""Worker CPU per partition of the engine's push/pull: this tree against a baseline tree, in one run.

Per partition size P, one worker (a job of one) runs `PushPullEngine.push_pull` of a tensor of --size-bytes
cut into partitions of P against a summation server on loopback, for --seconds. Reported: the worker
process's CPU seconds (all its threads: Python, the client's IO and completion threads; not the server's)
per partition and per GiB pushed, and the goodput (bytes summed per second of wall time).

Each tree runs in a child process of its own interpreter (`--baseline-python`, `--baseline-repo`: e.g. main's
build, whose engine schedules every partition in Python), alternating with this tree, `--repeats` times;
the ratios new / baseline are taken within each repeat (the machine is shared and noisy).

Usage: python benchmarks/engine_cpu.py --baseline-repo /work/main [--json results/engine_cpu.json]
May import: the standard library, torch and torch_bps (of the tree under test, in the child).
"""

from __future__ import annotations

import argparse
import inspect
import json
import os
import statistics
import subprocess
import sys
import time

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
KB, MB = 1 << 10, 1 << 20


def child(repo: str, partition: int, size: int, seconds: float) -> dict:
    """Measure one tree (imported from `repo`) at one partition size; runs in its own process."""
    sys.path.insert(0, REPO)
    from benchmarks._harness import Server  # this tree's, whichever tree is measured

    sys.path.insert(0, repo)
    import torch

    from torch_bps.client import Client
    from torch_bps.engine.partition import KeyBook
    from torch_bps.engine.pipeline import PushPullEngine
    from torch_bps.engine.placement import Placement, server_weights

    torch.set_num_threads(1)
    with Server("--auth", "off", repo=repo) as server:
        address = server.address
        with Client([address], 1, 0, 1, timeout=60, auth=False) as client:
            keys = KeyBook(Placement(server_weights([address], [])), partition, lambda n: [(0, n)])
            # A baseline tree whose engine schedules in Python (its CreditScheduler lived in torch_bps.engine then).
            if "scheduler" in inspect.signature(PushPullEngine).parameters:
                from torch_bps.engine.scheduler import CreditScheduler

                engine = PushPullEngine(client, keys, CreditScheduler(2 << 20))
            else:
                engine = PushPullEngine(client, keys)
            t = torch.ones(size // 4)
            parts = len(keys.plan(t.numel(), t.dtype)[0])
            for _ in range(3):  # warm-up: INIT of every key, first allocations
                engine.push_pull(t).wait()
            steps, cpu0, wall0 = 0, time.process_time(), time.perf_counter()
            while steps < 3 or time.perf_counter() - wall0 < seconds:
                engine.push_pull(t).wait()
                steps += 1
            cpu, wall = time.process_time() - cpu0, time.perf_counter() - wall0
            engine.close()
    return dict(cpu_us_per_part=cpu / (steps * parts) * 1e6, cpu_s_per_gib=cpu / (steps * size) * (1 << 30),
                goodput_gbps=steps * size / wall / 1e9, parts_per_step=parts, steps=steps)  # fmt: skip


def run_child(python: str, repo: str, partition: int, args) -> dict:
    cmd = [python, os.path.abspath(__file__), "--child", repo, "--partition", str(partition),
           "--size-bytes", str(args.size_bytes), "--seconds", str(args.seconds)]  # fmt: skip
    out = subprocess.run(cmd, capture_output=True, text=True, timeout=300, cwd=repo)
    if out.returncode != 0:
        raise RuntimeError(f"{repo} at {partition} bytes failed:\n{out.stderr[-3000:]}")
    return json.loads(out.stdout.strip().splitlines()[-1])


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--baseline-repo", default="", help="the tree to compare against (e.g. /work/main); required")
    p.add_argument("--baseline-python", default="", help="its interpreter; default <baseline-repo>/.venv/bin/python")
    p.add_argument("--partitions", default=f"{64 * KB},{256 * KB},{1 * MB}", help="partition sizes in bytes")
    p.add_argument("--size-bytes", type=int, default=16 * MB, help="the tensor of one push_pull")
    p.add_argument("--seconds", type=float, default=3.0, help="per measurement")
    p.add_argument("--repeats", type=int, default=3)
    p.add_argument("--json", default="")
    p.add_argument("--child", default="", help=argparse.SUPPRESS)
    p.add_argument("--partition", type=int, default=0, help=argparse.SUPPRESS)
    args = p.parse_args(argv)
    if args.child:
        print(json.dumps(child(args.child, args.partition, args.size_bytes, args.seconds)))
        return 0
    if not args.baseline_repo:
        p.error("--baseline-repo is required")

    trees = {"baseline": (args.baseline_python or os.path.join(args.baseline_repo, ".venv/bin/python"),
                          os.path.abspath(args.baseline_repo)),
             "new": (sys.executable, REPO)}  # fmt: skip
    rows = []
    for partition in (int(x) for x in args.partitions.split(",")):
        runs = []
        for _ in range(args.repeats):  # alternating, so drifting load hits both alike
            runs.append({name: run_child(python, repo, partition, args) for name, (python, repo) in trees.items()})
        ratios = {
            f"{field}_new_vs_baseline": [r["new"][field] / r["baseline"][field] for r in runs]
            for field in ("cpu_us_per_part", "goodput_gbps")
        }
        row = dict(partition=partition, size=args.size_bytes, runs=runs,
                   **{k: dict(median=statistics.median(v), all=v) for k, v in ratios.items()})  # fmt: skip
        rows.append(row)
        med = {name: {f: statistics.median(r[name][f] for r in runs) for f in runs[0][name]} for name in trees}
        print(f"P={partition >> 10:5d} KiB  CPU/partition baseline {med['baseline']['cpu_us_per_part']:7.0f} us, new "
              f"{med['new']['cpu_us_per_part']:7.0f} us (x{row['cpu_us_per_part_new_vs_baseline']['median']:.2f});  "
              f"CPU/GiB {med['baseline']['cpu_s_per_gib']:.2f} s -> {med['new']['cpu_s_per_gib']:.2f} s;  goodput "
              f"{med['baseline']['goodput_gbps']:.2f} -> {med['new']['goodput_gbps']:.2f} GB/s "
              f"(x{row['goodput_gbps_new_vs_baseline']['median']:.2f})", flush=True)  # fmt: skip
    if args.json:
        meta = dict(when=time.strftime("%Y-%m-%d %H:%M UTC", time.gmtime()), baseline=args.baseline_repo,
                    command=" ".join([os.path.basename(sys.argv[0])] + (argv or sys.argv[1:])))  # fmt: skip
        os.makedirs(os.path.dirname(args.json) or ".", exist_ok=True)
        with open(args.json, "w") as f:
            json.dump(dict(meta=meta, rows=rows), f, indent=1)
    return 0


if __name__ == "__main__":
    sys.exit(main())
