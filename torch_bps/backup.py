"""Backup workers: synchronous data-parallel training that does not wait for its slowest b workers.

The rule of Chen et al. 2016 ("Revisiting Distributed Synchronous SGD") and TensorFlow's SyncReplicasOptimizer, on
the summation service: with b backups among n workers, each gradient round closes on the servers once n - b
workers pushed it; later pushes of it are dropped, never half-added (and counted: bps_job_late_pushes_total). The
servers scale the sum of the c contributions by n / c, so every worker, dividing by n as DDP does, applies the
contributors' mean, and all apply the same bits: replicas stay identical. A worker that fell behind learns it from
its pulls (a reply says how many later rounds already closed) and catches up by pulling the rounds it missed and
applying them in order, without computing them. The servers keep `window` rounds per key: a worker may fall
window - 1 rounds of each key behind before the others wait for it (the engine spreads consecutive collectives of
one size over 4 slots of keys, so about 4 x (window - 1) steps).

    sync = torch_bps.BackupWorkers(model, optimizer, backups=1)    # after dist.init_process_group (any backend)
    for x, y in loader:
        optimizer.zero_grad()
        if sync.compute():                 # False while this worker catches up
            loss_fn(model(x), y).backward()
        sync.step()                        # the contributors' mean, then optimizer.step()

`model` may be a DistributedDataParallel module: its gradient buckets then go to the servers during backward
(BackupWorkers registers itself as DDP's comm hook; DDP's own group may be gloo). Every rank is one worker to the
servers. Replicas must start equal (DDP broadcasts them; otherwise seed them alike).

With a compressor (Config.compressor), the rounds' large fp32 gradients travel compressed, as bps_hook sends them
(engine/compress.py); a worker catching up pulls and decodes the rounds' encoded sums.

May import: torch, torch_bps.config, torch_bps.engine, torch_bps.errors, torch_bps.futures and torch_bps.runtimes.
"""

# No `from __future__ import annotations`: DDP checks its comm hook's annotations against the real types.
import dataclasses
import logging

import torch
import torch.distributed as dist
from torch.nn.parallel import DistributedDataParallel

from torch_bps.config import Config
from torch_bps.engine.compress import compressible_runs
from torch_bps.engine.exchange import Exchange
from torch_bps.errors import ConfigError
from torch_bps.futures import completer
from torch_bps.runtimes import Lease

log = logging.getLogger("torch_bps.backup")

# DDP fixes its buckets after its first step: a worker replays a step's buckets only once they no longer change.
_WARMUP_STEPS = 2


@dataclasses.dataclass
class _Bucket:
    """One collective of a step: its size and dtype, and where its sums go (parameter, start, numel)."""

    numel: int
    dtype: torch.dtype
    params: list[tuple[torch.nn.Parameter, int, int]]


