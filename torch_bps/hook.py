"""`bps_hook`: a DDP communication hook that averages gradient buckets on the summation servers.

The DDP group itself can be anything (gloo, or "byteps"): DDP keeps using it for its broadcasts, and only
the gradient buckets go through torch_bps.

    state = torch_bps.BpsHookState()              # the default group; its Runtime is made on first use
    ddp.register_comm_hook(state, torch_bps.bps_hook)

Compression (Config.compressor, BPS_COMPRESSOR=onebit|topk:R|randomk:R) applies here and only here: the hook marks
each bucket's gradients of at least Config.compress_min_bytes, whose parameter names contain none of
Config.compress_exclude, as compressible, and the engine encodes them with error feedback (engine/compress.py).
A "byteps" group's own all_reduce (DDP without this hook, metrics, integer tensors) always stays exact.

May import: torch, torch_bps.config, torch_bps.device, torch_bps.engine.compress, torch_bps.engine.exchange,
torch_bps.pg, torch_bps.process_group, torch_bps.runtimes.
"""

# No `from __future__ import annotations` here: DDP checks bps_hook's annotations against the real types
# (dist.GradBucket, torch.futures.Future[torch.Tensor]) and refuses strings.
import dataclasses
import threading

import torch
import torch.distributed as dist

from torch_bps.config import Config
from torch_bps.device import paths
from torch_bps.engine.compress import compressible_runs
from torch_bps.engine.exchange import Exchange
from torch_bps.pg import sparse
from torch_bps.pg.staging import HostCopy
from torch_bps.pg.work import launch, launch_on_device, own_future
from torch_bps.process_group import implementation
from torch_bps.runtimes import Lease


class BpsHookState:
    """What bps_hook needs: the group whose ranks average together and, made on first use, its Runtime.

    Args:
        process_group: DDP's group (None: the default group). A "byteps" group lends its own Runtime; any other
            (gloo...) gets a Runtime, which meets the other ranks through the job's c10d store.
        config: settings of that Runtime (None: the BPS_* environment variables).
        name: the Runtime's job namespace, default "hook" ("hook-<group name>" for a subgroup). States with the
            same name share one Runtime: every rank must then run their hooks in the same order.
        module: the model, so that Config.compress_exclude can name its parameters (None: by size alone).

    Example: `ddp.register_comm_hook(BpsHookState(process_group=gloo_group), bps_hook)`.
    """

    def __init__(self, process_group: dist.ProcessGroup | None = None, config: Config | None = None,
                 name: str | None = None, module: torch.nn.Module | None = None):  # fmt: skip
        self.process_group = process_group
        self._names = {id(p): n for n, p in module.named_parameters()} if module is not None else {}
        self.config = config
        self.name = name
        self._lock = threading.Lock()
        self._runtime = None
        self._lease: Lease | None = None  # this state's hold on a hook Runtime (runtimes.py), none on a group's own
        self.sparse_room = sparse.Room()  # bps_hook's sparse buckets (pg/sparse.py)

    def segments(self, bucket: dist.GradBucket, config: Config) -> list[tuple[int, int, bool]]:
        """The bucket's buffer as (start, stop, compressible) runs of its gradients, in buffer order."""
        buffer = bucket.buffer()
        grads = [((g.data_ptr() - buffer.data_ptr()) // buffer.element_size(), g.numel(), self._names.get(id(p), ""))
                 for p, g in zip(bucket.parameters(), bucket.gradients(), strict=True)]  # fmt: skip
        return compressible_runs(config, buffer.dtype, buffer.numel(), grads)

    def connect(self):
        """Return the Runtime, made on the first call: a blocking rendezvous every rank of the group must join."""
        with self._lock:
            if self._runtime is None:
                self._runtime = self._connect()
            return self._runtime

    def close(self) -> None:
        """Drop this state's Runtime; the last state using a hook Runtime closes it (a "byteps" group's own
        Runtime is left to the group)."""
        with self._lock:
            if self._lease is not None:
                self._lease.close()
            self._runtime, self._lease = None, None

    def _connect(self):
        default = dist.distributed_c10d._get_default_group()
        pg = self.process_group if self.process_group is not None else default
        if (impl := implementation(pg)) is not None:
            return impl.runtime
        name = self.name or ("hook" if pg is default else f"hook-{pg.group_name}")
        self._lease = Lease(name, pg, self.config)  # states of one name share its Runtime
        return self._lease.get()


def bps_hook(state: BpsHookState, bucket: dist.GradBucket) -> torch.futures.Future[torch.Tensor]:
    """Average DDP's gradient bucket over the group on the summation servers; the future holds the bucket.

    Divides first, then sums: the servers add in the bucket's own dtype, and under `fp16_compress_wrapper`
    a float16 sum of undivided gradients can overflow where the sum of divided ones does not. DDP's
    built-in path also scales each gradient by 1/world before summing, so results match DDP without a hook.

    Example: `ddp.register_comm_hook(BpsHookState(), bps_hook)`.
    """
    runtime = state.connect()
    with runtime.launch_lock:  # as the "byteps" group's collectives: path choice, staging and launch in one order
        return _launch_bucket(state, bucket, runtime)


def _launch_bucket(state: BpsHookState, bucket: dist.GradBucket, runtime) -> torch.futures.Future:
    buffer = bucket.buffer()
    where = f"for DDP bucket {bucket.index()} (rank {runtime.rank} of {runtime.world_size})"

    def launch_here(transfers, result, device):
        return launch(runtime, "bps_hook", transfers, result, where=where, timeout=runtime.config.timeout,
                      device=device)  # fmt: skip

    if buffer.layout == torch.sparse_coo:  # nn.Embedding(sparse=True): its own bucket; DDP calls hooks from one thread
        buffer.div_(runtime.world_size)
        plain_sum = lambda dtype, flat, op, finish: Exchange(flat, finish=finish)  # noqa: E731
        return own_future(sparse.launch_sum("bps_hook", buffer, "SUM", runtime.rank, runtime.world_size,
                                                launch_here, plain_sum, buffer, state.sparse_room))  # fmt: skip
    runs = state.segments(bucket, runtime.config)
    path = paths.choose(runtime, buffer, "AVG", compressed=any(compress for *_, compress in runs))
    if path is not None:
        # The local stages on the device, or one partition at a time through pinned host memory on a side stream
        # (docs/gpu.md).
        return own_future(launch_on_device(runtime, "bps_hook", buffer, path, buffer, average=True, where=where,
                                               timeout=runtime.config.timeout))  # fmt: skip
    host = HostCopy("bps_hook", buffer)  # the bucket itself on CPU; a CPU copy for a CUDA bucket
    host.flat.div_(runtime.world_size)
    exchanges = [Exchange(host.flat[a:b], compress=compress) for a, b, compress in runs]
    exchanges[-1] = dataclasses.replace(exchanges[-1], finish=host.write_back)  # once every run is summed
    return own_future(launch_here(exchanges, buffer, buffer.device))
