"""BytePS's PyTorch API (`byteps.torch`) over torch_bps: a BytePS script runs with its import line changed to
`import torch_bps.byteps as bps` (also for `byteps.torch.cross_barrier`; `torch_bps.byteps.parallel` holds the DDP).

- `init()`, `size()`, `rank()`, `local_rank()`, `local_size()`: the default process group, made "byteps" from
  torchrun's variables (BytePS's `DMLC_*`/`BYTEPS_LOCAL_*` where torchrun's are absent); a group the script made
  already is used as it is.
- `push_pull*`, `poll`, `synchronize`, `declare`: one collective on the group's Runtime (pg/work.py's `launch`, as
  `bps_hook` does): `average` divides first, as DDP; `priority` reaches the client's scheduler; `version`
  (asynchronous mode) is refused.
- `DistributedOptimizer`: the user's optimizer, its class extended: a post-accumulate-grad hook per parameter pushes
  each gradient as autograd produces it; `step()` and `synchronize()` wait.
- `CrossBarrier` (torch_bps/cross_barrier.py): the same pushes, with priority by the layer's place in the forward
  pass; each parameter updated as its sum lands; each module's next forward waits for its own parameters only.
- the broadcasts: torch's `broadcast` and `broadcast_object_list` on the default group.

Collectives go in each rank's program order (as any torch collective), not by name: every rank must push the same
tensors in the same order (autograd's order is the same on every rank for the same model).

May import: torch, torch_bps.errors, torch_bps.engine.exchange, torch_bps.pg, torch_bps.process_group,
torch_bps.runtimes, torch_bps.cross_barrier (when CrossBarrier is first asked for).
"""

from __future__ import annotations

import contextlib
import itertools
import logging
import os
import sys
import threading
import types

import torch
import torch.distributed as dist

from torch_bps.engine.exchange import Exchange
from torch_bps.errors import ConfigError
from torch_bps.pg.staging import HostCopy
from torch_bps.pg.work import launch
from torch_bps.process_group import implementation
from torch_bps.runtimes import Lease

log = logging.getLogger("torch_bps")

_INIT_LOCK = threading.Lock()
_session: dict = {"runtime": None, "lease": None, "made_group": False}
_handles: dict[int, tuple[dist.Work, torch.Tensor]] = {}
_handle_ids = itertools.count(1)
_declared: set[str] = set()


# -- the job -----------------------------------------------------------------------------------------------------
def _adopt_byteps_launch(env=os.environ) -> None:
    """Fill torchrun's variables from BytePS's launcher's where torchrun's are absent: rank 0 hosts the job's store at
    DMLC_PS_ROOT_URI:DMLC_PS_ROOT_PORT (no scheduler process runs)."""
    if "RANK" in env or "DMLC_WORKER_ID" not in env:
        return
    try:
        node, nodes = int(env["DMLC_WORKER_ID"]), int(env["DMLC_NUM_WORKER"])
        local_rank, local_size = int(env.get("BYTEPS_LOCAL_RANK", "0")), int(env.get("BYTEPS_LOCAL_SIZE", "1"))
    except (KeyError, ValueError) as e:
        raise ConfigError(f"BytePS launch variables: DMLC_WORKER_ID, DMLC_NUM_WORKER, BYTEPS_LOCAL_*: {e}") from None
    env.update(RANK=str(node * local_size + local_rank), WORLD_SIZE=str(nodes * local_size),
               LOCAL_RANK=str(local_rank), LOCAL_WORLD_SIZE=str(local_size), GROUP_RANK=str(node),
               GROUP_WORLD_SIZE=str(nodes))  # fmt: skip
    env.setdefault("MASTER_ADDR", env.get("DMLC_PS_ROOT_URI", "127.0.0.1"))
    env.setdefault("MASTER_PORT", env.get("DMLC_PS_ROOT_PORT", "29500"))


