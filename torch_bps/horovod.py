"""Horovod's PyTorch API (`horovod.torch`) over torch_bps.byteps: a Horovod script runs with its import line changed
to `import torch_bps.horovod as hvd`.

`allreduce*` are BytePS's push_pull (sums on the summation servers; Min/Max/Product: the default group's
all_reduce); `allgather`, `broadcast*` and `barrier` are the default group's collectives. What Horovod offers and
this does not is refused by name when used: Adasum, process sets, elastic training, join, timelines (BPS_TRACE
records one), grouped and reduce-scatter ops.

May import: torch, torch_bps.byteps, torch_bps.errors.
"""

from __future__ import annotations

import torch
import torch.distributed as dist

from torch_bps import byteps as _bps
from torch_bps.byteps import (  # noqa: F401 - Horovod's names for the same functions
    Compression,
    broadcast_object,
    broadcast_optimizer_state,
    broadcast_parameters,
    is_initialized,
    local_rank,
    local_size,
    poll,
    push_pull_async_inplace,
    rank,
    shutdown,
    size,
    synchronize,
)
from torch_bps.errors import ConfigError

Average, Sum, Min, Max, Product = (dist.ReduceOp.AVG, dist.ReduceOp.SUM, dist.ReduceOp.MIN, dist.ReduceOp.MAX,
                                   dist.ReduceOp.PRODUCT)  # fmt: skip
global_process_set = None  # the only process set: every rank

_REFUSED = {
    "Adasum": "Adasum reduction (the servers only add): use Average",
    "elastic": "elastic training (a failed worker fails the job; servers fail over: README, Failover)",
    "ProcessSet": "process sets: make a torch group with dist.new_group(ranks, backend='byteps')",
    "add_process_set": "process sets: make a torch group with dist.new_group(ranks, backend='byteps')",
    "remove_process_set": "process sets: make a torch group with dist.new_group(ranks, backend='byteps')",
    "join": "join (uneven inputs): torch's DDP Join context on a 'byteps' group",
    "start_timeline": "Horovod's timeline: set BPS_TRACE=DIR",
    "stop_timeline": "Horovod's timeline: set BPS_TRACE=DIR",
    "SyncBatchNorm": "Horovod's SyncBatchNorm: torch.nn.SyncBatchNorm on the 'byteps' group",
    "grouped_allreduce": "grouped ops: allreduce each tensor (the engine batches partitions anyway)",
    "grouped_allreduce_async": "grouped ops: allreduce_async each tensor",
    "alltoall": "alltoall: dist.all_to_all on the 'byteps' group",
    "alltoall_async": "alltoall: dist.all_to_all(..., async_op=True) on the 'byteps' group",
    "allgather_async": "asynchronous allgather: dist.all_gather(..., async_op=True) on the 'byteps' group",
    "broadcast_async": "asynchronous broadcast: dist.broadcast(..., async_op=True) on the 'byteps' group",
    "broadcast_async_": "asynchronous broadcast: dist.broadcast(..., async_op=True) on the 'byteps' group",
    "reducescatter": "reducescatter: dist.reduce_scatter on the 'byteps' group",
}


def __getattr__(name: str):
    if name in _REFUSED:
        raise ConfigError(f"torch_bps.horovod.{name} is not offered: {_REFUSED[name]}")
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")


def init(comm=None, process_sets=None) -> None:
    """Join the job (see torch_bps.byteps.init); MPI communicators and process sets are refused."""
    if comm is not None or process_sets is not None:
        raise ConfigError("init(comm=, process_sets=): no MPI and no process sets here (torchrun or BytePS launch)")
    _bps.init()


def cross_size() -> int:
    return _bps._runtime().topology.num_nodes


def cross_rank() -> int:
    return _bps._runtime().topology.node_rank


def _check_set(process_set) -> None:
    if process_set is not global_process_set:
        raise ConfigError(f"process_set={process_set!r}: {_REFUSED['ProcessSet']}")


def _op(average, op):
    if average is not None and op is not None:
        raise ValueError("allreduce: give average= or op=, not both")
    if op is None:
        op = Sum if average is False else Average
    if op not in (Average, Sum, Min, Max, Product):
        raise ConfigError(f"allreduce(op={op!r}): {_REFUSED['Adasum']}")
    return op


def allreduce_async_(tensor: torch.Tensor, average=None, name: str | None = None, op=None,
                     prescale_factor: float = 1.0, postscale_factor: float = 1.0,
                     process_set=global_process_set) -> int:  # fmt: skip
    """Start reducing `tensor` in place over every rank (Average by default); return a handle for `synchronize`."""
    _check_set(process_set)
    op = _op(average, op)
    if prescale_factor != 1.0:
        tensor.mul_(prescale_factor)
    if op in (Average, Sum):
        handle = push_pull_async_inplace(tensor, average=op == Average, name=name)
    else:  # not a sum: the default group's all_reduce (an all-gather, then a local reduce on "byteps")
        handle = _bps._register(dist.all_reduce(tensor, op=op, async_op=True), tensor)
    if postscale_factor != 1.0:  # after the sum: wait for it here
        synchronize(handle)
        handle = _bps._register(_Done(), tensor.mul_(postscale_factor))
    return handle


