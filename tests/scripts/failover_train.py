"""DDP training for tests/faults/test_failover.py, run by torchrun: deterministic data, and rank 0 may SIGKILL a
summation server at a chosen moment of a chosen step. Rank 0 saves the final parameters and what every
failover did to --out, and the initial ones to --out.init.pt; every rank its final parameters to --out.rankR.pt.
Rank 0 also writes to --out.servers.json the summation servers it had started at each kill, and its fallback's.

--kill PID:STEP:WHEN[:stop], WHEN one of
  start     before the step's forward (no collective in flight)
  backward  inside the backward pass, when the last bucket's gradient is ready: earlier buckets are in flight
and with ":stop" the server is SIGSTOPped (silent, connections open) instead of SIGKILLed.
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


def server_children() -> list[int]:
    """The pids of the summation servers this process started that run now."""
    pids = []
    for name in filter(str.isdigit, os.listdir("/proc")):
        try:
            with open(f"/proc/{name}/stat") as f:
                parent = int(f.read().rsplit(")", 1)[1].split()[1])
            with open(f"/proc/{name}/cmdline", "rb") as f:
                command = f.read()
        except OSError:  # gone meanwhile
            continue
        if parent == os.getpid() and b"torch_bps.server" in command:
            pids.append(int(name))
    return pids


def main() -> None:
    p = argparse.ArgumentParser()
    p.add_argument("--steps", type=int, default=12)
    p.add_argument("--out", required=True)
    p.add_argument("--kill", default="", help="PID:STEP:WHEN (rank 0 SIGKILLs PID); several, comma-separated")
    p.add_argument("--hook", action="store_true", help="gradient buckets through torch_bps.bps_hook on gloo")
    p.add_argument("--rebalance", default="", help="STEP:FILE: at that step boundary, once FILE exists, rebalance")
    p.add_argument(
        "--die", default="", help="RANK:STEP: that rank SIGKILLs itself before that step, first attempt only"
    )
    args = p.parse_args()
    logging.basicConfig(level=logging.WARNING, format="%(message)s")
    dist.init_process_group("gloo" if args.hook else "byteps")
    rank = dist.get_rank()
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(64, 512), torch.nn.ReLU(), torch.nn.Linear(512, 64))
    if rank == 0:
        torch.save({n: t.detach().clone() for n, t in model.state_dict().items()}, args.out + ".init.pt")
    ddp = DistributedDataParallel(model, bucket_cap_mb=0.05)
    if args.hook:
        ddp.register_comm_hook(torch_bps.BpsHookState(), torch_bps.bps_hook)
    opt = torch.optim.SGD(ddp.parameters(), lr=0.05)
    # What exists now (torch, and the torch._dynamo DDP imported) lives until exit: out of the collector, whose
    # last pass over those million objects would hold up each rank's exit by about a second.
    gc.freeze()
    kills = [(int(k[0]), int(k[1]), k[2], k[3:] == ["stop"]) for k in (k.split(":") for k in args.kill.split(",") if k)]
    kills = [k for k in kills if rank == 0]
    armed: list = []

    servers_at_kills: list[list[int]] = []  # per kill, the summation servers rank 0 had started just before

    def kill_now(*_):
        while armed:
            pid, stop = armed.pop()
            servers_at_kills.append(server_children())
            say(f"{'stopping' if stop else 'killing'} server pid {pid}")
            os.kill(pid, signal.SIGSTOP if stop else signal.SIGKILL)

    model[0].weight.register_hook(lambda grad: kill_now() or grad)  # the last gradient of the backward pass
    data = torch.Generator().manual_seed(1000 + rank)
    rebalance = args.rebalance.split(":") if args.rebalance else None
    die = [int(v) for v in args.die.split(":")] if args.die else None
    first_attempt = os.environ.get("TORCHELASTIC_RESTART_COUNT", "0") == "0"
    for step in range(args.steps):
        if die and first_attempt and (rank, step) == tuple(die):
            say(f"rank {rank} dying at step {step}")
            os.kill(os.getpid(), signal.SIGKILL)
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
        x = torch.randn(32, 64, generator=data)
        ddp(x).pow(2).mean().backward()
        kill_now()  # a hook that never fired (no kill inside backward was asked for)
        opt.step()
        opt.zero_grad()
        say(f"rank {rank} step {step}")
    torch.save({n: t.detach().clone() for n, t in model.state_dict().items()}, f"{args.out}.rank{rank}.pt")
    if rank == 0:
        runtimes = [rt for rt in _RUNTIMES.values() if rt._engine.router is not None]
        torch.save({n: t.detach().clone() for n, t in model.state_dict().items()}, args.out + ".pt")
        with open(args.out + ".json", "w") as f:
            json.dump([r for rt in runtimes for r in rt._engine.router.failovers], f)
        with open(args.out + ".servers.json", "w") as f:
            fallback = [p.pid for rt in runtimes for p in rt._fallback_procs]
            json.dump({"at_kills": servers_at_kills, "fallback": fallback}, f)
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
