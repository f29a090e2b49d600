"""DDP training over the "byteps" backend for tests/deploy, launched by torchrun or by TorchX: deterministic model
and data, so that two launches of the same job end with the same parameters. Rank 0 saves them to OUT.pt and
what every failover did to OUT.json; every rank prints "rank R servers A,B" and "rank R step S" after each step.

Imported, it launches itself for the deploy tests (`torchrun`, `lines_of`, `finish`).
"""

from __future__ import annotations

import argparse
import gc
import json
import os
import queue
import subprocess
import sys
import threading
import time

import torch
import torch.distributed as dist
from torch.nn.parallel import DistributedDataParallel

import torch_bps
from torch_bps.runtime import _RUNTIMES

SCRIPT = os.path.abspath(__file__)


def main() -> None:
    p = argparse.ArgumentParser()
    p.add_argument("--steps", type=int, default=10)
    p.add_argument("--out", required=True, help="rank 0 writes OUT.pt (parameters) and OUT.json (failovers)")
    p.add_argument("--step-sleep", type=float, default=0.0, help="seconds between steps (a job long enough to act on)")
    args = p.parse_args()
    dist.init_process_group("byteps")
    rank = dist.get_rank()
    print(f"rank {rank} servers {','.join(sorted(torch_bps.implementation().runtime.addresses))}", flush=True)
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(64, 512), torch.nn.ReLU(), torch.nn.Linear(512, 64))
    ddp = DistributedDataParallel(model, bucket_cap_mb=0.05)
    opt = torch.optim.SGD(ddp.parameters(), lr=0.05)
    gc.freeze()  # what exists now lives until exit: the collector's last pass would hold up each rank's exit
    data = torch.Generator().manual_seed(1000 + rank)
    for step in range(args.steps):
        x = torch.randn(32, 64, generator=data)
        ddp(x).pow(2).mean().backward()
        opt.step()
        opt.zero_grad()
        print(f"rank {rank} step {step}", flush=True)
        time.sleep(args.step_sleep)
    if rank == 0:
        routers = [rt._engine.router for rt in _RUNTIMES.values() if rt._engine.router is not None]
        torch.save({n: t.detach().clone() for n, t in model.state_dict().items()}, args.out + ".pt")
        with open(args.out + ".json", "w") as f:
            json.dump([r for router in routers for r in router.failovers], f)
    dist.destroy_process_group()


def torchrun(out: str, servers: list[str], steps: int, env: dict[str, str] | None = None, step_sleep: float = 0.0):
    """Start this script on two workers under torchrun; return the process (stdout and stderr merged)."""
    from tests.helpers import REPO, _free_port

    cmd = [sys.executable, "-m", "torch.distributed.run", "--nproc-per-node", "2", "--master-addr", "127.0.0.1",
           "--master-port", str(_free_port()), SCRIPT, "--out", out, "--steps", str(steps), "--step-sleep",
           str(step_sleep)]  # fmt: skip
    env = {**os.environ, "PYTHONPATH": REPO, "OMP_NUM_THREADS": "1", "BPS_LOCAL_REDUCE": "0", "BPS_TIMEOUT": "30",
           "BPS_SERVERS": ",".join(servers), "BPS_FAILOVER_TIMEOUT": "30", **(env or {})}  # fmt: skip
    return subprocess.Popen(cmd, env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)


def lines_of(proc: subprocess.Popen) -> queue.Queue:
    """The process's output, line by line, from a thread (None once it closes)."""
    lines: queue.Queue = queue.Queue()

    def pump() -> None:
        for line in proc.stdout:
            lines.put(line)
        lines.put(None)

    threading.Thread(target=pump, daemon=True).start()
    return lines


def finish(proc: subprocess.Popen, lines: queue.Queue, out: str, seen: list[str]) -> tuple[dict, list]:
    """Wait for the job to end (150 s at most); return (its final parameters, its failover records)."""
    deadline = time.monotonic() + 150
    while (line := lines.get(timeout=max(deadline - time.monotonic(), 0.1))) is not None:
        seen.append(line)
    assert proc.wait(timeout=30) == 0, "".join(seen)[-6000:]
    with open(out + ".json") as f:
        return torch.load(out + ".pt"), json.load(f)


if __name__ == "__main__":
    main()
