"""Time back-to-back dist.all_reduce calls of one size on a backend, 2 ranks on one machine:

torchrun --standalone --nproc-per-node 2 docs/results/session29/latency.py byteps 2097152
"""

import sys
import time

import torch
import torch.distributed as dist

import torch_bps  # noqa: F401 - registers "byteps"


def main() -> None:
    backend, nbytes = sys.argv[1], int(sys.argv[2])
    dist.init_process_group(backend)
    t = torch.ones(max(1, nbytes // 4))
    for _ in range(20):
        dist.all_reduce(t)
    dist.barrier()
    n = 300
    c0, t0 = time.process_time(), time.perf_counter()
    for _ in range(n):
        dist.all_reduce(t)
    dt, dc = time.perf_counter() - t0, time.process_time() - c0
    if dist.get_rank() == 0:
        print(f"{backend} {nbytes >> 10} KiB: {dt / n * 1e3:.3f} ms per all_reduce, process CPU {dc / n * 1e3:.3f} ms")
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