def init(lazy: bool = True) -> None:
    """Join the job: make the default process group "byteps" (torchrun's or BytePS's launch variables) unless the
    script made one, and connect to the summation service. `lazy` is BytePS's and changes nothing.

    Example: `bps.init(); torch.cuda.set_device(bps.local_rank())`.
    """
    with _INIT_LOCK:
        if _session["runtime"] is not None:
            return
        if not dist.is_initialized():
            _adopt_byteps_launch()
            dist.init_process_group("byteps")
            _session["made_group"] = True
        impl = implementation()
        if impl is not None:
            _session["runtime"] = impl.runtime
        else:  # a gloo or NCCL group: its own Runtime beside it, as bps_hook makes one
            _session["lease"] = Lease("byteps-api", dist.group.WORLD, None)
            _session["runtime"] = _session["lease"].get()


def shutdown() -> None:
    """Leave the job (the process group too, if init() made it)."""
    with _INIT_LOCK:
        if _session["lease"] is not None:
            _session["lease"].close()
        if _session["made_group"] and dist.is_initialized():
            dist.destroy_process_group()
        _session.update(runtime=None, lease=None, made_group=False)


def is_initialized() -> bool:
    return _session["runtime"] is not None


def _runtime():
    runtime = _session["runtime"]
    if runtime is None:
        raise ConfigError("torch_bps.byteps: call init() first")
    return runtime


def size() -> int:
    return _runtime().topology.world_size


def rank() -> int:
    return _runtime().topology.rank


def local_size() -> int:
    return _runtime().topology.local_size


def local_rank() -> int:
    return _runtime().topology.local_rank


def _refused(name: str, reason: str):
    def refuse(*args, **kwargs):
        raise ConfigError(f"torch_bps.byteps.{name} is not offered: {reason}")

    refuse.__name__ = name
    return refuse


suspend = _refused("suspend", "elastic training (a failed worker fails the job; servers fail over: README, Failover)")
resume = _refused("resume", "elastic training (a failed worker fails the job; servers fail over: README, Failover)")


# -- push_pull -----------------------------------------------------------------------------------------------------
class Compression:
    """BytePS's gradient compression: `none`, or `fp16` (floating tensors travel and are summed as float16)."""

    class none:
        @staticmethod
        def compress(tensor):
            return tensor, None

        @staticmethod
        def decompress(tensor, ctx):
            return tensor

    class fp16:
        @staticmethod
        def compress(tensor):
            return (tensor.to(torch.float16), tensor.dtype) if tensor.dtype.is_floating_point else (tensor, None)

        @staticmethod
        def decompress(tensor, ctx):
            return tensor if ctx is None else tensor.to(ctx)


def _launch(tensor: torch.Tensor, output: torch.Tensor, average: bool, name: str | None, version: int,
            priority: int) -> int:  # fmt: skip
    """Sum `tensor` over the job into `output` (average: divided by the size), return the handle."""
    if version:
        raise ConfigError(f"push_pull(version={version}) is BytePS's asynchronous mode: use "
                          "torch_bps.AsyncTraining (bounded staleness) instead")  # fmt: skip
    runtime = _runtime()
    what, n = f"push_pull of {name!r}" if name else "push_pull", runtime.world_size
    with runtime.launch_lock:  # staged and launched in one order with the group's collectives and bps_hook's
        if output is not tensor:
            output.copy_(tensor)
        host = HostCopy(what, output)
        flat, finish = host.flat, host.write_back
        if average and flat.is_floating_point():
            flat.div_(n)  # first, as DDP does: the servers sum what they are given, replicas match DDP to the bit
        elif average:

            def finish() -> None:  # integers: the sum divided toward zero, as the backend's AVG
                flat.copy_(torch.div(flat, n, rounding_mode="trunc"))
                host.write_back()

        work = launch(runtime, what, [Exchange(flat, finish=finish)], output, where=f"(rank {runtime.rank} of {n})",
                      timeout=runtime.config.timeout, device=output.device, priority=priority)  # fmt: skip
    return _register(work, output)


def _register(work: dist.Work, output: torch.Tensor) -> int:
    """A handle for `synchronize` and `poll` on `work`, whose result is `output`."""
    handle = next(_handle_ids)
    _handles[handle] = (work, output)
    return handle


