"""Asynchronous and bounded-staleness training on the summation service (BytePS's BYTEPS_ENABLE_ASYNC, kept exact).

The servers keep the model as the sum of every update pushed so far (still only additions on their CPUs: MODEL
keys, docs/protocol.md). Each step a worker runs its own optimizer on its own gradients, pushes the update (its
parameters after the step minus before, divided by the number of workers as DDP divides a gradient), and pulls
the servers' total: its parameters become the initial model plus that total. The servers add each worker's
updates in its round order and exactly once (a resent push is never added twice, a skipped one is refused), and
answer a worker's pull of its round r once every worker's round r - s is in the total: with `staleness` s a fast
worker runs at most s rounds ahead of the slowest; None never waits (fully asynchronous). A worker that dies
stops holding the others back; its acknowledged updates stay in the model, once.

    trainer = torch_bps.AsyncTraining(model, optimizer, staleness=2)   # after dist.init_process_group
    for x, y in loader:
        optimizer.zero_grad()
        loss_fn(model(x), y).backward()
        trainer.step()                       # optimizer.step(), push the update, pull the model

`model` is the plain module (not DistributedDataParallel: its all-reduce would make every step synchronous).
Replicas start equal (rank 0's parameters are broadcast over the group); afterwards each worker reads the model
as the servers had it when its pull was answered, so replicas differ by the updates in flight.

May import: torch, torch_bps.config, torch_bps.errors, torch_bps.group_runtime and torch_bps.wire.
"""

from __future__ import annotations

import dataclasses
import threading

import torch
import torch.distributed as dist
from torch.nn.parallel import DistributedDataParallel

from torch_bps.config import Config
from torch_bps.errors import BpsTimeoutError, ConfigError
from torch_bps.group_runtime import GroupRuntime
from torch_bps.wire import Mode


class AsyncTraining:
    """Train with updates summed on the servers, each worker at most `staleness` rounds ahead of the slowest.

    Args:
        model: the module being trained (plain, not DistributedDataParallel); float32 or float64 parameters.
        optimizer: its optimizer, run locally by `step()` on this worker's own gradients.
        staleness: s >= 0 (0: each round waits for every worker's, as synchronous training), or None: never wait.
        process_group: the ranks that train together (None: the default group); rank 0's parameters start the model.
        config: other settings (None: the BPS_* environment variables); servers as for any torch_bps job.

    Example: `trainer = AsyncTraining(model, opt, staleness=None)`; then `backward()` and `trainer.step()` per step.
    """

    def __init__(self, model: torch.nn.Module, optimizer: torch.optim.Optimizer, *, staleness: int | None,
                 process_group: dist.ProcessGroup | None = None, config: Config | None = None):  # fmt: skip
        if not dist.is_initialized():
            raise RuntimeError("AsyncTraining needs torch.distributed initialized (dist.init_process_group)")
        if isinstance(model, DistributedDataParallel):
            raise ValueError("AsyncTraining takes the module itself, not DistributedDataParallel (its all-reduce "
                             "would make every step synchronous): pass model.module")  # fmt: skip
        if staleness is not None and staleness < 0:
            raise ConfigError(f"staleness={staleness} must not be negative (None: fully asynchronous)")
        self.group = process_group if process_group is not None else dist.distributed_c10d._get_default_group()
        self.config = dataclasses.replace(config or Config.resolve(), staleness=staleness, local_reduce=False,
                                          wire_dtype="fp32", backup_workers=0)  # fmt: skip
        self.config._check()
        self.model, self.optimizer = model, optimizer
        self.params = [p for p in model.parameters() if p.requires_grad]
        bad = sorted({str(p.dtype) for p in self.params if p.dtype not in (torch.float32, torch.float64)})
        if bad or any(p.device.type != "cpu" for p in self.params):
            raise ValueError(f"AsyncTraining: CPU float32/float64 parameters only (got {', '.join(bad) or 'CUDA'})")
        with torch.no_grad():
            for p in self.params:  # replicas start equal
                dist.broadcast(p.data, dist.get_global_rank(self.group, 0), group=self.group)
        # Per dtype: the parameters' flat layout, the initial model, and the parameters as last pulled.
        self._groups = {}
        for p in self.params:
            self._groups.setdefault(p.dtype, []).append(p)
        self._start = {dtype: self._flat(ps) for dtype, ps in self._groups.items()}
        self._current = {dtype: flat.clone() for dtype, flat in self._start.items()}
        self.steps = 0
        self._connection = GroupRuntime("async", self.group, self.config)

    def step(self) -> None:
        """Run the optimizer, push this worker's update, and set the parameters to the servers' model. Blocks until
        the pull is answered (staleness: until the slowest worker is close enough)."""
        runtime = self._connection.get()
        self.optimizer.step()
        n = self.group.size()
        updates = []
        with torch.no_grad():
            for dtype, ps in self._groups.items():
                update = self._flat(ps).sub_(self._current[dtype]).div_(n)
                updates.append(update)
        done = threading.Event()
        failure: list[BaseException] = []

        def finish(error: BaseException | None) -> None:
            if error is not None:
                failure.append(error)
            done.set()

        runtime.run(updates, finish, mode=Mode.MODEL)  # each update becomes the servers' total in place
        # The client bounds every request by config.timeout and names what it waited for; this bounds the rest.
        if not done.wait(2 * self.config.timeout + 60):
            raise BpsTimeoutError(f"AsyncTraining step {self.steps} of rank {self.group.rank()}: the pull of the "
                                  f"model did not complete within {2 * self.config.timeout + 60:.0f} s")  # fmt: skip
        if failure:
            raise failure[0]
        with torch.no_grad():
            for (dtype, ps), total in zip(self._groups.items(), updates, strict=True):
                current = self._current[dtype]
                torch.add(self._start[dtype], total, out=current)
                start = 0
                for p in ps:
                    p.copy_(current[start : start + p.numel()].view_as(p))
                    start += p.numel()
        self.steps += 1

    def close(self) -> None:
        """Close the connection to the servers (a later step opens a new one)."""
        self._connection.close()

    @staticmethod
    def _flat(params: list[torch.nn.Parameter]) -> torch.Tensor:
        return torch.cat([p.detach().reshape(-1) for p in params])
