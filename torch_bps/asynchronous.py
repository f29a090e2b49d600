"""Asynchronous and bounded-staleness training on the summation service (BytePS's BYTEPS_ENABLE_ASYNC, kept exact).

The servers keep the model as the sum of every update pushed so far (still only additions on their CPUs: MODEL
keys, docs/protocol.md). Each step a worker runs its own optimizer on its own gradients, pushes the update (its
parameters after the step minus before, divided by the number of workers as DDP divides a gradient), and pulls
the servers' total: its parameters become the initial model plus that total. The servers add each worker's
updates in its round order and exactly once (a resent push is never added twice, a skipped one is refused). With
`staleness` s the model a worker computes its round r + 1 on holds every worker's updates of rounds 0 .. r - s (and
its own): a fast worker runs at most s rounds ahead of the slowest; None never waits (fully asynchronous). A worker
that dies stops holding the others back; its acknowledged updates stay in the model, once.

With `overlap=True` (s >= 1 or None) a step does not wait for its own round: it pushes the update, sets the
parameters to the model its previous round pulled plus this update, and returns while the round travels, so the
network works while the next gradient is computed. The servers' bound is then s - 1, so the bound on what a
worker's model lacks stays s rounds; but where the workers keep pace, the model a worker computes on lacks about
one round more than without overlap, which costs accuracy at high momentum (docs/benchmarks.md). A round's error
is raised by the next `step()` or `flush()`.

    trainer = torch_bps.AsyncTraining(model, optimizer, staleness=2)   # after dist.init_process_group
    for x, y in loader:
        optimizer.zero_grad()
        loss_fn(model(x), y).backward()
        trainer.step()                       # optimizer.step(), push the update, set the model
    trainer.flush()                          # every update of this worker is in; the model as it is now
    dist.barrier(); trainer.flush()          # (on every rank) the model with every worker's updates in

`model` is the plain module (not DistributedDataParallel: its all-reduce would make every step synchronous).
Replicas start equal (rank 0's parameters are broadcast over the group); afterwards each worker reads the model
as the servers had it when its pull was answered, so replicas differ by the updates in flight.

May import: torch, torch_bps.config, torch_bps.errors, torch_bps.runtimes and torch_bps.wire.
"""

from __future__ import annotations

import dataclasses
import threading

import torch
import torch.distributed as dist
from torch.nn.parallel import DistributedDataParallel

from torch_bps.config import Config
from torch_bps.errors import BpsTimeoutError, ConfigError
from torch_bps.runtimes import Lease
from torch_bps.wire import Mode