def push_pull_async(tensor: torch.Tensor, average: bool = True, name: str | None = None, version: int = 0,
                    priority: int = 0) -> int:  # fmt: skip
    """Start averaging (or summing) `tensor` over every rank into a new tensor; return a handle for `synchronize`.

    `priority`: partitions of a higher one go ahead of those queued before them (the client's credit scheduler).
    Example: `h = bps.push_pull_async(t, name="t"); out = bps.synchronize(h)`.
    """
    return _launch(tensor, torch.empty_like(tensor), average, name, version, priority)


def push_pull_async_inplace(tensor: torch.Tensor, average: bool = True, name: str | None = None, version: int = 0,
                            priority: int = 0) -> int:  # fmt: skip
    """As `push_pull_async`, the result written into `tensor`."""
    return _launch(tensor, tensor, average, name, version, priority)


def push_pull_inplace(tensor: torch.Tensor, average: bool = True, name: str | None = None, version: int = 0,
                      priority: int = 0) -> torch.Tensor:  # fmt: skip
    """Average (or sum) `tensor` over every rank in place; return it."""
    return synchronize(push_pull_async_inplace(tensor, average, name, version, priority))


class _PushPull(torch.autograd.Function):
    @staticmethod
    def forward(ctx, tensor, average, name, version, priority):
        ctx.args = (average, name, version, priority)
        return synchronize(push_pull_async(tensor, average, name, version, priority))

    @staticmethod
    def backward(ctx, grad):
        return push_pull(grad, *ctx.args), None, None, None, None


def push_pull(tensor: torch.Tensor, average: bool = True, name: str | None = None, version: int = 0,
              priority: int = 0, compression=Compression.none) -> torch.Tensor:  # fmt: skip
    """Average (or sum) `tensor` over every rank into a new tensor; differentiable (the gradient is push-pulled).

    Example: `mean = bps.push_pull(loss.detach(), name="loss")`.
    """
    if name is None:
        raise ConfigError("push_pull needs name= (as BytePS's does)")
    sent, ctx = compression.compress(tensor)
    return compression.decompress(_PushPull.apply(sent, average, name, version, priority), ctx)


def poll(handle: int) -> bool:
    """Whether the push_pull of `handle` has finished (`synchronize` then returns at once)."""
    return _handles[handle][0].is_completed()


def synchronize(handle: int) -> torch.Tensor | None:
    """Wait for the push_pull of `handle` and return its result (it raises that collective's error)."""
    entry = _handles.pop(handle, None)
    if entry is None:
        return None
    work, output = entry
    work.wait()
    return output


def declare(name: str) -> int:
    """Record a tensor name (BytePS declares names to agree on keys; here collectives go in program order)."""
    _declared.add(name)
    return 0


