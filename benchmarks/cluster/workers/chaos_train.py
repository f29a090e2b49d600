"""One rank of benchmarks/chaos.py: a workload that trains while the nemesis injects faults, and records each step.

Workloads (--workload):
  ddp     synchronous DDP on the "byteps" backend; gradients rounded to multiples of 2**-8 below 1 in magnitude, so
          every sum of the 4 ranks' is exact and the final parameters depend on no summation order: a run that only
          lost servers ends bit-identical to a fault-free one (--out writes them); with --rebalance-every, every
          rank calls torch_bps.rebalance() at those step boundaries, as a long job would to take servers back
  backup  DDP on gloo under BackupWorkers (b = --backups): each step's parameters are recorded as a CRC, which the
          checker compares across ranks at every step (replicas bit-identical) and in order
  async   AsyncTraining, staleness 2, one float64 parameter: rank r adds -1 to element r and -2**(step % 20) to
          element n + r every step, so the servers' final model says exactly how many of each rank's acknowledged
          updates it holds, and whether one was applied twice; with --rebalance-every, every rank calls
          AsyncTraining.rebalance() at those steps

Each step appends a JSON line {"t", "rank", "step", "crc"} to --record; the end, one with "event": "done" and the
workload's result, or "event": "error" with the exception's type and message. Rank 0 decides when to stop (--seconds
elapsed or --steps reached) and publishes the last step, a margin ahead, through the job's store, so every rank
ends on the same step. Rendezvous from MASTER_ADDR/MASTER_PORT/RANK/WORLD_SIZE (env://); BPS_* configure the rest.
May import: the standard library, torch and torch_bps.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import time
import zlib
from datetime import timedelta

import torch
import torch.distributed as dist
from torch.nn.parallel import DistributedDataParallel

import torch_bps
from torch_bps.runtime import _RUNTIMES

MARGIN = 20  # steps between rank 0's decision to stop and the last step: every rank reads it before it gets there
POWERS = 20  # async: element n + r gets -2**(step % POWERS), exact in float64 for any run this records


def exact_grad(grad: torch.Tensor) -> torch.Tensor:
    """Multiples of 2**-8 in (-1, 1): 4 of them add exactly in fp32, in any order."""
    return (grad * 256).round().clamp(-255, 255) / 256


def crc(params) -> int:
    return zlib.crc32(b"".join(p.detach().contiguous().numpy().tobytes() for p in params))


class Recorder:
    """Appends one JSON line per step (O_APPEND: the ranks share the file, each line in one write)."""

    def __init__(self, path: str, rank: int):
        self.fd = os.open(path, os.O_WRONLY | os.O_APPEND | os.O_CREAT, 0o644)
        self.rank = rank

    def step(self, step: int, **fields) -> None:
        line = json.dumps({"t": time.time(), "rank": self.rank, "step": step, **fields}) + "\n"
        os.write(self.fd, line.encode())


class Stop:
    """Rank 0 decides the last step; the others read it from the store (a key of their own client: no waits)."""

    def __init__(self, rank: int, seconds: float, steps: int):
        self.rank, self.seconds, self.deadline, self.last = rank, seconds, None, steps - 1
        self.published = False
        self._store = None

    @property
    def store(self) -> dist.TCPStore:
        if self._store is None:  # rank 0 hosts it from init_process_group on
            addr, port = os.environ["MASTER_ADDR"], int(os.environ["MASTER_PORT"])
            self._store = dist.TCPStore(addr, port, is_master=False, timeout=timedelta(seconds=60))
        return self._store

    def done(self, step: int) -> bool:
        """Whether `step` was the last one (call after it)."""
        if self.deadline is None:  # counted from the first step: start-ups take what they take
            self.deadline = time.monotonic() + self.seconds
        if self.rank == 0 and not self.published and time.monotonic() > self.deadline:
            self.last = min(self.last, step + MARGIN)
            self.store.set("chaos/last", str(self.last))
            self.published = True
        elif self.rank != 0 and not self.published and self.store.check(["chaos/last"]):
            self.last = int(self.store.get("chaos/last"))
            self.published = True
        return step >= self.last


def model_of() -> torch.nn.Module:
    torch.manual_seed(0)
    return torch.nn.Sequential(torch.nn.Linear(32, 256), torch.nn.Tanh(), torch.nn.Linear(256, 32))


def batch(rank: int, step: int) -> torch.Tensor:
    return torch.randn(16, 32, generator=torch.Generator().manual_seed(1_000_003 * rank + step))


def train(args, record: Recorder, stop: Stop, one_step, params: list) -> int:
    """Run `one_step(step)` up to rank 0's last step, recording `params` (a CRC) after each; return the steps.
    After the first step rank 0 records the dedicated servers the job started on (the checker follows the job's
    servers from there through the failovers' and rebalances' records)."""
    step = 0
    while True:
        one_step(step)
        record.step(step, crc=crc(params))
        if step == 0 and record.rank == 0:
            record.step(-1, event="servers", servers=sorted({a for rt in _RUNTIMES.values() for a in rt.dedicated}))
        if args.step_sleep:
            time.sleep(args.step_sleep)
        if stop.done(step):
            return step + 1
        step += 1


def run_ddp(args, rank: int, record: Recorder, stop: Stop) -> dict:
    dist.init_process_group("byteps")
    model = model_of()
    for p in model.parameters():
        p.register_hook(exact_grad)  # before DDP's reducer sees the gradient
    ddp = DistributedDataParallel(model, bucket_cap_mb=0.02)  # several buckets: several keys per step
    opt = torch.optim.SGD(ddp.parameters(), lr=2.0**-4)

    def one_step(step: int) -> None:
        if args.rebalance_every and step and step % args.rebalance_every == 0:
            torch_bps.rebalance()  # servers back and standbys registered since are taken in, a fallback left
        opt.zero_grad()
        ddp(batch(rank, step)).pow(2).mean().backward()
        opt.step()

    steps = train(args, record, stop, one_step, list(model.parameters()))
    if args.out and rank == 0:
        torch.save({n: t.detach().clone() for n, t in model.state_dict().items()}, args.out)
    return {"steps": steps, "failovers": failovers()}


def failovers() -> list[dict]:
    """What every failover of this process's groups did."""
    routers = [rt._engine.router for rt in _RUNTIMES.values() if rt._engine.router is not None]
    return [r for router in routers for r in router.failovers]


