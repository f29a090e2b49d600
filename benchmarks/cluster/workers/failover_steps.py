"""One rank of benchmarks/failover_cost.py: all_reduce through the "byteps" backend, timing every step.

Prints "step I" as each step ends (the orchestrator kills a server on it), then the RESULT line with every step's
seconds and what the failovers did. Rendezvous from MASTER_ADDR/MASTER_PORT/RANK/WORLD_SIZE (env://).
May import: the standard library, torch, torch_bps and benchmarks.cluster.workers.common.
"""

from __future__ import annotations

import argparse
import time

import torch
import torch.distributed as dist

import torch_bps  # noqa: F401 - registers the backend
from benchmarks.cluster.workers.common import emit
from torch_bps.runtime import _RUNTIMES


def main() -> None:
    p = argparse.ArgumentParser()
    p.add_argument("--mb", type=float, default=16.0, help="MB summed per step, in 4 MB tensors (DDP-like buckets)")
    p.add_argument("--steps", type=int, default=30)
    args = p.parse_args()
    dist.init_process_group("byteps")
    numel = int(args.mb * 1e6 / 4)
    buckets = [torch.ones(min(1_000_000, numel - s)) for s in range(0, numel, 1_000_000)]
    seconds = []
    for step in range(args.steps):
        start = time.perf_counter()
        works = [dist.all_reduce(b, async_op=True) for b in buckets]
        for w in works:
            w.wait()
        seconds.append(time.perf_counter() - start)
        print(f"step {step}", flush=True)
    router = _RUNTIMES["default"]._engine.router
    emit({"seconds": seconds, "failovers": router.failovers if router is not None else []})
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
