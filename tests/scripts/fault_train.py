"""DDP training for tests/faults (test_faults.py, test_failover.py), run by torchrun: deterministic data, a line per
step, and faults it injects into itself or, from rank 0, into summation servers.

--kill PID:STEP:WHEN[:stop] (several, comma-separated): rank 0 SIGKILLs server PID at step STEP, WHEN one of
  start     before the step's forward (no collective in flight)
  backward  inside the backward pass, when the last bucket's gradient is ready: earlier buckets are in flight
and with ":stop" the server is SIGSTOPped (silent, connections open) instead of SIGKILLed.
--stall RANK:STEP:SECONDS: that rank sleeps before that step. --die RANK:STEP: that rank SIGKILLs itself before that
step (in torchrun's first attempt only).

--outcome DIR: when training fails, each rank writes DIR/rank<R>.json naming the error (type, message with notes, wall
time) before re-raising. --out PATH: rank 0 saves the final parameters and what every failover did to PATH.pt and
PATH.json, and the initial ones to PATH.init.pt; every rank its final parameters to PATH.rankR.pt.
"""

from __future__ import annotations

import argparse
import gc
import json
import logging
import os
import signal
import sys
import time

import torch
import torch.distributed as dist
from torch.nn.parallel import DistributedDataParallel

import torch_bps
from torch_bps.runtime import _RUNTIMES


def say(line: str) -> None:
    """Print `line` in one write: the ranks share torchrun's pipe, and print() writes a line and its end apart."""
    sys.stdout.write(line + "\n")
    sys.stdout.flush()


def save(model: torch.nn.Module, path: str) -> None:
    torch.save({n: t.detach().clone() for n, t in model.state_dict().items()}, path)


def main() -> None:
    p = argparse.ArgumentParser()
    p.add_argument("--backend", default="byteps", choices=["byteps", "gloo"])
    p.add_argument("--hook", action="store_true", help="gradient buckets through torch_bps.bps_hook on gloo")
    p.add_argument("--buffers", action="store_true", help="a BatchNorm, so every forward broadcasts buffers")
    p.add_argument("--steps", type=int, default=100_000)
    p.add_argument("--outcome", default="", help="directory for rank<R>.json, written when training fails")
    p.add_argument("--out", default="", help="where the parameters and failover records go")
    p.add_argument("--kill", default="", help="PID:STEP:WHEN[:stop] (rank 0 SIGKILLs PID); several, comma-separated")
    p.add_argument("--stall", default="", help="RANK:STEP:SECONDS: that rank sleeps before that step")
    p.add_argument("--die", default="", help="RANK:STEP: that rank SIGKILLs itself before that step, first attempt")
    p.add_argument("--rebalance", default="", help="STEP:FILE: at that step boundary, once FILE exists, rebalance")
    args = p.parse_args()
    logging.basicConfig(level=logging.WARNING, format="%(message)s")
    dist.init_process_group("gloo" if args.hook else args.backend)
    rank = dist.get_rank()
    say(f"rank {rank} pid {os.getpid()}")
    torch.manual_seed(0)
    layers = [torch.nn.Linear(64, 512), torch.nn.ReLU(), torch.nn.Linear(512, 64)]
    if args.buffers:
        layers.insert(1, torch.nn.BatchNorm1d(512))
    model = torch.nn.Sequential(*layers)
    if rank == 0 and args.out:
        save(model, args.out + ".init.pt")
    ddp = DistributedDataParallel(model, broadcast_buffers=args.buffers, bucket_cap_mb=0.05)
    if args.hook:
        ddp.register_comm_hook(torch_bps.BpsHookState(), torch_bps.bps_hook)
    opt = torch.optim.SGD(ddp.parameters(), lr=0.05)
    # What exists now (torch, and the torch._dynamo DDP imported) lives until exit: out of the collector, whose
    # last pass over those million objects would hold up each rank's exit by about a second.
    gc.freeze()
    kills = [(int(k[0]), int(k[1]), k[2], k[3:] == ["stop"]) for k in (k.split(":") for k in args.kill.split(",") if k)]
    kills = [k for k in kills if rank == 0]
    armed: list = []

    def kill_now(*_):
        while armed:
            pid, stop = armed.pop()
            say(f"{'stopping' if stop else 'killing'} server pid {pid}")
            os.kill(pid, signal.SIGSTOP if stop else signal.SIGKILL)

    model[0].weight.register_hook(lambda grad: kill_now() or grad)  # the last gradient of the backward pass
    data = torch.Generator().manual_seed(1000 + rank)
    rebalance = args.rebalance.split(":") if args.rebalance else None
    stall = [int(v) for v in args.stall.split(":")] if args.stall else None
    die = [int(v) for v in args.die.split(":")] if args.die else None
    first_attempt = os.environ.get("TORCHELASTIC_RESTART_COUNT", "0") == "0"
    try:
        for step in range(args.steps):
            if die and first_attempt and (rank, step) == tuple(die):
                say(f"rank {rank} dying at step {step}")
                say(f"dying at {time.time():.3f}")
                os.kill(os.getpid(), signal.SIGKILL)
            if stall and (rank, step) == tuple(stall[:2]):
                say(f"stalling at {time.time():.3f}")
                time.sleep(stall[2])
            if rebalance and int(rebalance[0]) == step:
                deadline = time.monotonic() + 60
                while not os.path.exists(rebalance[1]) and time.monotonic() < deadline:
                    time.sleep(0.05)
                torch_bps.rebalance()
            for pid, at, when, stop in kills:
                if at == step:
                    armed.append((pid, stop))
                    if when == "start":
                        kill_now()
            ddp(torch.randn(32, 64, generator=data)).pow(2).mean().backward()
            kill_now()  # a hook that never fired (no kill inside backward was asked for)
            opt.step()
            opt.zero_grad()
            say(f"rank {rank} step {step}")
            time.sleep(0.02)
    except Exception as e:
        if args.outcome:
            outcome = {"rank": rank, "type": type(e).__name__, "at": time.time(),
                       "message": "\n".join([str(e), *getattr(e, "__notes__", [])])}  # fmt: skip
            with open(os.path.join(args.outcome, f"rank{rank}.json"), "w") as f:
                json.dump(outcome, f)
        raise
    if args.out:
        save(model, f"{args.out}.rank{rank}.pt")
    if args.out and rank == 0:
        save(model, args.out + ".pt")
        routers = [rt._engine.router for rt in _RUNTIMES.values() if rt._engine.router is not None]
        with open(args.out + ".json", "w") as f:
            json.dump([r for router in routers for r in router.failovers], f)
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