# -- the optimizers -----------------------------------------------------------------------------------------------
class _DistributedOptimizer:
    """Mixed into the user's optimizer's class by DistributedOptimizer; its state is named `_bps_*`."""

    def _bps_setup(self, named_parameters, compression, backward_passes_per_step: int, average: bool = True,
                   sparse_as_dense: bool = False) -> None:  # fmt: skip
        if int(os.environ.get("BYTEPS_ENABLE_ASYNC", "0")):
            raise ConfigError("BYTEPS_ENABLE_ASYNC: BytePS's asynchronous mode is torch_bps.AsyncTraining here")
        named = list(named_parameters) if named_parameters is not None else []
        if any(not isinstance(x, tuple) for x in named):
            raise ValueError("named_parameters should be a sequence of (name, parameter) tuples, e.g. "
                             "model.named_parameters()")  # fmt: skip
        names = [n for n, _ in named]
        if len(set(names)) != len(names):
            raise ValueError(f"named_parameters: duplicate names {sorted({n for n in names if names.count(n) > 1})}")
        # once each: a weight tied between modules (or listed twice) is pushed and updated once a step
        self._bps_params = list(dict.fromkeys(p for g in self.param_groups for p in g["params"] if p.requires_grad))
        given = {p: n for n, p in named}
        self._bps_names = {p: given.get(p, f"push_pull.noname.{i}") for i, p in enumerate(self._bps_params)}
        self._bps_compression = compression
        self._bps_average = average
        self._bps_sparse_as_dense = sparse_as_dense
        self.backward_passes_per_step = backward_passes_per_step
        self._bps_delay = dict.fromkeys(self._bps_params, backward_passes_per_step)
        self._bps_handles: dict = {}  # parameter -> (handle, ctx, tensor sent): pushes synchronize waits for
        self._bps_sent: set = set()  # parameters pushed since the last step
        self._bps_synchronized = False
        self._bps_should_sync = True
        for p in self._bps_params:
            p.register_post_accumulate_grad_hook(self._bps_grad_ready)

    def set_backward_passes_per_step(self, passes: int) -> None:
        self.backward_passes_per_step = passes
        self._bps_delay = dict.fromkeys(self._bps_params, passes)

    def _bps_grad_ready(self, p: torch.Tensor) -> None:
        """Autograd accumulated `p`'s gradient: count the pass, push on the last one of the step."""
        if self._bps_delay[p] <= 0:
            raise AssertionError(f"the gradient of {self._bps_names[p]} was computed more than "
                                 f"backward_passes_per_step={self.backward_passes_per_step} times before step(): "
                                 "raise backward_passes_per_step to accumulate locally")  # fmt: skip
        self._bps_synchronized = False
        self._bps_delay[p] -= 1
        if self._bps_delay[p] == 0:
            self._bps_send(p)

    def _bps_push(self, p: torch.Tensor, priority: int = 0) -> tuple:
        """Start the push_pull of `p`'s gradient (compressed); return (handle, ctx, tensor sent)."""
        if p.grad is None:  # unused on this rank: it still takes part, with zeros
            p.grad = torch.zeros_like(p)
        if p.grad.is_sparse:
            if not self._bps_sparse_as_dense:
                raise ConfigError(f"{self._bps_names[p]}: a sparse gradient; pass sparse_as_dense=True")
            p.grad = p.grad.to_dense()
        sent, ctx = self._bps_compression.compress(p.grad)
        handle = push_pull_async_inplace(sent, self._bps_average, "Gradient." + self._bps_names[p], 0, priority)
        return handle, ctx, sent

    def _bps_send(self, p: torch.Tensor) -> None:
        self._bps_sent.add(p)
        self._bps_handles[p] = self._bps_push(p)

    def _bps_send_missing(self) -> None:
        """Push what was not pushed since the last step (unused parameters; passes short of the count), in
        parameter order: every rank pushes every parameter once per step."""
        for p in self._bps_params:
            if p not in self._bps_sent:
                self._bps_send(p)
        self._bps_sent = set()

    def _bps_take(self, p: torch.Tensor, entry: tuple) -> None:
        """Wait for a push of `p` and put the averaged gradient into p.grad."""
        handle, ctx, sent = entry
        summed = synchronize(handle)
        if sent is not p.grad:
            p.grad.copy_(self._bps_compression.decompress(summed, ctx))
        self._bps_delay[p] = self.backward_passes_per_step

    def synchronize(self) -> None:
        """Wait until every gradient is averaged over the job (then clip, and step inside `skip_synchronize()`)."""
        self._bps_send_missing()
        handles, self._bps_handles = self._bps_handles, {}
        for p, entry in handles.items():
            self._bps_take(p, entry)
        self._bps_synchronized = True

    @contextlib.contextmanager
    def skip_synchronize(self):
        """step() inside it does not synchronize (it was, by hand: `synchronize()`, clip, then step)."""
        self._bps_should_sync = False
        try:
            yield
        finally:
            self._bps_should_sync = True

    def step(self, closure=None):
        if self._bps_should_sync and not self._bps_synchronized:
            self.synchronize()
        self._bps_synchronized = False
        return super().step(closure)


def _extend(optimizer: torch.optim.Optimizer, mixin: type) -> torch.optim.Optimizer:
    """Give `optimizer` the behaviour of `mixin` (isinstance checks and LR schedulers keep working)."""
    if isinstance(optimizer, _DistributedOptimizer):
        raise ValueError("the optimizer is already a DistributedOptimizer")
    base = type(optimizer)
    optimizer.__class__ = type(base.__name__, (mixin, base), {"_bps_base": base})
    return optimizer