def run_backup(args, rank: int, record: Recorder, stop: Stop) -> dict:
    dist.init_process_group("gloo")
    model = model_of()
    ddp = DistributedDataParallel(model, bucket_cap_mb=0.02)
    opt = torch.optim.SGD(ddp.parameters(), lr=2.0**-4)
    sync = torch_bps.BackupWorkers(ddp, opt, backups=args.backups)

    def one_step(step: int) -> None:
        opt.zero_grad()
        if sync.compute():
            ddp(batch(rank, step)).pow(2).mean().backward()
        sync.step()

    out = {"steps": train(args, record, stop, one_step, list(model.parameters())), "caught_up": sync.caught_up}
    sync.close()
    return out


def run_async(args, rank: int, record: Recorder, stop: Stop) -> dict:
    dist.init_process_group("gloo")
    n = dist.get_world_size()
    p = torch.nn.Parameter(torch.zeros(2 * n, dtype=torch.float64))
    opt = torch.optim.SGD([p], lr=1.0)
    trainer = torch_bps.AsyncTraining(torch.nn.ParameterList([p]), opt, staleness=2)

    def one_step(step: int) -> None:
        if args.rebalance_every and step and step % args.rebalance_every == 0:
            trainer.rebalance()  # the model's keys move with their totals: servers back, standbys, a fallback left
        opt.zero_grad()
        grad = torch.zeros_like(p)
        grad[rank] = 1.0
        grad[n + rank] = 2.0 ** (step % POWERS)
        p.grad = grad * n  # AsyncTraining divides each update by n, as DDP's mean would
        trainer.step()

    steps = train(args, record, stop, one_step, [p])
    trainer.flush()  # every update of this rank acknowledged
    stop.store.add("chaos/flushed", 1)
    deadline = time.monotonic() + 120
    while stop.store.add("chaos/flushed", 0) < n:  # every rank's updates are in: one more pull reads them all
        if time.monotonic() > deadline:
            raise TimeoutError(f"rank {rank}: the other ranks did not flush within 120 s")
        time.sleep(0.05)
    trainer.flush()
    model = p.detach().tolist()
    done = failovers()
    trainer.close()
    powers = sum(2.0 ** (step % POWERS) for step in range(steps))
    return {"steps": steps, "acked": steps, "powers": powers, "model": model, "failovers": done}


def main(argv: list[str] | None = None) -> None:
    p = argparse.ArgumentParser()
    p.add_argument("--workload", choices=("ddp", "backup", "async"), required=True)
    p.add_argument("--record", required=True, help="JSON lines, one per rank and step")
    p.add_argument("--seconds", type=float, default=1e9, help="rank 0 stops after this long")
    p.add_argument("--steps", type=int, default=1 << 30, help="at most this many steps")
    p.add_argument("--backups", type=int, default=1)
    p.add_argument("--step-sleep", type=float, default=0.0)
    p.add_argument("--rebalance-every", type=int, default=0, help="ddp, async: rebalance every this many steps")
    p.add_argument("--out", default="", help="ddp: rank 0 saves the final parameters here")
    args = p.parse_args(argv)
    torch.set_num_threads(1)
    rank = int(os.environ["RANK"])
    record, stop = Recorder(args.record, rank), Stop(rank, args.seconds, args.steps)
    try:
        result = {"ddp": run_ddp, "backup": run_backup, "async": run_async}[args.workload](args, rank, record, stop)
    except Exception as e:  # recorded for the checker (an unsurvivable fault must end every rank with its error)
        record.step(-1, event="error", type=type(e).__name__, message=str(e)[:2000])
        raise
    record.step(-1, event="done", **result)
    sys.stdout.write("RESULT " + json.dumps(result) + "\n")
    sys.stdout.flush()
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
