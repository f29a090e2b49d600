"""Train a small transformer with DDP over the "byteps" backend (or gloo, to compare). Synthetic data.

    torchrun --nproc-per-node 2 examples/train_ddp.py --steps 30
    torchrun --nproc-per-node 2 examples/train_ddp.py --steps 30 --backend gloo
    torchrun --nproc-per-node 2 examples/train_ddp.py --steps 30 --backend gloo --hook   # bps_hook on gloo

With no servers configured, "byteps" starts one embedded summation server per machine. For dedicated
CPU servers: run `bps-server --host 0.0.0.0 --port 9000` on them with BPS_POOL_CREDENTIAL set, and give torchrun the
same BPS_POOL_CREDENTIAL and BPS_SERVERS=host1:9000,host2:9000 (README: Security).
"""

from __future__ import annotations

import argparse
import gc
import logging
import os
import time

import torch
import torch.distributed as dist
import torch.nn as nn
from torch.nn.parallel import DistributedDataParallel as DDP

import torch_bps


class TinyLM(nn.Module):
    """A small causal transformer language model over a synthetic vocabulary."""

    def __init__(self, vocab: int, dim: int, layers: int, heads: int, seq: int):
        super().__init__()
        self.embed = nn.Embedding(vocab, dim)
        self.pos = nn.Parameter(torch.zeros(seq, dim))
        layer = nn.TransformerEncoderLayer(dim, heads, 4 * dim, dropout=0.0, batch_first=True, norm_first=True)
        self.blocks = nn.TransformerEncoder(layer, layers)
        self.head = nn.Linear(dim, vocab)
        self.register_buffer("mask", nn.Transformer.generate_square_subsequent_mask(seq), persistent=False)

    def forward(self, tokens: torch.Tensor) -> torch.Tensor:
        x = self.embed(tokens) + self.pos[: tokens.shape[1]]
        return self.head(self.blocks(x, mask=self.mask[: tokens.shape[1], : tokens.shape[1]], is_causal=True))


def synthetic_batch(step: int, rank: int, batch: int, seq: int, vocab: int) -> tuple[torch.Tensor, torch.Tensor]:
    """A learnable sequence task: each next token is (previous * 3 + 1) mod vocab, from a random start."""
    g = torch.Generator().manual_seed(step * 1000 + rank)
    start = torch.randint(0, vocab, (batch, 1), generator=g)
    seqs = [start]
    for _ in range(seq):
        seqs.append((seqs[-1] * 3 + 1) % vocab)
    tokens = torch.cat(seqs, dim=1)
    return tokens[:, :-1], tokens[:, 1:]


def _sync_only(state, bucket):
    """All-reduce one element and leave the bucket as it is: the ranks still wait for each other, no bytes move."""
    return dist.all_reduce(torch.ones(1), async_op=True).get_future().then(lambda _: bucket.buffer())


def _no_comm(state, bucket):  # no annotations: DDP checks them, and they are strings here
    """Leave the bucket as it is: the step without communication (the models on the ranks drift apart)."""
    future = torch.futures.Future()
    future.set_result(bucket.buffer())
    return future


def main(argv: list[str] | None = None) -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--backend", default="byteps", choices=["byteps", "gloo"])
    p.add_argument("--hook", action="store_true", help="register torch_bps.bps_hook on the DDP model")
    p.add_argument(
        "--no-comm",
        action="store_true",
        help="a DDP comm hook that sends nothing (gradients stay local): the step's bound for any backend",
    )
    p.add_argument(
        "--sync-only",
        action="store_true",
        help="a DDP comm hook that all-reduces one element per bucket on --backend and keeps the gradients local: "
        "the step with the ranks' synchronization and no bytes",
    )
    p.add_argument("--steps", type=int, default=30)
    p.add_argument("--batch", type=int, default=8)
    p.add_argument("--seq", type=int, default=32)
    p.add_argument("--dim", type=int, default=128)
    p.add_argument("--layers", type=int, default=2)
    p.add_argument("--vocab", type=int, default=512)
    p.add_argument("--lr", type=float, default=3e-3)
    p.add_argument("--log-every", type=int, default=10, help="print the loss every N steps")
    args = p.parse_args(argv)

    # torch_bps logs its server split and the expected t_opt at start-up (INFO, rank 0).
    logging.basicConfig(format="%(name)s %(levelname)s %(message)s")
    logging.getLogger("torch_bps").setLevel(os.environ.get("BPS_LOG_LEVEL", "INFO"))
    dist.init_process_group(args.backend)
    rank, world = dist.get_rank(), dist.get_world_size()
    torch.manual_seed(0)
    model = DDP(TinyLM(args.vocab, args.dim, args.layers, 4, args.seq))
    if args.hook:
        model.register_comm_hook(torch_bps.BpsHookState(), torch_bps.bps_hook)
    elif args.no_comm:
        model.register_comm_hook(None, _no_comm)
    elif args.sync_only:
        model.register_comm_hook(None, _sync_only)
    opt = torch.optim.AdamW(model.parameters(), lr=args.lr)
    grad_bytes = sum(p.numel() * p.element_size() for p in model.parameters())
    if rank == 0:
        print(
            f"backend={args.backend} hook={args.hook} no_comm={args.no_comm} sync_only={args.sync_only} world={world} "
            f"params={grad_bytes / 4 / 1e6:.2f}M",
            flush=True,
        )

    start = None
    for step in range(args.steps):
        if step == 1:
            start = time.perf_counter()  # step 0 builds buckets and connections: not timed
        tokens, targets = synthetic_batch(step, rank, args.batch, args.seq, args.vocab)
        loss = nn.functional.cross_entropy(model(tokens).flatten(0, 1), targets.flatten())
        opt.zero_grad(set_to_none=True)
        loss.backward()
        opt.step()
        if rank == 0 and (step % args.log_every == 0 or step == args.steps - 1):
            print(f"step {step:4d} loss {loss.item():.4f}", flush=True)
    elapsed = time.perf_counter() - start if start is not None else float("nan")
    timed = args.steps - 1
    if rank == 0 and timed > 0:
        print(
            f"{timed / elapsed:.2f} steps/s, {timed * args.batch * world / elapsed:.1f} samples/s, gradient "
            f"all-reduce throughput {timed * grad_bytes / elapsed / 1e6:.1f} MB/s per worker",
            flush=True,
        )
    # DDP (its reducer, which holds the comm hook) goes before the process group, while the interpreter is whole:
    # left to the collector at exit, it can abort the process ("terminate called without an active exception").
    del model, opt
    gc.collect()
    dist.destroy_process_group()


if __name__ == "__main__":
    os.environ.setdefault("OMP_NUM_THREADS", "1")
    main()
