"""Bursts of 16 asynchronous 4 MiB all-reduces on "byteps", 2 ranks on one machine:

torchrun --standalone --nproc-per-node 2 docs/results/session29/burst.py
"""

import time

import torch
import torch.distributed as dist

import torch_bps  # noqa: F401 - registers "byteps"


def main() -> None:
    dist.init_process_group("byteps")
    ts = [torch.ones(1 << 20) for _ in range(16)]

    def burst() -> None:
        for w in [dist.all_reduce(t, async_op=True) for t in ts]:
            w.wait()

    for _ in range(3):
        burst()
    dist.barrier()
    n = 30
    t0, c0 = time.perf_counter(), time.process_time()
    for _ in range(n):
        burst()
    dt, dc = (time.perf_counter() - t0) / n, (time.process_time() - c0) / n
    if dist.get_rank() == 0:
        print(f"burst 16x4MiB: {dt * 1e3:.1f} ms ({64 / dt / 1e3:.2f} GB/s per rank), CPU {dc * 1e3:.1f} ms")
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
