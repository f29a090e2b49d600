"""Per-step times and a rank's CPU per step of examples/train_ddp.py's model, 2 ranks on one machine:

torchrun --standalone --nproc-per-node 2 docs/results/session30/steps.py BACKEND BATCH [no-comm]
"""

import os
import statistics
import sys
import time

import torch
import torch.distributed as dist
import torch.nn as nn
from torch.nn.parallel import DistributedDataParallel as DDP

import torch_bps  # noqa: F401 - registers "byteps"

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", "..", "..", "examples"))
from train_ddp import TinyLM, _no_comm, synthetic_batch  # noqa: E402


def main() -> None:
    backend, batch, no_comm = sys.argv[1], int(sys.argv[2]), len(sys.argv) > 3
    dist.init_process_group(backend)
    rank = dist.get_rank()
    torch.manual_seed(0)
    model = DDP(TinyLM(512, 128, 2, 4, 32))
    if no_comm:
        model.register_comm_hook(None, _no_comm)
    opt = torch.optim.AdamW(model.parameters(), lr=3e-3)
    times, warm, cpu0 = [], 20, 0.0
    for step in range(400):
        t0 = time.perf_counter()
        tokens, targets = synthetic_batch(step, rank, batch, 32, 512)
        loss = nn.functional.cross_entropy(model(tokens).flatten(0, 1), targets.flatten())
        opt.zero_grad(set_to_none=True)
        loss.backward()
        opt.step()
        times.append(time.perf_counter() - t0)
        if step == warm:
            cpu0 = time.process_time()
    cpu = (time.process_time() - cpu0) / (len(times) - warm - 1) * 1e3
    t = sorted(times[warm:])

    def ms(q: float) -> float:
        return t[int(q * (len(t) - 1))] * 1e3

    if rank == 0:
        name = f"{backend}{' no-comm' if no_comm else ''} batch {batch}"
        print(
            f"{name}: cpu {cpu:.2f} ms/step; step mean {statistics.mean(t) * 1e3:.2f} ms, p10 {ms(0.1):.2f} "
            f"p50 {ms(0.5):.2f} p90 {ms(0.9):.2f} p99 {ms(0.99):.2f}",
            flush=True,
        )
    del model, opt
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
