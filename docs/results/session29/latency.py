import os, sys, time, torch, torch.distributed as dist
import torch_bps  # noqa: registers "byteps"
backend = sys.argv[1]; nbytes = int(sys.argv[2])
dist.init_process_group(backend)
t = torch.ones(nbytes // 4)
for _ in range(20): dist.all_reduce(t)
dist.barrier()
n = 300
c0 = time.process_time(); t0 = time.perf_counter()
for _ in range(n): dist.all_reduce(t)
dt = time.perf_counter() - t0; dc = time.process_time() - c0
if dist.get_rank() == 0: print(f"{backend} {nbytes>>10} KiB: {dt/n*1e3:.3f} ms per all_reduce, process CPU {dc/n*1e3:.3f} ms")
dist.destroy_process_group()
