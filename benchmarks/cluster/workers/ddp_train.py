"""One rank of the DDP or FSDP2 measurement: a communication-bound MLP on synthetic data, per backend.

    python -m benchmarks.cluster.workers.ddp_train --backend gloo --rank 0 --world 4 \
        --store 10.77.0.1:29600 --hidden 2048 --layers 6 --batch 16 [--wrap fsdp]

`--layers` square Linear layers of `--hidden` units: 6 x 2048^2 is 25 M parameters, 100 MB of fp32
gradients per step against ~2 GFLOP of compute for a batch of 16, so the links, not the 2 cores, set
the pace. `--backend byteps` needs `import torch_bps` to register a "byteps" process group (servers from
BPS_SERVERS); until it does, the rank exits with code 3 and says so.

`--hook fp16` registers torch's `fp16_compress_hook` on the DDP model (gradients summed as fp16, any backend);
`--bucket-view` wraps it with `gradient_as_bucket_view=True` (the gradients are views of DDP's buckets).

`--wrap fsdp` shards every Linear and the root with `fully_shard` instead of wrapping the model in DDP,
and counts bytes over the timed steps: this host's link (both backends), and on "byteps" the servers'
payload bytes (STATS, read by rank 0) next to a parameter server's ideal for the collectives FSDP2 issued.

`--wrap distopt` trains with torch_bps.byteps.DistributedOptimizer, `crossbarrier` / `crossbarrier-nopri` with its
CrossBarrier, priorities on / off (both on a "byteps" group); `alone` without any communication (the compute bound).
`--model convnet`: convolutions then Linear layers, layers of very different sizes (`--hidden` the Linear width).
May import: the standard library, torch, torch_bps and benchmarks.{fsdp_bytes,cluster.cpu,cluster.workers.common}.
"""

from __future__ import annotations

import argparse
import os
import resource
import time
from datetime import timedelta

from benchmarks.cluster.cpu import CpuWindow
from benchmarks.cluster.workers.common import emit, fail, settle, store

UNAVAILABLE_EXIT = 3


def build_model(hidden: int, layers: int):
    """Return the MLP: `layers` x (Linear(hidden, hidden) + ReLU), hidden^2 + hidden parameters each."""
    import torch.nn as nn

    blocks = []
    for _ in range(layers):
        blocks += [nn.Linear(hidden, hidden), nn.ReLU()]
    return nn.Sequential(*blocks)


def build_convnet(hidden: int):
    """Return a conv net on 3x32x32 images: small convolutions first, then two Linear layers of hidden units (most of
    the bytes, at the end of the forward pass: their gradients come first in the backward pass, needed last)."""
    import torch.nn as nn

    return nn.Sequential(
        nn.Conv2d(3, 32, 3, padding=1), nn.ReLU(), nn.MaxPool2d(2),
        nn.Conv2d(32, 64, 3, padding=1), nn.ReLU(), nn.MaxPool2d(2),
        nn.Conv2d(64, 128, 3, padding=1), nn.ReLU(), nn.MaxPool2d(2),
        nn.Flatten(), nn.Linear(128 * 4 * 4, hidden), nn.ReLU(), nn.Linear(hidden, hidden), nn.ReLU(),
        nn.Linear(hidden, 10),
    )  # fmt: skip


