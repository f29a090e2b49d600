import time, torch, torch.distributed as dist
import torch_bps
dist.init_process_group("byteps")
ts = [torch.ones(1 << 20) for _ in range(16)]  # 16 x 4 MiB
def burst():
    ws = [dist.all_reduce(t, async_op=True) for t in ts]
    for w in ws: w.wait()
for _ in range(3): burst()
dist.barrier()
n = 30; t0 = time.perf_counter(); c0 = time.process_time()
for _ in range(n): burst()
dt = (time.perf_counter() - t0) / n; dc = (time.process_time() - c0) / n
if dist.get_rank() == 0: print(f"burst 16x4MiB: {dt*1e3:.1f} ms ({64/dt/1e3:.2f} GB/s per rank), CPU {dc*1e3:.1f} ms")
dist.destroy_process_group()
