"""One rank of the compression measurement: DDP trains straggler_train's student MLP under one communication mode.

    python -m benchmarks.cluster.workers.compress_train --rank 0 --world 4 --store 10.77.0.1:29600 --mode byteps-topk

Modes: gloo (fp32), gloo-fp16 (torch's fp16_compress_hook), gloo-powersgd (torch's PowerSGD hook, rank 2), and on
the "byteps" backend: byteps (fp32), byteps-bf16, byteps-onebit, byteps-topk (bps_hook; the orchestrator sets
BPS_WIRE_DTYPE / BPS_COMPRESSOR), byteps-powersgd (torch's PowerSGD hook on the "byteps" group). Rank 0 keeps its
parameters after every step and scores each on the held-out set once training is over (no evaluation inside any
clock); PowerSGD runs with one bucket (see below). Prints one RESULT line: wall seconds, the accuracy curve, bytes
on this host's link per step, a hash of the parameters (replicas must agree).
May import: the standard library, torch, torch_bps and benchmarks.cluster.workers.{common,ddp_train,straggler_train}.
"""

from __future__ import annotations

import argparse
import hashlib
import time
from datetime import timedelta

from benchmarks.cluster.workers.common import emit, score_snapshots, store
from benchmarks.cluster.workers.ddp_train import link_bytes
from benchmarks.cluster.workers.straggler_train import CLASSES, INPUTS, TEST, teacher_labels

MODES = ("gloo", "gloo-fp16", "gloo-powersgd", "byteps", "byteps-bf16", "byteps-onebit", "byteps-topk",
         "byteps-powersgd")  # fmt: skip


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--rank", type=int, required=True)
    p.add_argument("--world", type=int, required=True)
    p.add_argument("--store", required=True)
    p.add_argument("--mode", choices=MODES, required=True)
    p.add_argument("--steps", type=int, default=200)
    p.add_argument("--batch", type=int, default=256)
    p.add_argument("--hidden", type=int, default=1024)
    p.add_argument("--timeout", type=float, default=300.0)
    args = p.parse_args(argv)

    import torch
    import torch.distributed as dist
    import torch.nn.functional as F
    from torch.distributed.algorithms.ddp_comm_hooks import default_hooks, powerSGD_hook
    from torch.nn.parallel import DistributedDataParallel as DDP
    from torch.nn.utils import parameters_to_vector

    import torch_bps

    torch.set_num_threads(1)
    backend = "byteps" if args.mode.startswith("byteps") else "gloo"
    rendezvous = store(args.store, args.rank, args.world, args.timeout)
    dist.init_process_group(backend, store=rendezvous, rank=args.rank, world_size=args.world,
                            timeout=timedelta(seconds=args.timeout))  # fmt: skip
    sync = dist.new_group(backend="gloo")
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(INPUTS, args.hidden), torch.nn.ReLU(),
                                torch.nn.Linear(args.hidden, args.hidden), torch.nn.ReLU(),
                                torch.nn.Linear(args.hidden, CLASSES))  # fmt: skip
    if args.mode.endswith("powersgd"):
        # One bucket: PowerSGD's hook issues its own all-reduces from each bucket's callbacks, which with several
        # buckets run in an order that differs across ranks (gloo then fails on mismatched sizes, "byteps" on keys).
        dist._DEFAULT_FIRST_BUCKET_BYTES = 1 << 30
    ddp = DDP(model, bucket_cap_mb=1024 if args.mode.endswith("powersgd") else 25)
    if args.mode == "gloo-fp16":
        ddp.register_comm_hook(None, default_hooks.fp16_compress_hook)
    elif args.mode.endswith("powersgd"):
        state = powerSGD_hook.PowerSGDState(process_group=None, matrix_approximation_rank=2, start_powerSGD_iter=10)
        ddp.register_comm_hook(state, powerSGD_hook.powerSGD_hook)
    elif backend == "byteps":
        ddp.register_comm_hook(torch_bps.BpsHookState(module=model), torch_bps.bps_hook)
    opt = torch.optim.SGD(ddp.parameters(), lr=0.05, momentum=0.9)
    data = torch.Generator().manual_seed(100 + args.rank)
    test_x = torch.randn(TEST, INPUTS, generator=torch.Generator().manual_seed(7))
    test_y = teacher_labels(test_x)
    snapshots = [(0.0, 0, parameters_to_vector(model.parameters()).detach().clone())]  # rank 0: after each step

    dist.barrier(group=sync)
    link0 = link_bytes()
    start = time.perf_counter()
    for step in range(args.steps):
        opt.zero_grad(set_to_none=True)
        x = torch.randn(args.batch, INPUTS, generator=data)
        F.cross_entropy(ddp(x), teacher_labels(x)).backward()
        opt.step()
        if args.rank == 0:
            snapshots.append((time.perf_counter() - start, step + 1, parameters_to_vector(model.parameters()).clone()))
    seconds = time.perf_counter() - start
    link1 = link_bytes()
    curve = score_snapshots(model, snapshots, test_x, test_y) if args.rank == 0 else []
    snapshots.clear()
    params = hashlib.sha256(b"".join(q.detach().numpy().tobytes() for q in model.parameters())).hexdigest()
    emit({"rank": args.rank, "seconds": seconds, "steps": args.steps, "curve": curve, "params": params,
          "link_bytes_per_step": (link1["tx"] - link0["tx"] + link1["rx"] - link0["rx"]) / args.steps})  # fmt: skip
    dist.barrier(group=sync)
    dist.destroy_process_group()
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
