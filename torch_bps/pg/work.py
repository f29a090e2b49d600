"""Launching a collective's push_pulls, and the Work the caller gets back.

A collective is a list of `Exchange`s (engine/exchange.py): buffers the Runtime sums (or gathers) in place as
one unit, then their `finish` functions, which copy or reduce the sums to where the caller wants them. Both run,
and the Work's future completes, on one of the C++ client's completion threads (see torch_bps/engine/pipeline.py);
a user's callback that blocks there on another collective (PowerSGD) makes the client start another thread.

The Work is a C++ c10d Work (torch_bps._C.make_work): DDP's reducer and Join call its getFuture() from
C++, its wait() rethrows the collective's error and honours the group's timeout, and a failure is set on
the C++ future, so C++ consumers see an error rather than an exception object posing as a tensor.

May import: torch, torch_bps.futures, torch_bps.wire, torch_bps.engine.exchange, torch_bps.pg.device,
torch_bps.pg.device_local; torch_bps._C when a collective is launched (`import torch_bps` must not load the C++ client).
"""

from __future__ import annotations

import functools
from collections.abc import Sequence
from typing import Any

import torch
import torch.distributed as dist

from torch_bps.engine.exchange import Exchange
from torch_bps.futures import fail
from torch_bps.pg.device import completion_context, cuda_ops, order_after_caller
from torch_bps.pg.device_local import DeviceLocalStage


def locked(collective):
    """A BackendBPS collective from its checks, path choice and staging to its launch under the Runtime's launch lock
    (`self._launch_lock`): what two threads launch at once (DDP's autograd thread, a hook's callbacks) is then staged
    and launched in one order."""

    @functools.wraps(collective)
    def run(self, *args, **kwargs):
        with self._launch_lock:
            return collective(self, *args, **kwargs)

    return run


def launch(runtime, op: str, exchanges: Sequence[Exchange], result: Any, *, where: str, timeout: float,
           device: torch.device | None = None, priority: int = 0) -> dist.Work:  # fmt: skip
    """Sum (or gather) each exchange's tensor over the group, run the finishes, complete the Work's future with
    `result`. `priority`: the client sends the partitions of a higher one ahead of those queued before them.

    The caller holds the Runtime's launch lock (`Runtime.launch_lock`): collectives stay in one order on every rank.
    Exchanges with no elements send nothing (every rank skips them alike, since shapes must agree).

    Example: `launch(rt, "barrier", [Exchange(torch.zeros(1))], [], where="on group 0", timeout=60)`.
    """
    on_device = device is not None and device.type != "cpu"
    future = cuda_ops().future([device] if on_device else [])
    if on_device:  # the finishes may write into outputs the collective only writes (scatter, gather...)
        order_after_caller(device)

    def done(error: BaseException | None) -> None:
        # On a completion thread: device set and the side stream current, so copies back and the Future's event
        # are ordered on that stream and never dropped into the training stream (pg/device.py).
        with completion_context(device if on_device else None):
            if error is None:
                try:
                    for x in exchanges:
                        if x.finish is not None:
                            x.finish()
                except BaseException as e:  # noqa: BLE001 - the collective fails with it
                    error = e
            _settle(future, result, error, f"{op} {where}")

    runtime.run([x for x in exchanges if x.tensor.numel() > 0], done, priority=priority)
    return make_work(future, timeout, f"{op} {where}")


def launch_on_device(runtime, op: str, tensor: torch.Tensor, path, result: Any, *, average: bool, where: str,
                     timeout: float) -> dist.Work:  # fmt: skip
    """Sum (`average`: average) `tensor` (1-D, contiguous, floats on a CUDA device) in place over the group through
    `path`, as pg.device_local.route chose it, and complete the Work's future with `result`: a DeviceLocalStage
    (the machine's local stages on the device, its slice staged), or a PartitionPipeline (one local rank per
    machine: copied to the host, pushed, pulled and copied back, a partition at a time, overlapped). The caller
    holds the Runtime's launch lock.

    Example: `launch_on_device(rt, "allreduce", grad.view(-1), route(rt, grad), [grad], average=True,
    where="on group 0", timeout=60)`.
    """
    device = tensor.device
    future = cuda_ops().future([device])

    def done(error: BaseException | None) -> None:
        with completion_context(device):  # the copier calls it with its side stream current
            _settle(future, result, error, f"{op} {where}")

    scale = 1.0 / runtime.world_size if average else 1.0
    if isinstance(path, DeviceLocalStage):
        path.launch(tensor, scale, done)  # the scale fused into the local reduce-scatter
        return make_work(future, timeout, f"{op} {where}")
    if average:
        tensor.div_(runtime.world_size)  # first, on the caller's stream: the staging waits for it
    wire = runtime.travels_as(tensor)
    if wire == tensor.dtype:
        runtime.run_copied(tensor, path, done)
        return make_work(future, timeout, f"{op} {where}")
    # A wire dtype: cast on the device (the caller's stream), staged at its size; the sum cast back on the side
    # stream, where the copier runs `done`, before the Future's event.
    cast = tensor.to(wire)

    def cast_back(error: BaseException | None) -> None:
        if error is None:
            tensor.copy_(cast)
        done(error)

    runtime.run_copied(cast, path, cast_back)
    return make_work(future, timeout, f"{op} {where}")


def _settle(future: torch.futures.Future, result: Any, error: BaseException | None, what: str) -> None:
    """Complete a collective's future: with `result`, or with `error` noting what ran."""
    if error is None:
        future.set_result(result)
        return
    if hasattr(error, "add_note"):
        error.add_note(f"torch_bps: while running {what}")
    fail(future, error)


def make_work(future: torch.futures.Future, timeout: float, what: str) -> dist.Work:
    """The C++ Work over `future` that torch gets: wait() rethrows its error and honours `timeout` (seconds)."""
    from torch_bps import _C

    return _C.make_work(future, timeout, what)