class _Done:
    """A handle's Work that has finished."""

    def wait(self, timeout=None) -> bool:
        return True

    def is_completed(self) -> bool:
        return True


def allreduce_async(tensor: torch.Tensor, average=None, name: str | None = None, op=None,
                    prescale_factor: float = 1.0, postscale_factor: float = 1.0,
                    process_set=global_process_set) -> int:  # fmt: skip
    """As allreduce_async_, into a new tensor (`tensor` is left as it is)."""
    return allreduce_async_(tensor.detach().clone(), average, name, op, prescale_factor, postscale_factor,
                            process_set)  # fmt: skip


def allreduce_(tensor: torch.Tensor, average=None, name: str | None = None, op=None, prescale_factor: float = 1.0,
               postscale_factor: float = 1.0, process_set=global_process_set) -> torch.Tensor:  # fmt: skip
    """Reduce `tensor` in place over every rank; return it."""
    return synchronize(allreduce_async_(tensor, average, name, op, prescale_factor, postscale_factor, process_set))


def allreduce(tensor: torch.Tensor, average=None, name: str | None = None, compression=Compression.none, op=None,
              prescale_factor: float = 1.0, postscale_factor: float = 1.0,
              process_set=global_process_set) -> torch.Tensor:  # fmt: skip
    """Return `tensor` reduced over every rank (Average by default).

    Example: `mean_loss = hvd.allreduce(loss.detach(), name="loss")`.
    """
    sent, ctx = compression.compress(tensor.detach().clone())
    out = allreduce_(sent, average, name, op, prescale_factor, postscale_factor, process_set)
    return compression.decompress(out, ctx)


def allgather(tensor: torch.Tensor, name: str | None = None, process_set=global_process_set) -> torch.Tensor:
    """Concatenate every rank's `tensor` along dimension 0 (the first dimension may differ between ranks)."""
    _check_set(process_set)
    _bps._runtime()
    n = size()
    rows = torch.tensor([tensor.shape[0] if tensor.dim() else 1], dtype=torch.int64, device=tensor.device)
    counts = [torch.empty_like(rows) for _ in range(n)]
    dist.all_gather(counts, rows)
    counts = [int(c.item()) for c in counts]
    flat = tensor.reshape(-1, *tensor.shape[1:]) if tensor.dim() else tensor.reshape(1)
    padded = torch.zeros((max(counts), *flat.shape[1:]), dtype=flat.dtype, device=flat.device)
    padded[: flat.shape[0]] = flat
    slots = [torch.empty_like(padded) for _ in range(n)]
    dist.all_gather(slots, padded)
    return torch.cat([s[:c] for s, c in zip(slots, counts, strict=True)])


def allgather_object(obj, name: str | None = None) -> list:
    """Every rank's `obj`, by rank."""
    _bps._runtime()
    out = [None] * size()
    dist.all_gather_object(out, obj)
    return out


def broadcast_(tensor: torch.Tensor, root_rank: int, name: str | None = None,
               process_set=global_process_set) -> torch.Tensor:  # fmt: skip
    """Overwrite `tensor` with `root_rank`'s; return it."""
    _check_set(process_set)
    _bps._runtime()
    dist.broadcast(tensor.detach(), src=root_rank)
    return tensor


def broadcast(tensor: torch.Tensor, root_rank: int, name: str | None = None,
              process_set=global_process_set) -> torch.Tensor:  # fmt: skip
    """Return `root_rank`'s `tensor` (a new tensor on every rank)."""
    return broadcast_(tensor.detach().clone(), root_rank, name, process_set)


def barrier(process_set=global_process_set) -> None:
    _check_set(process_set)
    _bps._runtime()
    dist.barrier()


def DistributedOptimizer(optimizer: torch.optim.Optimizer, named_parameters=None, compression=Compression.none,
                         backward_passes_per_step: int = 1, op=Average, gradient_predivide_factor: float = 1.0,
                         num_groups: int = 0, groups=None, sparse_as_dense: bool = False,
                         process_set=global_process_set) -> torch.optim.Optimizer:  # fmt: skip
    """Horovod's DistributedOptimizer: torch_bps.byteps.DistributedOptimizer with `op` Average or Sum.

    Example: `opt = hvd.DistributedOptimizer(opt, named_parameters=model.named_parameters())`.
    """
    _check_set(process_set)
    if op not in (Average, Sum):
        raise ConfigError(f"DistributedOptimizer(op={op!r}): {_REFUSED['Adasum']}; Average or Sum")
    if gradient_predivide_factor != 1.0:
        raise ConfigError("gradient_predivide_factor: gradients are always divided by the size before the sum")
    if num_groups or groups:
        raise ConfigError(f"num_groups/groups: {_REFUSED['grouped_allreduce']}")
    optimizer = _bps._extend(optimizer, _bps._DistributedOptimizer)
    optimizer._bps_setup(named_parameters, compression, backward_passes_per_step, average=op == Average,
                         sparse_as_dense=sparse_as_dense)  # fmt: skip
    return optimizer
