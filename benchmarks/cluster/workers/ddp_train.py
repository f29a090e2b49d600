"""One rank of the DDP measurement: a communication-bound MLP on synthetic data, samples/s per backend.

    python -m benchmarks.cluster.workers.ddp_train --backend gloo --rank 0 --world 4 \
        --store 10.77.0.1:29600 --hidden 2048 --layers 6 --batch 16

`--layers` square Linear layers of `--hidden` units: 6 x 2048^2 is 25 M parameters, 100 MB of fp32
gradients per step against ~2 GFLOP of compute for a batch of 16, so the links, not the 2 cores, set
the pace. `--backend byteps` needs `import torch_bps` to register a "byteps" process group (servers from
BPS_SERVERS); until it does, the rank exits with code 3 and says so.
May import: the standard library, torch, torch_bps and benchmarks.cluster.{cpu,workers.common}.
"""

from __future__ import annotations

import argparse
import time
from datetime import timedelta

from benchmarks.cluster.cpu import CpuWindow
from benchmarks.cluster.workers.common import emit, fail, store

UNAVAILABLE_EXIT = 3


def build_model(hidden: int, layers: int):
    """Return the MLP: `layers` x (Linear(hidden, hidden) + ReLU), hidden^2 + hidden parameters each."""
    import torch.nn as nn

    blocks = []
    for _ in range(layers):
        blocks += [nn.Linear(hidden, hidden), nn.ReLU()]
    return nn.Sequential(*blocks)


def require_byteps_backend() -> None:
    """Import torch_bps and check it registered the "byteps" process group; exit 3 with the reason if not."""
    import torch.distributed as dist

    try:
        import torch_bps  # noqa: F401  (registration is a side effect of the import)
    except Exception as e:
        fail(f"byteps backend unavailable: import torch_bps failed: {e!r}", UNAVAILABLE_EXIT)
    if "byteps" not in dist.Backend.backend_list:
        fail("byteps backend unavailable: `import torch_bps` registered no 'byteps' process group", UNAVAILABLE_EXIT)


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__)
    p.add_argument("--backend", choices=["gloo", "byteps"], required=True)
    p.add_argument("--rank", type=int, required=True)
    p.add_argument("--world", type=int, required=True)
    p.add_argument("--store", required=True)
    p.add_argument("--hidden", type=int, default=2048)
    p.add_argument("--layers", type=int, default=6)
    p.add_argument("--batch", type=int, default=16)
    p.add_argument("--steps", type=int, default=5)
    p.add_argument("--warmup", type=int, default=2)
    p.add_argument("--timeout", type=float, default=300.0)
    args = p.parse_args(argv)

    import torch
    import torch.distributed as dist
    import torch.nn.functional as F
    from torch.nn.parallel import DistributedDataParallel as DDP

    torch.set_num_threads(1)
    if args.backend == "byteps":
        require_byteps_backend()
    rendezvous = store(args.store, args.rank, args.world, args.timeout)
    dist.init_process_group(
        args.backend, store=rendezvous, rank=args.rank, world_size=args.world, timeout=timedelta(seconds=args.timeout)
    )
    torch.manual_seed(0)  # same initial weights everywhere (DDP broadcasts rank 0's anyway)
    model = DDP(build_model(args.hidden, args.layers))
    optimizer = torch.optim.SGD(model.parameters(), lr=1e-3)
    gen = torch.Generator().manual_seed(args.rank)
    x = torch.randn(args.batch, args.hidden, generator=gen)
    y = torch.randn(args.batch, args.hidden, generator=gen)

    def step() -> None:
        optimizer.zero_grad(set_to_none=True)
        F.mse_loss(model(x), y).backward()  # DDP's all-reduce runs in here, overlapped by bucket
        optimizer.step()

    for _ in range(args.warmup):
        step()
    dist.barrier()
    cpu = CpuWindow().start()
    start = time.perf_counter()
    for _ in range(args.steps):
        step()
    elapsed = time.perf_counter() - start
    params = sum(q.numel() for q in model.parameters())
    emit(
        {
            "rank": args.rank,
            "seconds": elapsed,
            "steps": args.steps,
            "batch": args.batch,
            "params": params,
            "cpu": cpu.stop(),
        }
    )
    dist.destroy_process_group()
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