def link_bytes() -> dict:
    """Return the bytes this host's link (GLOO_SOCKET_IFNAME) has sent and received, IP and TCP headers included."""
    name = os.environ.get("GLOO_SOCKET_IFNAME", "bps0")
    with open("/proc/net/dev") as f:  # per network namespace, unlike a /sys not remounted for it
        for line in f:
            iface, _, counters = line.partition(":")
            if iface.strip() == name:
                fields = counters.split()
                return {"rx": int(fields[0]), "tx": int(fields[8])}
    return {"rx": 0, "tx": 0}


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
    p.add_argument("--warmup", type=int, default=5)
    p.add_argument("--timeout", type=float, default=300.0)
    p.add_argument(
        "--wrap",
        choices=["ddp", "fsdp", "distopt", "crossbarrier", "crossbarrier-nopri", "alone"],
        default="ddp",
        help="DDP, FSDP2 fully_shard, torch_bps.byteps's optimizers, or no communication",
    )
    p.add_argument("--model", choices=["mlp", "convnet"], default="mlp")
    p.add_argument("--hook", choices=["", "fp16"], default="", help="DDP: torch's fp16_compress_hook")
    p.add_argument("--bucket-view", action="store_true", help="DDP: gradient_as_bucket_view=True")
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
    model = build_model(args.hidden, args.layers) if args.model == "mlp" else build_convnet(args.hidden)
    trained = model  # what the forward pass runs
    calls: list[tuple[str, int, int]] = []  # the collectives FSDP2 issues on "byteps", for the ideal
    if args.wrap == "fsdp":
        from torch.distributed.fsdp import fully_shard

        from benchmarks import fsdp_bytes

        if args.backend == "byteps":
            fsdp_bytes.log_collectives(calls)
        for layer in model:
            if isinstance(layer, torch.nn.Linear):
                fully_shard(layer)
        fully_shard(model)
    elif args.wrap == "ddp":
        model = trained = DDP(model, gradient_as_bucket_view=args.bucket_view)
        if args.hook == "fp16":
            from torch.distributed.algorithms.ddp_comm_hooks import default_hooks

            model.register_comm_hook(None, default_hooks.fp16_compress_hook)
    # Barriers around the byte count go through gloo: a "byteps" barrier would show up in the servers' STATS.
    sync = dist.new_group(backend="gloo") if args.backend == "byteps" else dist.group.WORLD
    counts_servers = args.wrap == "fsdp" and args.backend == "byteps" and args.rank == 0
    optimizer = torch.optim.SGD(model.parameters(), lr=1e-3, momentum=0.9)
    total = args.warmup + args.steps
    if args.wrap == "distopt":
        import torch_bps.byteps as bps

        bps.init()
        optimizer = bps.DistributedOptimizer(optimizer, model.named_parameters())
    elif args.wrap.startswith("crossbarrier"):
        import torch_bps.byteps as bps

        bps.init()
        optimizer = bps.CrossBarrier(model, optimizer, model.named_parameters(), num_steps=total,
                                     priorities=args.wrap == "crossbarrier")  # fmt: skip
    gen = torch.Generator().manual_seed(args.rank)
    if args.model == "mlp":
        x = torch.randn(args.batch, args.hidden, generator=gen)
        y = torch.randn(args.batch, args.hidden, generator=gen)
        loss_of = F.mse_loss
    else:
        x = torch.randn(args.batch, 3, 32, 32, generator=gen)
        y = torch.randint(0, 10, (args.batch,), generator=gen)
        loss_of = F.cross_entropy

    def step() -> None:
        optimizer.zero_grad(set_to_none=True)
        loss_of(trained(x), y).backward()  # DDP's all-reduce runs in here, overlapped by bucket
        optimizer.step()  # CrossBarrier: returns at once; the last step waits for every update

    for _ in range(args.warmup):
        step()
    settle()
    dist.barrier(group=sync)
    calls.clear()
    servers0 = fsdp_bytes.server_bytes() if counts_servers else 0
    dist.barrier(group=sync)  # nobody starts the timed steps before rank 0 read the servers' counters
    link0 = link_bytes()
    cpu = CpuWindow().start()
    faults = resource.getrusage(resource.RUSAGE_SELF).ru_minflt  # fresh pages touched: they cost CPU here
    start = time.perf_counter()
    for _ in range(args.steps):
        step()
    if args.wrap.startswith("crossbarrier"):
        optimizer.synchronize()  # (the last step waited already) every update landed inside the timed steps
    elapsed = time.perf_counter() - start
    cpu_use = cpu.stop()
    link1 = link_bytes()
    result = {
        "rank": args.rank,
        "seconds": elapsed,
        "steps": args.steps,
        "batch": args.batch,
        "params": sum(q.numel() for q in model.parameters()),  # DTensor.numel() is the unsharded count
        "cpu": cpu_use,
        "minor_faults": resource.getrusage(resource.RUSAGE_SELF).ru_minflt - faults,
        "link_bytes": {d: link1[d] - link0[d] for d in ("tx", "rx")},
    }
    if args.wrap == "fsdp" and args.backend == "byteps":
        dist.barrier(group=sync)  # every rank's collectives finished: the servers' counters are final
        if counts_servers:
            result["server_bytes"] = fsdp_bytes.server_bytes() - servers0
            result["ideal_bytes"] = fsdp_bytes.ideal_bytes(calls, args.world)
    emit(result)
    dist.destroy_process_group()
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