def DistributedOptimizer(optimizer: torch.optim.Optimizer, named_parameters=None, compression=Compression.none,
                         backward_passes_per_step: int = 1) -> torch.optim.Optimizer:  # fmt: skip
    """Average every gradient over the job as autograd produces it; `step()` waits for them, then steps.

    Args:
        optimizer: any torch optimizer; it is returned, extended (its state and hyperparameters kept).
        named_parameters: `model.named_parameters()`, to name the pushes in errors.
        compression: `Compression.none` or `Compression.fp16`.
        backward_passes_per_step: backward passes accumulated locally before the push.

    Example (clipping): `loss.backward(); opt.synchronize(); clip_grad_norm_(params, 1.0); opt.step()`.
    """
    optimizer = _extend(optimizer, _DistributedOptimizer)
    optimizer._bps_setup(named_parameters, compression, backward_passes_per_step)
    return optimizer


# -- broadcasts ---------------------------------------------------------------------------------------------------
def broadcast_parameters(params, root_rank: int, prefix: str = "Parameter.") -> None:
    """Copy `params` (a state_dict, named_parameters() or parameters()) from `root_rank` to every rank, in place."""
    if isinstance(params, dict):
        tensors = [t for _, t in sorted(params.items())]
    else:  # a list or generator of parameters or of (name, parameter)
        tensors = [p[1] if isinstance(p, tuple) else p for p in params]
    _runtime()
    for t in tensors:
        dist.broadcast(t.detach(), src=root_rank)


def broadcast_object(obj, root_rank: int = 0, name: str | None = None):
    """Return `obj` as `root_rank` holds it (pickled), on every rank."""
    _runtime()
    box = [obj if rank() == root_rank else None]
    dist.broadcast_object_list(box, src=root_rank)
    return box[0]


def broadcast_optimizer_state(optimizer: torch.optim.Optimizer, root_rank: int, prefix: str = "Parameter.") -> None:
    """Give every rank `root_rank`'s optimizer state and hyperparameters (bit for bit)."""
    state = optimizer.state_dict() if rank() == root_rank else None
    if state is not None:  # pickled from host memory; load_state_dict puts it back on each parameter's device
        state = _on_host(state)
    state = broadcast_object(state, root_rank)
    if rank() != root_rank:
        optimizer.load_state_dict(state)


def _on_host(x):
    if isinstance(x, torch.Tensor):
        return x.cpu()
    if isinstance(x, dict):
        return {k: _on_host(v) for k, v in x.items()}
    if isinstance(x, (list, tuple)):
        return type(x)(_on_host(v) for v in x)
    return x


# -- byteps.torch.parallel ------------------------------------------------------------------------------------------
class DistributedDataParallel(torch.nn.parallel.DistributedDataParallel):
    """BytePS's `byteps.torch.parallel.DistributedDataParallel`: torch's DDP on the default group ("byteps" after
    init()); `compression=Compression.fp16` registers torch's fp16 compress hook."""

    def __init__(self, module: torch.nn.Module, device_ids=None, broadcast_buffers: bool = True,
                 compression=Compression.none, **kwargs):  # fmt: skip
        init()
        if not any(p.is_cuda for p in module.parameters()):
            device_ids = None  # BytePS's scripts pass [local_rank()] also on CPU, which torch's DDP refuses there
        super().__init__(module, device_ids=device_ids, broadcast_buffers=broadcast_buffers, **kwargs)
        if compression is Compression.fp16:
            from torch.distributed.algorithms.ddp_comm_hooks import default_hooks

            self.register_comm_hook(None, default_hooks.fp16_compress_hook)


def __getattr__(name: str):
    if name == "CrossBarrier":  # torch_bps/cross_barrier.py builds on this module: imported once this one is
        from torch_bps.cross_barrier import CrossBarrier

        return CrossBarrier
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")


# BytePS scripts import `byteps.torch.parallel` and `byteps.torch.cross_barrier`: the same names answer here.
parallel = types.ModuleType(f"{__name__}.parallel", "BytePS's byteps.torch.parallel")
parallel.DistributedDataParallel = DistributedDataParallel
cross_barrier = types.ModuleType(f"{__name__}.cross_barrier", "BytePS's byteps.torch.cross_barrier")
cross_barrier.__getattr__ = __getattr__
sys.modules[parallel.__name__], sys.modules[cross_barrier.__name__] = parallel, cross_barrier