class AsyncTraining:
    """Train with updates summed on the servers, each worker at most `staleness` rounds ahead of the slowest.

    Args:
        model: the module being trained (plain, not DistributedDataParallel); float32 or float64 parameters.
        optimizer: its optimizer, run locally by `step()` on this worker's own gradients.
        staleness: s >= 0 (0: each round waits for every worker's, as synchronous training), or None: never wait.
        overlap: a step returns while its round travels (staleness >= 1 or None; above).
        process_group: the ranks that train together (None: the default group); rank 0's parameters start the model.
        config: other settings (None: the BPS_* environment variables); servers as for any torch_bps job.

    Example: `trainer = AsyncTraining(model, opt, staleness=None)`; then `backward()` and `trainer.step()` per step.
    """

    def __init__(self, model: torch.nn.Module, optimizer: torch.optim.Optimizer, *, staleness: int | None,
                 overlap: bool = False, process_group: dist.ProcessGroup | None = None,
                 config: Config | None = None):  # fmt: skip
        if staleness is not None and staleness < 0:
            raise ConfigError(f"staleness={staleness} must not be negative (None: fully asynchronous)")
        if overlap and staleness == 0:
            raise ConfigError("overlap=True needs staleness >= 1 (or None): with 0 each step waits for its own round")
        if not dist.is_initialized():
            raise RuntimeError("AsyncTraining needs torch.distributed initialized (dist.init_process_group)")
        if isinstance(model, DistributedDataParallel):
            raise ValueError("AsyncTraining takes the module itself, not DistributedDataParallel (its all-reduce "
                             "would make every step synchronous): pass model.module")  # fmt: skip
        self.group = process_group if process_group is not None else dist.distributed_c10d._get_default_group()
        self.overlap = overlap  # a step's round travels during the next step's compute: one round of the bound
        self.config = dataclasses.replace(config or Config.resolve(), local_reduce=False, wire_dtype="fp32",
                                          staleness=staleness - 1 if overlap and staleness else staleness,
                                          backup_workers=0)  # fmt: skip
        self.config._check()
        self.model, self.optimizer = model, optimizer
        self.params = [p for p in model.parameters() if p.requires_grad]
        bad = sorted({str(p.dtype) for p in self.params if p.dtype not in (torch.float32, torch.float64)})
        devices = sorted({str(p.device) for p in self.params})
        if bad or len(devices) > 1:
            raise ValueError(f"AsyncTraining: float32/float64 parameters on one device only (got "
                             f"{', '.join(bad or devices)})")  # fmt: skip
        with torch.no_grad():
            for p in self.params:  # replicas start equal
                dist.broadcast(p.data, dist.get_global_rank(self.group, 0), group=self.group)
        # Per dtype: the parameters' flat layout, the initial model, and the parameters as last set (on the host,
        # where the servers' total arrives; device parameters are copied out and back each step).
        self._groups = {}
        for p in self.params:
            self._groups.setdefault(p.dtype, []).append(p)
        self._start = {dtype: self._flat(ps) for dtype, ps in self._groups.items()}
        self._current = {dtype: flat.clone() for dtype, flat in self._start.items()}
        self._round: _Round | None = None  # the round in flight (overlap only)
        # The whole job on one worker: the model is its running total, added here as a server would add it.
        self._alone = [torch.zeros_like(flat) for flat in self._start.values()] if self.group.size() == 1 else None
        self.steps = 0
        self._connection = Lease("async", self.group, self.config)

    def step(self) -> None:
        """Run the optimizer, push this worker's update, and set the parameters to the servers' model plus the
        updates of this worker it does not hold yet. Blocks until this round's pull is answered (with overlap: the
        previous round's), that is until the slowest worker is close enough."""
        self.optimizer.step()
        n = self.group.size()
        with torch.no_grad():
            updates = [self._flat(ps).sub_(self._current[dtype]).div_(n) for dtype, ps in self._groups.items()]
        self._push(updates, overlap=self.overlap)

    def flush(self) -> None:
        """Wait until every update of this worker is in the servers' model, then set the parameters to the model as
        the servers have it now (one more round, of no update: after a barrier it holds every worker's updates)."""
        self._settle()
        self._push([torch.zeros_like(flat) for flat in self._current.values()], overlap=False)

    def rebalance(self) -> dict | None:
        """Place the model's keys again by the paper's rule over the servers that answer now: servers back, standbys
        registered since, and off a fallback to colocated servers (`torch_bps.rebalance`, which takes a "byteps"
        group; this one's may be any). The model moves with its keys exactly: each worker's first round on the new
        servers is the sum of its updates. Collective: every rank calls it after the same number of `step()`s and
        `flush()`es (a round each). Returns what it did (also logged); None where the job has no server to move.
        """
        self._settle()
        return None if self._alone is not None else self._connection.get().rebalance()

    def close(self) -> None:
        """Wait for the round in flight, then close the connection to the servers (a later step opens a new one)."""
        try:
            self._settle()
        finally:
            self._connection.close()

    def _push(self, updates: list[torch.Tensor], *, overlap: bool) -> None:
        """Push `updates` (one flat tensor per dtype) as this worker's next round and pull the model: with `overlap`
        first settle the round before and return with this one in flight, else wait for it."""
        if overlap:
            self._settle()
            self._set([flat.add(u) for flat, u in zip(self._current.values(), updates, strict=True)])
        self._round = _Round(self.steps, updates)
        if self._alone is not None:
            for total, update in zip(self._alone, updates, strict=True):
                update.copy_(total.add_(update))
            self._round.finish(None)
        else:  # each update becomes the servers' total in place
            self._connection.get().run(updates, self._round.finish, mode=Mode.MODEL)
        self.steps += 1
        if not overlap:
            self._settle()

    def _settle(self) -> None:
        """Wait for the round in flight, if any, and set the parameters to the model it pulled."""
        if self._round is None:
            return
        round_, self._round = self._round, None
        # The client bounds every request by config.timeout and names what it waited for; this bounds the rest.
        wait = 2 * self.config.timeout + 60
        if not round_.done.wait(wait):
            raise BpsTimeoutError(f"AsyncTraining step {round_.step} of rank {self.group.rank()}: the pull of the "
                                  f"model did not complete within {wait:.0f} s")  # fmt: skip
        if round_.failure:
            raise round_.failure[0]
        self._set([start.add(total) for start, total in zip(self._start.values(), round_.totals, strict=True)])

    def _set(self, flats: list[torch.Tensor]) -> None:
        """Make `flats` (one per dtype) the parameters."""
        with torch.no_grad():
            for (dtype, ps), flat in zip(self._groups.items(), flats, strict=True):
                self._current[dtype] = flat
                start = 0
                for p in ps:
                    p.copy_(flat[start : start + p.numel()].view_as(p))
                    start += p.numel()

    @staticmethod
    def _flat(params: list[torch.nn.Parameter]) -> torch.Tensor:
        return torch.cat([p.detach().reshape(-1) for p in params]).cpu()


class _Round:
    """One step's push and pull in flight: its buffers (the updates, then the servers' totals) and how it ended."""

    def __init__(self, step: int, totals: list[torch.Tensor]):
        self.step, self.totals = step, totals
        self.done = threading.Event()
        self.failure: list[BaseException] = []

    def finish(self, error: BaseException | None) -> None:
        if error is not None:
            self.failure.append(error)
        self.done.set()