class BackupWorkers:
    """Run each training step's gradient rounds with `backups` backup workers (see the module's docstring).

    Args:
        model: the module being trained (a DistributedDataParallel module, or a plain one).
        optimizer: its optimizer; `step()` runs it.
        backups: b, 0 <= b < the group's size (0: plain synchronous rounds, every worker in each).
        window: rounds the servers keep per key (BPS_BACKUP_WINDOW, default 4): how far a slow worker may fall
            behind and still catch up by pulling.
        process_group: the ranks that train together (None: the default group).
        config: other settings (None: the BPS_* environment variables); servers as for any torch_bps job.

    Example: `sync = BackupWorkers(ddp_model, opt, backups=1)`; then `compute()`, `backward()`, `step()` per step.
    """

    def __init__(self, model: torch.nn.Module, optimizer: torch.optim.Optimizer, *, backups: int,
                 window: int | None = None, process_group: dist.ProcessGroup | None = None,
                 config: Config | None = None):  # fmt: skip
        if not dist.is_initialized():
            raise RuntimeError("BackupWorkers needs torch.distributed initialized (dist.init_process_group)")
        self.group = process_group if process_group is not None else dist.distributed_c10d._get_default_group()
        size = self.group.size()
        if not 0 <= backups < size:
            raise ConfigError(f"backups={backups} with {size} workers: use 0 <= backups < {size}")
        changes = {"backup_workers": backups, "local_reduce": False}
        if window is not None:
            changes["backup_window"] = window
        self.config = dataclasses.replace(config or Config.resolve(), **changes)
        self.config._check()
        self.model, self.optimizer = model, optimizer
        self._names = {id(p): n for n, p in model.named_parameters()}  # for Config.compress_exclude
        self.steps = 0  # steps taken
        self.caught_up = 0  # of them, rounds applied without computing them
        self._behind = 0
        self._connection = Lease("backup", self.group, self.config)
        self._ddp = isinstance(model, DistributedDataParallel)
        self._buckets: list[_Bucket] = []  # this step's collectives, in order (DDP: as its hook saw them)
        self._futures: list[torch.futures.Future] = []
        if self._ddp:
            model.register_comm_hook(self, _hook)

    def compute(self) -> bool:
        """Whether this step needs a forward and backward pass: False while this worker is catching up."""
        return self._behind == 0 or self.steps < _WARMUP_STEPS

    def step(self) -> None:
        """Apply this step's round: the contributors' mean of the gradients (or, catching up, the round the others
        made), then `optimizer.step()`. Blocks until the round's sums are here."""
        runtime = self._connection.get()
        if self.compute():
            if not self._ddp:
                self._buckets = self._plain_buckets()
                self._futures = [self._push(runtime, b, self._gather(b)) for b in self._buckets]
            if len(self._futures) != len(self._buckets):
                raise RuntimeError("BackupWorkers.step() without a backward pass through the DDP model this step")
            sums = [f.wait() for f in self._futures]
        else:
            sums = [self._pull(runtime, b) for b in self._buckets]
            self.caught_up += 1
        if not (self._ddp and self.compute()):  # DDP wrote its buckets' sums into the gradients itself
            for bucket, flat in zip(self._buckets, sums, strict=True):
                for p, start, numel in bucket.params:
                    p.grad = flat[start : start + numel].view_as(p)  # a fresh buffer each step: views will do
        self._futures = []
        self.optimizer.step()
        self.steps += 1
        self._behind = runtime.take_behind()
        if self._behind:
            log.debug("rank %d: %d rounds behind after step %d", self.group.rank(), self._behind, self.steps)

    def close(self) -> None:
        """Close the connection to the servers (a later step opens a new one)."""
        self._connection.close()

    # -- the rounds
    def _push(self, runtime, bucket: _Bucket, flat: torch.Tensor) -> torch.futures.Future:
        # Divided first, as DDP does: the servers sum, scale by n / contributors, and the mean comes back.
        flat.div_(self.group.size())
        return self._round(runtime, bucket, flat, pull_only=False)

    def _pull(self, runtime, bucket: _Bucket) -> torch.Tensor:
        return self._round(runtime, bucket, torch.empty(bucket.numel, dtype=bucket.dtype), pull_only=True).wait()

    def _round(self, runtime, bucket: _Bucket, flat: torch.Tensor, pull_only: bool) -> torch.futures.Future:
        grads = [(start, numel, self._names.get(id(p), "")) for p, start, numel in bucket.params]
        runs = compressible_runs(self.config, flat.dtype, flat.numel(), grads)
        future = torch.futures.Future()
        runtime.run([Exchange(flat[a:b], compress=compress) for a, b, compress in runs if b > a],
                    completer(future, flat),
                    pull_only=pull_only)  # fmt: skip
        return future

    def _plain_buckets(self) -> list[_Bucket]:
        """One bucket per dtype of the trainable parameters, in parameter order."""
        buckets: dict[torch.dtype, _Bucket] = {}
        for p in self.model.parameters():
            if p.requires_grad:
                b = buckets.setdefault(p.dtype, _Bucket(0, p.dtype, []))
                b.params.append((p, b.numel, p.numel()))
                b.numel += p.numel()
        return list(buckets.values())

    @staticmethod
    def _gather(bucket: _Bucket) -> torch.Tensor:
        flat = torch.zeros(bucket.numel, dtype=bucket.dtype)
        for p, start, numel in bucket.params:
            if p.grad is not None:  # a sparse gradient (nn.Embedding(sparse=True)) is summed dense here
                flat[start : start + numel].copy_((p.grad.to_dense() if p.grad.is_sparse else p.grad).reshape(-1))
        return flat

    def _on_bucket(self, bucket: dist.GradBucket) -> torch.futures.Future[torch.Tensor]:
        if bucket.index() == 0 or not self._futures:  # DDP's first bucket of a step (it reduces in index order)
            self._buckets, self._futures = [], []
        buffer = bucket.buffer()
        if buffer.device.type != "cpu":
            raise ValueError("BackupWorkers: DDP buckets on CPU only (the device path is not built yet)")
        if buffer.layout != torch.strided:
            raise ValueError("BackupWorkers: a DDP bucket of sparse gradients (nn.Embedding(sparse=True)) is not "
                             "supported yet; use sparse=False, or BackupWorkers on the plain module")  # fmt: skip
        params, start = [], 0
        for p in bucket.parameters():
            params.append((p, start, p.numel()))
            start += p.numel()
        self._buckets.append(_Bucket(buffer.numel(), buffer.dtype, params))
        future = self._push(self._connection.get(), self._buckets[-1], buffer)
        self._futures.append(future)
        return future


def _hook(state: BackupWorkers, bucket: dist.GradBucket) -> torch.futures.Future[torch.Tensor]:
    """DDP's comm hook for BackupWorkers: the bucket's round goes to the servers during backward."""
    return state._on_bucket(bucket)
