"""CPU per collective of one machine's local ranks: this tree against a baseline tree, with gloo beside them.

--ranks processes on this machine form a job of one machine ("byteps" sums among its local ranks and sends nothing
to a server, as `make demo` runs), or with --nodes N, a job of N emulated machines of --ranks local ranks each (their
embedded servers on loopback: the local stages, the network and the completion all run). Each rank runs --iters
`dist.all_reduce`s of a tensor of --sizes bytes, one at a time (`wait()` after each: a DDP bucket's hook waits the
same way), and reports its process's CPU (all threads) and wall time per collective. The trees alternate
`--repeats` times, each in its own interpreter (`--baseline-python`, `--baseline-repo`), and the ratios new /
baseline are taken within each repeat (the machine is shared and noisy). What a collective costs beyond its memory
work shows at 4 bytes; at 1 MB the copies and sums come on top.

Usage: python benchmarks/collective_cpu.py --baseline-repo DIR [--json FILE]
May import: the standard library, torch and torch_bps (of the tree under test, in the child).
"""

from __future__ import annotations

import argparse
import json
import os
import socket
import statistics
import subprocess
import sys
import time

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def child(repo: str, backend: str, size: int, iters: int) -> dict:
    """One rank: `iters` all-reduces of `size` bytes; runs in its own process, rank and port from the environment."""
    sys.path.insert(0, repo)
    import torch
    import torch.distributed as dist

    import torch_bps  # noqa: F401 - registers "byteps"

    torch.set_num_threads(1)
    dist.init_process_group(backend)
    t = torch.ones(max(1, size // 4))
    for _ in range(20):  # warm-up: keys, buffers, the first allocations
        dist.all_reduce(t)
    dist.barrier()
    cpu0, wall0 = time.process_time(), time.perf_counter()
    for _ in range(iters):
        dist.all_reduce(t)
    cpu, wall = time.process_time() - cpu0, time.perf_counter() - wall0
    dist.barrier()
    dist.destroy_process_group()
    return dict(cpu_us=cpu / iters * 1e6, wall_us=wall / iters * 1e6)


def run_job(python: str, repo: str, backend: str, size: int, iters: int, ranks: int, nodes: int) -> dict:
    """Start `nodes` x `ranks` processes of one job; return rank 0's wall time and every rank's CPU averaged."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    procs = []
    for rank in range(nodes * ranks):
        env = {**os.environ, "MASTER_ADDR": "127.0.0.1", "MASTER_PORT": str(port), "RANK": str(rank),
               "WORLD_SIZE": str(nodes * ranks), "LOCAL_RANK": str(rank % ranks), "LOCAL_WORLD_SIZE": str(ranks),
               "GROUP_RANK": str(rank // ranks), "GROUP_WORLD_SIZE": str(nodes), "OMP_NUM_THREADS": "1",
               "PYTHONPATH": repo}  # fmt: skip
        cmd = [python, os.path.abspath(__file__), "--child", repo, "--backend", backend, "--size", str(size),
               "--iters", str(iters)]  # fmt: skip
        procs.append(subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, env=env,
                                      cwd=repo))  # fmt: skip
    outs = []
    for p in procs:
        out, err = p.communicate(timeout=600)
        if p.returncode != 0:
            raise RuntimeError(f"{backend} in {repo} ({size} B) failed:\n{err[-3000:]}")
        outs.append(json.loads(out.strip().splitlines()[-1]))
    return dict(cpu_us=statistics.mean(o["cpu_us"] for o in outs), wall_us=outs[0]["wall_us"])


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--baseline-repo", default="", help="the tree to compare against; required")
    p.add_argument("--baseline-python", default="", help="its interpreter; default <baseline-repo>/.venv/bin/python")
    p.add_argument("--sizes", default="4,1048576", help="bytes per all_reduce, comma-separated")
    p.add_argument("--iters", type=int, default=2000, help="all-reduces per measurement (a tenth of it at >= 1 MB)")
    p.add_argument("--ranks", type=int, default=2, help="local ranks per machine")
    p.add_argument("--nodes", type=int, default=1, help="emulated machines")
    p.add_argument("--repeats", type=int, default=3)
    p.add_argument("--json", default="")
    p.add_argument("--child", default="", help=argparse.SUPPRESS)
    p.add_argument("--backend", default="byteps", help=argparse.SUPPRESS)
    p.add_argument("--size", type=int, default=0, help=argparse.SUPPRESS)
    args = p.parse_args(argv)
    if args.child:
        print(json.dumps(child(args.child, args.backend, args.size, args.iters)))
        return 0
    if not args.baseline_repo:
        p.error("--baseline-repo is required")

    base = os.path.abspath(args.baseline_repo)
    runs = {"baseline": (args.baseline_python or os.path.join(base, ".venv/bin/python"), base, "byteps"),
            "new": (sys.executable, REPO, "byteps"), "gloo": (sys.executable, REPO, "gloo")}  # fmt: skip
    rows = []
    for size in (int(x) for x in args.sizes.split(",")):
        iters = args.iters if size < 1 << 20 else max(50, args.iters // 10)
        reps = []
        for _ in range(args.repeats):  # alternating, so drifting load hits all alike
            reps.append({name: run_job(py, repo, be, size, iters, args.ranks, args.nodes)
                         for name, (py, repo, be) in runs.items()})  # fmt: skip
        ratio = [r["new"]["cpu_us"] / r["baseline"]["cpu_us"] for r in reps]
        med = {name: {f: statistics.median(r[name][f] for r in reps) for f in ("cpu_us", "wall_us")} for name in runs}
        rows.append(dict(size=size, iters=iters, runs=reps, cpu_new_vs_baseline=ratio))
        print(f"{size:>8d} B  CPU/collective per rank: baseline {med['baseline']['cpu_us']:6.0f} us, new "
              f"{med['new']['cpu_us']:6.0f} us (x{statistics.median(ratio):.2f}, each repeat "
              f"{', '.join(f'{x:.2f}' for x in ratio)}), gloo {med['gloo']['cpu_us']:6.0f} us;  wall: baseline "
              f"{med['baseline']['wall_us']:6.0f} us, new {med['new']['wall_us']:6.0f} us, gloo "
              f"{med['gloo']['wall_us']:6.0f} us", flush=True)  # fmt: skip
    if args.json:
        meta = dict(when=time.strftime("%Y-%m-%d %H:%M UTC", time.gmtime()), baseline=base,
                    command=" ".join([os.path.basename(sys.argv[0])] + (argv or sys.argv[1:])))  # fmt: skip
        with open(args.json, "w") as f:
            json.dump(dict(meta=meta, rows=rows), f, indent=1)
    return 0


if __name__ == "__main__":
    sys.exit(main())
