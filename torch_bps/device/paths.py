"""The CUDA paths of a float sum, and the one that runs a collective's local stages on the device (paper, section 4.2).

A contiguous CUDA tensor of floats summed or averaged over the group (a `bps_hook` bucket with nothing compressed)
takes the first path of `PATHS` whose `enabled` holds (`choose`, the one place that decides), else the host path
(whole-tensor staging through pinned memory, `pinned.DeviceStaging`, and the host local stages):

- `DeviceLocalPath`: a machine of several local ranks whose devices map each other's memory (comm.py's
  `open_local_stage`), through `DeviceLocalStage`:

      reduce-scatter on the device (the fused kernel sums the peers' slices, scales an AVG, casts to the wire dtype)
      -> this rank's slice staged one partition at a time to the servers and back (engine.run_copied, sliced)
      -> all-gather on the device (copies from the peers' buffers) -> the Work completes

- `PartitionPath`: one local rank per machine: each partition through pinned host memory, overlapped
  (`pinned.PartitionPipeline`).

Every local rank must meet the others in each channel in the same order. The reduce-scatters run on the copier's
thread (its `prepare`: one thread, submission order, right before the slice's copies to the host); the
all-gathers in submission order on the completion thread that ended each collective's network stage, as the host
local stages' gatherer does (engine/local_stages.py). Two channels: a rank waiting in an all-gather never holds up a
reduce-scatter a peer's network stage needs. A Future's callbacks never run on the copier's thread: a callback may
wait for a later collective. When the machine is the whole job nothing is staged: the two local stages make the sum.

May import: torch, torch_bps.errors, torch_bps.device.
"""

from __future__ import annotations

import functools
import threading
import weakref
from collections import deque
from dataclasses import dataclass

import torch

from torch_bps.device.cuda_ops import CudaOps
from torch_bps.device.pinned import Done, PartitionPipeline, cuda_ops, pipeline_for
from torch_bps.errors import BpsError

_stages: weakref.WeakKeyDictionary = weakref.WeakKeyDictionary()  # runtime -> {device: DeviceLocalStage | None}
_stages_lock = threading.Lock()


@dataclass
class _Job:
    flat: torch.Tensor
    lo: int  # this local rank's slice [lo, hi)
    hi: int
    done: Done
    wire: torch.Tensor | None  # the slice's sum in the wire dtype (in a tensor of flat's numel), or None: flat's own
    ended: bool = False  # its network stage ended (or, alone, its reduce-scatter)
    error: BaseException | None = None


