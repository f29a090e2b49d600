"""Bytes on the wire per FSDP2 training step on "byteps", against a parameter server's ideal.

Spawns `world` ranks on this machine, one worker each (BPS_LOCAL_REDUCE=0: each rank stands for a machine),
trains a small MLP stack wrapped with `torch.distributed.fsdp.fully_shard` (every block and the root), and
counts, over the measured steps, the payload bytes the summation servers received and sent (their STATS
counters `bytes_in` + `bytes_out`). The ideal is what a parameter server must move for the collectives FSDP2
issued, logged as they are issued: each shard up once and down once per rank that needs it (all-gather:
world x shard up, world^2 x shard down; reduce-scatter: world x input up, world x shard down; all-reduce:
world x tensor each way; broadcast: the tensor up once, down world - 1 times). Also compares the
parameters after training with those of the same run on gloo.

Usage: python benchmarks/fsdp_bytes.py [--worlds 2,4] [--steps 3] [--json out.json]
`log_collectives`, `ideal_bytes` and `server_bytes` also count the FSDP2 runs of the emulated cluster
(benchmarks/cluster, `--fsdp`).
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

from benchmarks._harness import spawn_ranks  # noqa: E402


def _model(width: int, depth: int) -> torch.nn.Module:
    torch.manual_seed(0)
    blocks = [torch.nn.Sequential(torch.nn.Linear(width, 4 * width), torch.nn.GELU(), torch.nn.Linear(4 * width, width))
              for _ in range(depth)]  # fmt: skip
    return torch.nn.Sequential(*blocks, torch.nn.LayerNorm(width))


def ideal_bytes(calls: list[tuple[str, int, int]], world: int) -> int:
    """A parameter server's bytes (up + down) for the logged collectives: (op, input bytes, output bytes)."""
    total = 0
    for op, nin, nout in calls:
        if op in ("all_gather_single", "reduce_scatter_single"):
            total += world * nin + world * nout
        elif op == "allreduce":
            total += 2 * world * nin
        elif op == "broadcast":
            total += nin + (world - 1) * nin
        else:
            raise RuntimeError(f"FSDP2 issued {op}, which this benchmark has no ideal for")
    return total


def log_collectives(calls: list) -> None:
    """Record every collective the byteps process group runs, with its input and output bytes."""
    from torch_bps.process_group import BackendBPS

    def nbytes(t) -> int:
        return t.numel() * t.element_size()

    def wrap(name, sizes, as_name=None):
        original = getattr(BackendBPS, name)

        def logged(self, *args, **kwargs):
            calls.extend((as_name or name, nin, nout) for nin, nout in sizes(*args))
            return original(self, *args, **kwargs)

        setattr(BackendBPS, name, logged)

    def pairs(outs, ins, *_):
        return [(nbytes(i), nbytes(o)) for o, i in zip(outs, ins, strict=True)]

    wrap("all_gather_single", lambda out, inp, *_: [(nbytes(inp), nbytes(out))])
    wrap("reduce_scatter_single", lambda out, inp, *_: [(nbytes(inp), nbytes(out))])
    wrap("all_gather_single_coalesced", pairs, "all_gather_single")
    wrap("reduce_scatter_single_coalesced", pairs, "reduce_scatter_single")
    wrap("allreduce", lambda ts, *_: [(nbytes(ts[0]), nbytes(ts[0]))])
    wrap("broadcast", lambda ts, *_: [(nbytes(ts[0]), nbytes(ts[0]))])
    for other in ("allgather", "reduce_scatter", "allgather_coalesced", "allreduce_coalesced"):
        wrap(other, _unlogged(other))


def _unlogged(name: str):
    def sizes(*_):
        raise RuntimeError(f"FSDP2 issued {name}, which this benchmark does not count")

    return sizes


def _floats(data: bytes) -> torch.Tensor:
    return torch.frombuffer(bytearray(data), dtype=torch.float32)


def server_bytes() -> int:
    """Return the payload bytes every server of this job has received plus sent so far (their STATS)."""
    from torch_bps import implementation

    client = implementation().runtime._client
    stats = [client.server_stats(i) for i in range(len(client.servers))]
    return sum(s["bytes_in"] + s["bytes_out"] for s in stats)


