"""One rank of the gloo all_reduce measurement: S bytes of fp32 summed over all ranks per step.

    GLOO_SOCKET_IFNAME=bps0 python -m benchmarks.cluster.workers.gloo_allreduce \
        --rank 0 --world 4 --store 10.77.0.1:29500 --size-bytes 67108864 --steps 5 --warmup 2

Warm-up steps (connection set-up, first-touch of buffers) are excluded; a barrier lines the ranks up
before the clock starts. Prints the mean seconds per step of this rank and its CPU use.
May import: the standard library, torch and benchmarks.cluster.{cpu,workers.common}.
"""

from __future__ import annotations

import argparse
from datetime import timedelta

from benchmarks.cluster.cpu import CpuWindow
from benchmarks.cluster.workers.common import emit, settle, store, timed_steps


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__)
    p.add_argument("--rank", type=int, required=True)
    p.add_argument("--world", type=int, required=True)
    p.add_argument("--store", required=True, help="ip:port of the TCPStore, hosted by rank 0")
    p.add_argument("--size-bytes", type=int, required=True)
    p.add_argument("--steps", type=int, default=5)
    p.add_argument("--warmup", type=int, default=5)
    p.add_argument("--timeout", type=float, default=300.0)
    args = p.parse_args(argv)

    import torch
    import torch.distributed as dist

    # n ranks share 2 cores: one intra-op thread each, or they fight over the cores while summing.
    torch.set_num_threads(1)
    rendezvous = store(args.store, args.rank, args.world, args.timeout)
    dist.init_process_group(
        "gloo", store=rendezvous, rank=args.rank, world_size=args.world, timeout=timedelta(seconds=args.timeout)
    )
    tensor = torch.ones(args.size_bytes // 4, dtype=torch.float32)
    for _ in range(args.warmup):
        dist.all_reduce(tensor)
    settle()
    dist.barrier()
    cpu = CpuWindow().start()
    steps = timed_steps(lambda: dist.all_reduce(tensor), args.steps)
    cpu = cpu.stop()
    emit({"rank": args.rank, "seconds_per_step": sum(steps) / args.steps, "steps": [round(s, 4) for s in steps],
          "cpu": cpu})  # fmt: skip
    dist.destroy_process_group()
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