class DeviceLocalStage:
    """Sum CUDA tensors over the group with the machine's local stages on the device.

    The reduce-scatters run on the copier's thread, in submission order, right before each slice's copies to the
    host (its `prepare`). The all-gathers keep submission order too, and take turns as the host local stages' do
    (engine/local_stages.py): the thread that ends a collective's network stage (a completion thread: it copied the
    last partition back) gathers it at once when it is next in order and nobody gathers (the "gatherer"); a
    collective ready behind it goes to a fresh completion task before its `done` runs, since `done` runs the Future's
    callbacks, which may wait for a later collective (PowerSGD). When the machine is the whole job, the copier's
    thread gathers each collective right after its reduce-scatter and posts `done`: it must meet its peers' threads
    in one interleaving (reduce-scatter k, all-gather k, reduce-scatter k + 1), and must never run a callback.

    Args:
        runtime: the group's Runtime (`run_copied`, `alone`, `post`: a task on the client's completion pool).
        device: the tensors' device.
        channels: (reduce-scatter, all-gather) DeviceLocalComm channels of the machine's local ranks.
        copier: the PartitionPipeline of `device` (its thread runs the reduce-scatters).
        ops: stream operations (default torch.cuda; tests pass CPU stand-ins).

    Example: `stage.launch(grad.view(-1), 1 / world, done)`; `done(error or None)` runs on a thread of the client's
    completion pool with the side stream current, after the all-gather's copies were queued on it.
    """

    def __init__(self, runtime, device: torch.device, channels, copier: PartitionPipeline, ops: CudaOps | None = None):
        self.device = torch.device(device)
        self._runtime = weakref.proxy(runtime)  # the runtime keeps its stages (stage_for), not the other way round
        self._rs, self._ag = channels
        self._copier = copier
        self._ops = ops or cuda_ops()
        self._stream = self._ops.side_stream(self.device)
        self._order: deque[_Job] = deque()  # launched, not yet gathered: submission order
        self._lock = threading.Lock()
        self._gathering = False  # a thread holds the gatherer's role
        self.closed = False

    def launch(self, flat: torch.Tensor, scale: float, done: Done) -> None:
        """Sum `flat` (1-D, contiguous, floats on `device`) in place over the group, times `scale`, then `done`.
        Every rank calls it for the same collective, under the Runtime's launch lock. Returns at once."""
        lo, hi = self._rs.slice_range(flat.numel())
        dtype = flat.dtype if self._runtime.alone else self._runtime.travels_as(flat)
        # A wire dtype: the reduce-scatter casts the slice's sum into it in the same pass, and that is what is staged.
        wire = None if dtype == flat.dtype else torch.empty(flat.numel(), dtype=dtype, device=flat.device)
        job = _Job(flat, lo, hi, done, wire)
        with self._lock:
            if self.closed:
                raise BpsError(f"the device local stage on {self.device} is closed")
            self._order.append(job)
        outgoing = flat if wire is None else wire
        prepare = functools.partial(self._rs.reduce_scatter, flat, out=outgoing[lo:hi], scale=scale)
        ended = functools.partial(self._network_ended, job)
        try:
            if self._runtime.alone:  # no slice to copy out: the copier's thread runs the reduce-scatter, in order
                self._copier.start(flat, [], None, ended, prepare=prepare)
            else:
                self._runtime.run_copied(outgoing, self._copier, ended, sliced=True, prepare=prepare)
        except BaseException:
            with self._lock:
                self._order.remove(job)
            raise

    def close(self) -> None:
        """Fail the collectives not yet gathered (one being gathered ends as its all-gather does; the runtime closes
        the channels)."""
        with self._lock:
            self.closed = True
            left, self._order = list(self._order), deque()
        for job in left:
            self._hand_over(job, BpsError(f"the device local stage on {self.device} closed before the sum"), False)

    def _network_ended(self, job: _Job, error: BaseException | None) -> None:
        """On the thread that ended job's network stage (alone: the copier's, after its reduce-scatter): gather it
        here if it is next and nobody gathers, else leave it to whoever will."""
        with self._lock:
            job.ended, job.error = True, error
            if self._gathering or not self._order or self._order[0] is not job:
                return
            self._gathering = True
        self._gather_next()

    def _gather_next(self) -> None:
        """Gather the first collective not yet gathered (its network stage ended) and complete it; the caller holds
        the gatherer's role, which passes to a fresh completion task if the next collective is ready too."""
        with self._lock:
            if not self._order:  # closed meanwhile: close() failed the rest
                self._gathering = False
                return
            job = self._order.popleft()
        error = job.error
        try:  # a rank whose network stage failed comes with nothing to give: its peers fail at once, naming it
            with self._ops.on_stream(self.device, self._stream):
                mine = job.flat[job.lo : job.hi]
                if error is None and job.wire is not None:  # the pulled sum back from the wire dtype
                    mine.copy_(job.wire[job.lo : job.hi])
                self._ag.all_gather(mine, job.flat, failed=error is not None)
        except BaseException as e:  # noqa: BLE001 - the collective fails with it (a failed one keeps its own)
            error = error or e
        with self._lock:
            more = bool(self._order) and self._order[0].ended
            self._gathering = more
        if more:  # before `done`, which may block on a later collective
            self._post(self._gather_next)
        # The copier's thread runs the reduce-scatters a callback may wait for: `done` goes to the completion pool.
        self._hand_over(job, error, inline=not self._copier.on_its_thread())

    def _post(self, task) -> None:
        try:
            self._runtime.post(task)
        except BaseException:  # noqa: BLE001 - the runtime or its client is gone: never lose a completion
            task()

    def _hand_over(self, job: _Job, error: BaseException | None, inline: bool) -> None:
        complete = functools.partial(self._complete, job, error)
        if inline:
            complete()
        else:
            self._post(complete)

    def _complete(self, job: _Job, error: BaseException | None) -> None:
        with self._ops.on_stream(self.device, self._stream):
            job.done(error)


