"""DDP training for tests/faults/test_faults.py, run by torchrun: prints a line per step and, when training fails,
writes <outcome-dir>/rank<R>.json naming the error (type, message with notes, wall time) before re-raising.

Faults it can inject into itself: a rank that stalls (sleeps) at a step, a rank that SIGKILLs itself.
"""

from __future__ import annotations

import argparse
import gc
import json
import os
import signal
import sys
import time

import torch
import torch.distributed as dist
from torch.nn.parallel import DistributedDataParallel

import torch_bps


def say(line: str) -> None:
    """Print `line` in one write: the ranks share torchrun's pipe, and print() writes a line and its end apart."""
    sys.stdout.write(line + "\n")
    sys.stdout.flush()


def main() -> None:
    p = argparse.ArgumentParser()
    p.add_argument("--backend", default="byteps", choices=["byteps", "gloo"])
    p.add_argument("--hook", action="store_true", help="send the gradient buckets through torch_bps.bps_hook")
    p.add_argument("--buffers", action="store_true", help="a BatchNorm, so every forward broadcasts buffers")
    p.add_argument("--steps", type=int, default=100_000)
    p.add_argument("--outcome", required=True, help="directory for rank<R>.json")
    p.add_argument("--stall", default="", help="RANK:STEP:SECONDS: that rank sleeps before that step")
    p.add_argument("--die", default="", help="RANK:STEP: that rank SIGKILLs itself before that step")
    args = p.parse_args()
    torch.manual_seed(0)
    dist.init_process_group(args.backend)
    rank = dist.get_rank()
    say(f"rank {rank} pid {os.getpid()}")
    layers = [torch.nn.Linear(64, 256), torch.nn.ReLU(), torch.nn.Linear(256, 64)]
    if args.buffers:
        layers.insert(1, torch.nn.BatchNorm1d(256))
    ddp = DistributedDataParallel(torch.nn.Sequential(*layers), broadcast_buffers=args.buffers, bucket_cap_mb=0.05)
    if args.hook:
        ddp.register_comm_hook(torch_bps.BpsHookState(), torch_bps.bps_hook)
    opt = torch.optim.SGD(ddp.parameters(), lr=0.01)
    # What exists now (torch, and the torch._dynamo DDP imported) lives until exit: out of the collector, whose
    # last pass over those million objects would hold up each rank's exit by about a second.
    gc.freeze()
    stall = [int(v) for v in args.stall.split(":")] if args.stall else None
    die = [int(v) for v in args.die.split(":")] if args.die else None
    try:
        for step in range(args.steps):
            if die and rank == die[0] and step == die[1]:
                say(f"dying at {time.time():.3f}")
                os.kill(os.getpid(), signal.SIGKILL)
            if stall and rank == stall[0] and step == stall[1]:
                say(f"stalling at {time.time():.3f}")
                time.sleep(stall[2])
            ddp(torch.randn(16, 64)).pow(2).mean().backward()
            opt.step()
            opt.zero_grad()
            say(f"rank {rank} step {step}")
            time.sleep(0.02)
    except Exception as e:
        outcome = {"rank": rank, "type": type(e).__name__, "at": time.time(),
                   "message": "\n".join([str(e), *getattr(e, "__notes__", [])])}  # fmt: skip
        with open(os.path.join(args.outcome, f"rank{rank}.json"), "w") as f:
            json.dump(outcome, f)
        raise
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
