"""A small collective on one machine, through the backend, the engine, and the local stages alone:

torchrun --standalone --nproc-per-node 2 docs/results/session29/latency_parts.py
"""

import time

import torch
import torch.distributed as dist

from torch_bps import runtime


def timeit(name: str, f, n: int = 500) -> None:
    dist.barrier()
    f()
    t0, c0 = time.perf_counter(), time.process_time()
    for _ in range(n):
        f()
    dt, dc = (time.perf_counter() - t0) / n * 1e6, (time.process_time() - c0) / n * 1e6
    if dist.get_rank() == 0:
        print(f"{name}: {dt:.0f} us, CPU {dc:.0f} us")


def main() -> None:
    dist.init_process_group("byteps")
    t = torch.ones(1)
    for _ in range(50):
        dist.all_reduce(t)
    rt = runtime._RUNTIMES["default"]
    rs, ag = rt._local
    x = torch.ones(256)
    lo, hi = rs.slice_range(x.numel())

    def local_only() -> None:
        ag.all_gather(rs.reduce_scatter(x, out=x[lo:hi]), x)

    timeit("dist.all_reduce 4B", lambda: dist.all_reduce(t))
    timeit("engine.push_pull 1KB", lambda: rt._engine.push_pull(x).wait())
    timeit("rs+ag direct 1KB", local_only)
    timeit("rs only 1KB", lambda: rs.reduce_scatter(x, out=x[lo:hi]))
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