def stage_for(runtime, device: torch.device) -> DeviceLocalStage | None:
    """The runtime's DeviceLocalStage for `device`, opened on first use (None: one local rank, the CPU-assisted
    path, or Config.device_local off); the decision is kept."""
    with _stages_lock:
        stages = _stages.setdefault(runtime, {})
        if device not in stages:
            channels = runtime.open_device_channels(device)
            stage = None
            if channels is not None:
                stage = DeviceLocalStage(runtime, device, channels, pipeline_for(runtime, device))
                weakref.finalize(runtime, stage.close)
            stages[device] = stage
        return stages[device]


class DeviceLocalPath:
    """Several local ranks whose GPUs map each other's memory: the local stages on the device, the slice staged.

    Args:
        stage: the DeviceLocalStage to use (tests); default the runtime's for the tensor's device (`stage_for`).
    """

    def __init__(self, stage: DeviceLocalStage | None = None):
        self._stage = stage

    def stage(self, runtime, device: torch.device) -> DeviceLocalStage | None:
        return self._stage if self._stage is not None else stage_for(runtime, device)

    def enabled(self, runtime, tensor: torch.Tensor) -> bool:
        """Collective among the machine's local ranks the first time a device is seen (stage_for)."""
        return self.stage(runtime, tensor.device) is not None

    def run(self, runtime, tensor: torch.Tensor, average: bool, done: Done) -> None:
        """Sum (average) `tensor` (1-D) in place over the group, then `done`; the scale fused in the reduce-scatter."""
        scale = 1.0 / runtime.world_size if average else 1.0
        self.stage(runtime, tensor.device).launch(tensor, scale, done)


class PartitionPath:
    """One local rank per machine: a partition at a time through pinned host memory, overlapped (PartitionPipeline).

    Args:
        pipeline: the PartitionPipeline to use (tests); default the runtime's for the tensor's device.
    """

    def __init__(self, pipeline: PartitionPipeline | None = None):
        self._pipeline = pipeline

    def enabled(self, runtime, tensor: torch.Tensor) -> bool:
        wire = runtime.travels_as(tensor)  # cast to the wire dtype on the device: what the copier stages
        outgoing = tensor.view(-1) if wire == tensor.dtype else torch.empty(0, dtype=wire, device=tensor.device)
        return runtime.cannot_copy(outgoing) is None

    def run(self, runtime, tensor: torch.Tensor, average: bool, done: Done) -> None:
        """Sum (average) `tensor` (1-D) in place over the group, then `done` (with the side stream current)."""
        pipeline = self._pipeline if self._pipeline is not None else pipeline_for(runtime, tensor.device)
        if average:
            tensor.div_(runtime.world_size)  # first, on the caller's stream: the staging waits for it
        wire = runtime.travels_as(tensor)
        if wire == tensor.dtype:
            runtime.run_copied(tensor, pipeline, done)
            return
        # A wire dtype: cast on the device (the caller's stream), staged at its size; the sum cast back on the side
        # stream, where the copier runs `done`, before the Future's event.
        cast = tensor.to(wire)

        def cast_back(error: BaseException | None) -> None:
            if error is None:
                tensor.copy_(cast)
            done(error)

        runtime.run_copied(cast, pipeline, cast_back)


# The CUDA paths of a float sum, in order of preference: the first whose `enabled` holds runs.
PATHS: list = [DeviceLocalPath(), PartitionPath()]


def choose(runtime, tensor: torch.Tensor, op: str = "SUM", compressed: bool = False):
    """The path that sums (op "SUM" or "AVG") `tensor` over the group: the first of PATHS enabled for a contiguous
    CUDA tensor of floats with nothing to compress, else None: the host path (whole-tensor staging and the host local
    stages)."""
    if compressed or op not in ("SUM", "AVG") or not tensor.is_cuda or not tensor.is_contiguous():
        return None
    if not tensor.dtype.is_floating_point:
        return None
    return next((path for path in PATHS if path.enabled(runtime, tensor)), None)
