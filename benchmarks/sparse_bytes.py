"""Bytes on the wire per DDP step with a sparse embedding on "byteps": the rows touched, not the table.

Spawns `world` ranks on this machine, one worker each (BPS_LOCAL_REDUCE=0: each rank stands for a machine), and
trains an `nn.Embedding(--rows, --dim, sparse=True)` (mean of --ids ids per sample) under a linear head with DDP,
counting the payload bytes the summation servers received and sent over the measured steps (their STATS
`bytes_in` + `bytes_out`). Next to it, per step:
- dense: what the same model moves with `sparse=False` (the whole table summed every step);
- ideal: what a parameter server must move: each rank pushes the rows it touched (a row index and its values)
  and pulls the rows any rank touched, plus the head's dense sum; computed from the batches every rank drew.
Also compares the parameters after training with the same run on gloo.

Usage: python benchmarks/sparse_bytes.py [--worlds 2,4] [--steps 5] [--json out.json]
May import: the standard library, torch and torch_bps.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import traceback
from datetime import timedelta

import torch
import torch.distributed as dist

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, REPO)

from benchmarks.fsdp_bytes import server_bytes, spawn_ranks  # noqa: E402


class Model(torch.nn.Module):
    def __init__(self, rows: int, dim: int, sparse: bool):
        super().__init__()
        self.emb = torch.nn.Embedding(rows, dim, sparse=sparse)
        self.head = torch.nn.Linear(dim, 1)

    def forward(self, ids):
        return self.head(self.emb(ids).mean(dim=1))


def batch(rank: int, step: int, args) -> tuple[torch.Tensor, torch.Tensor]:
    """Rank `rank`'s batch of step `step`: the same on every backend, and known to every rank."""
    g = torch.Generator().manual_seed(1000 * rank + step)
    # Skewed towards low ids, as word and item frequencies are: ranks share some rows and not others.
    ids = (torch.rand(args.batch, args.ids, generator=g).pow(3) * args.rows).long()
    return ids, torch.randn(args.batch, 1, generator=g)


def ideal_bytes(world: int, steps: range, args) -> int:
    """A parameter server's bytes for the measured steps: rows touched up, rows of the union down, the head dense."""
    row = args.dim * 4 + 8  # the values and a row index
    head = (args.dim + 1) * 4
    total = 0
    for step in steps:
        touched = [batch(r, step, args)[0].unique() for r in range(world)]
        union = torch.cat(touched).unique().numel()
        total += sum(t.numel() for t in touched) * row + world * union * row + 2 * world * head
    return total


def _rank(rank: int, world: int, port: int, backend: str, sparse: bool, args, results) -> None:
    os.environ.update(BPS_LOCAL_REDUCE="0", OMP_NUM_THREADS="1")
    try:
        import torch_bps  # noqa: F401 - registers "byteps"

        dist.init_process_group(backend, init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=world,
                                timeout=timedelta(seconds=300))  # fmt: skip
        gloo = dist.new_group(backend="gloo") if backend == "byteps" else dist.group.WORLD
        torch.manual_seed(0)
        model = torch.nn.parallel.DistributedDataParallel(Model(args.rows, args.dim, sparse))
        opt = torch.optim.SGD(model.parameters(), lr=0.5)

        def step(i: int) -> None:
            ids, target = batch(rank, i, args)
            opt.zero_grad()
            torch.nn.functional.mse_loss(model(ids), target).backward()
            opt.step()

        step(0)  # warm-up: DDP's first step, keys declared
        dist.barrier(group=gloo)
        before = server_bytes() if backend == "byteps" and rank == 0 else 0
        dist.barrier(group=gloo)  # nobody starts the next step before rank 0 read the counters
        for i in range(1, args.steps + 1):
            step(i)
        dist.barrier(group=gloo)  # every rank's collectives finished: the counters are final
        measured = (server_bytes() - before) if backend == "byteps" and rank == 0 else 0
        params = torch.cat([p.detach().reshape(-1) for p in model.parameters()]).numpy().tobytes()
        dist.barrier(group=gloo)
        results.put((rank, "ok", (measured, params)))
        dist.destroy_process_group()
    except BaseException:  # noqa: BLE001
        results.put((rank, "error", traceback.format_exc()))


def main(argv: list[str] | None = None) -> dict:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--worlds", default="2,4", help="world sizes, comma-separated")
    p.add_argument("--steps", type=int, default=5, help="measured training steps (after one warm-up step)")
    p.add_argument("--rows", type=int, default=100_000, help="the embedding table's rows")
    p.add_argument("--dim", type=int, default=64)
    p.add_argument("--batch", type=int, default=32)
    p.add_argument("--ids", type=int, default=8, help="ids per sample")
    p.add_argument("--json", help="write the results here")
    args = p.parse_args(argv)
    rows = []
    for world in [int(w) for w in args.worlds.split(",")]:
        bps = spawn_ranks(_rank, world, "byteps", True, args)
        dense = spawn_ranks(_rank, world, "byteps", False, args)
        ref = spawn_ranks(_rank, world, "gloo", True, args)
        ideal = ideal_bytes(world, range(1, args.steps + 1), args)
        floats = [torch.frombuffer(bytearray(b[1]), dtype=torch.float32) for b in bps]
        diff = max(float((f - torch.frombuffer(bytearray(r[1]), dtype=torch.float32)).abs().max())
                   for f, r in zip(floats, ref, strict=True))  # fmt: skip
        moved, table = bps[0][0], dense[0][0]
        row = dict(world=world, steps=args.steps, sparse_per_step=moved / args.steps,
                   dense_per_step=table / args.steps, ideal_per_step=ideal / args.steps,
                   vs_ideal=moved / ideal, vs_dense=moved / table, max_param_diff_vs_gloo=diff)  # fmt: skip
        rows.append(row)
        print(f"world {world}: sparse {row['sparse_per_step'] / 1e6:.3f} MB/step on the wire (servers' STATS), "
              f"ideal {row['ideal_per_step'] / 1e6:.3f} ({row['vs_ideal']:.2f}x), dense table "
              f"{row['dense_per_step'] / 1e6:.3f} ({row['vs_dense']:.4f}x); parameters vs gloo's: max |difference| "
              f"{diff:.3g}")  # fmt: skip
    result = dict(model=dict(rows=args.rows, dim=args.dim, batch=args.batch, ids=args.ids), results=rows)
    if args.json:
        with open(args.json, "w") as f:
            json.dump(result, f, indent=2)
    return result


if __name__ == "__main__":
    main()