def _rank(rank: int, world: int, port: int, backend: str, args, results) -> None:
    os.environ.update(BPS_LOCAL_REDUCE="0", OMP_NUM_THREADS="1")
    try:
        from torch.distributed.fsdp import fully_shard

        import torch_bps  # noqa: F401 - registers "byteps"

        calls: list[tuple[str, int, int]] = []
        if backend == "byteps":
            log_collectives(calls)
        dist.init_process_group(backend, init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=world,
                                timeout=timedelta(seconds=300))  # fmt: skip
        gloo = dist.new_group(backend="gloo") if backend == "byteps" else dist.group.WORLD
        model = _model(args.width, args.depth)
        for block in model[:-1]:
            fully_shard(block)
        fully_shard(model)
        opt = torch.optim.SGD(model.parameters(), lr=0.01)
        g = torch.Generator().manual_seed(rank)

        def step() -> None:
            x = torch.randn(args.batch, args.width, generator=g)
            model(x).pow(2).mean().backward()
            opt.step()
            opt.zero_grad()

        step()  # warm-up: keys declared, buffers allocated
        dist.barrier(group=gloo)
        calls.clear()
        before = server_bytes() if backend == "byteps" and rank == 0 else 0
        dist.barrier(group=gloo)  # nobody starts the next step before rank 0 read the counters
        for _ in range(args.steps):
            step()
        dist.barrier(group=gloo)  # every rank's collectives finished: the counters are final
        measured = (server_bytes() - before) if backend == "byteps" and rank == 0 else 0
        # Before full_tensor() below, whose all-gathers are not a step's.
        ideal = ideal_bytes(calls, world) if calls else 0
        # As bytes: a tensor through a multiprocessing queue is a shared-memory handle that dies with this process.
        params = torch.cat([p.full_tensor().detach().reshape(-1) for p in model.parameters()]).numpy().tobytes()
        dist.barrier(group=gloo)
        results.put((rank, "ok", (measured, ideal, params)))
        dist.destroy_process_group()
    except BaseException:  # noqa: BLE001
        results.put((rank, "error", traceback.format_exc()))


def main(argv: list[str] | None = None) -> dict:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--worlds", default="2,4", help="world sizes, comma-separated")
    p.add_argument("--steps", type=int, default=3, help="measured training steps (after one warm-up step)")
    p.add_argument("--width", type=int, default=256)
    p.add_argument("--depth", type=int, default=4)
    p.add_argument("--batch", type=int, default=8)
    p.add_argument("--json", help="write the results here")
    args = p.parse_args(argv)
    rows = []
    for world in [int(w) for w in args.worlds.split(",")]:
        bps = spawn_ranks(_rank, world, "byteps", args)
        ref = spawn_ranks(_rank, world, "gloo", args)
        measured, ideal, _ = bps[0]
        # Sums of more than two values depend on the order they are added in (the server adds pushes as they
        # arrive), so beyond 2 ranks the parameters agree with gloo's to rounding, not bit for bit.
        diff = max(float((_floats(b[2]) - _floats(r[2])).abs().max()) for b, r in zip(bps, ref, strict=True))
        row = dict(world=world, steps=args.steps, bytes_per_step=measured / args.steps,
                   ideal_per_step=ideal / args.steps, ratio=measured / ideal, max_param_diff_vs_gloo=diff)  # fmt: skip
        rows.append(row)
        print(f"world {world}: {row['bytes_per_step'] / 1e6:.3f} MB/step on the wire (servers' STATS), ideal "
              f"{row['ideal_per_step'] / 1e6:.3f} MB/step, ratio {row['ratio']:.4f}; "
              f"parameters vs gloo's: max |difference| {diff:.3g}")  # fmt: skip
    result = dict(model=dict(width=args.width, depth=args.depth, batch=args.batch), rows=rows)
    if args.json:
        with open(args.json, "w") as f:
            json.dump(result, f, indent=2)
    return result


if __name__ == "__main__":
    main()
