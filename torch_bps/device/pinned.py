"""CUDA tensors through host memory: a side copy stream, events, and pinned staging.

The summation service works on host memory, so a GPU tensor makes a round trip. Two ways:

- `DeviceStaging`, the whole tensor at once (what `HostCopy` uses for the "byteps" collectives and bps_hook): a
  pinned copy made on the side stream after the caller's stream (always, even for a tensor the collective
  only writes: a queued write of the caller's must not land after the result), and the copy back on that
  stream. The caller's thread waits for its own copy's event only, never for the stream or the device.
- `PartitionPipeline`, one partition at a time through a bounded pool of pinned slots (`PinnedPool`): the copy of
  partition i + 1 is queued before partition i is pushed, so the DMA runs under the push; each pulled sum is
  copied back on the same stream, which orders the slot's next use after it. Nothing waits on the caller's
  thread. `done` runs with the side stream current, so a device Future records its event after the last copy
  back and the stream the caller reads on waits for it. A slot is given back once its pulled sum has been queued
  for the copy back (the next copy into it is ordered after that by the stream itself): at most `slots` x
  `slot_bytes` bytes are ever pinned; a slot a failed collective may still receive a late reply into is dropped,
  not reused, and a fresh one takes its place.

Every stream, event and copy goes through `CudaOps` (cuda_ops.py), which a test replaces by a recorder.
May import: torch, torch_bps.errors, torch_bps.futures, torch_bps.device.cuda_ops.
"""

from __future__ import annotations

import contextlib
import logging
import queue
import threading
import weakref
from collections import deque
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field

import torch

from torch_bps.device.cuda_ops import CudaOps, TorchCudaOps
from torch_bps.errors import BpsError, BpsTimeoutError, ConfigError
from torch_bps.futures import Done

log = logging.getLogger("torch_bps.device")

_ops: CudaOps | None = None
_ops_lock = threading.Lock()
STAGING_TIMEOUT = 300.0  # seconds a host wait on one copy may take: longer means the device is hung
# Pinned slots per device and runtime: two keep a copy under every push; more ride out uneven pull times.
PIPELINE_SLOTS = 4
_pipelines: weakref.WeakKeyDictionary = weakref.WeakKeyDictionary()  # runtime -> {device: PartitionPipeline}
_pipelines_lock = threading.Lock()

# push(index, host view of the partition, pulled): send it; call pulled(error or None) once its sum is in the view
Push = Callable[[int, torch.Tensor, Done], None]


def cuda_ops() -> CudaOps:
    """The process's `CudaOps` (torch.cuda), made on first use."""
    global _ops
    with _ops_lock:
        if _ops is None:
            _ops = TorchCudaOps()
        return _ops


def pipeline_for(runtime, device: torch.device) -> PartitionPipeline:
    """The runtime's `PartitionPipeline` for `device`, made on first use: slots of its largest partition, closed when
    the runtime goes."""
    ops = cuda_ops()
    with _pipelines_lock:
        pipes = _pipelines.setdefault(runtime, {})
        if device not in pipes:
            pipe = pipes[device] = PartitionPipeline(device, runtime.config.partition_bytes, PIPELINE_SLOTS, ops=ops)
            weakref.finalize(runtime, pipe.close)
        return pipes[device]


def staging_kind(device: torch.device, contiguous: bool) -> str:
    """How a tensor is staged: "in_place" (CPU, contiguous: summed in its own storage), "host_copy"
    (CPU, strided: a contiguous copy), or "device" (CUDA: pinned host buffer and copy stream)."""
    if device.type == "cuda":
        return "device"
    if device.type != "cpu":
        raise TypeError(f"tensors on {device} are not supported by the 'byteps' backend (cpu and cuda only)")
    return "in_place" if contiguous else "host_copy"


def completion_context(device: torch.device | None) -> contextlib.AbstractContextManager:
    """What a completion thread runs a device collective's finishes and `set_result` under: the device set
    (else torch makes a context on cuda:0) and the side stream current (else the event lands on the legacy
    default stream, i.e. the training stream, at an arbitrary point)."""
    if device is None or device.type != "cuda":
        return contextlib.nullcontext()
    ops = cuda_ops()
    return ops.on_stream(device, ops.side_stream(device))


def order_after_caller(device: torch.device) -> None:
    """Make `device`'s side stream wait for what the caller's stream has queued so far. On the caller's thread, at
    launch, for a collective that writes into a user's tensor from the side stream (`copy_on_side`): a write the
    caller queued before the collective must not land after its result."""
    ops = cuda_ops()
    ready = ops.new_event()
    ops.record(ready, ops.current_stream(device))
    ops.wait_event(ops.side_stream(device), ready)


def copy_on_side(dst: torch.Tensor, src: torch.Tensor, device: torch.device) -> None:
    """Copy `src` (host memory) into a user's tensor `dst` on `device`'s side stream: after `order_after_caller` at
    launch, and before the Future's event (run under `completion_context`)."""
    ops = cuda_ops()
    stream = ops.side_stream(device)
    ops.copy(dst, src, stream)
    ops.record_stream(dst, stream)  # the caller may drop it before the copy ran


class DeviceStaging:
    """One CUDA tensor's flat pinned host copy (`flat`) and the way back (`write_back`)."""

    def __init__(self, real: torch.Tensor, load: bool, ops: CudaOps | None = None):
        self._ops = ops or cuda_ops()
        self._real = real
        self._device = real.device
        self._stream = self._ops.side_stream(self._device)
        src = real.reshape(-1) if load else None  # a strided tensor's copy is made on the caller's stream: first
        ready = self._ops.new_event()
        self._ops.record(ready, self._ops.current_stream(self._device))
        # Always, not only when loading: write_back must land after every write the caller queued before this.
        self._ops.wait_event(self._stream, ready)
        self.flat = self._ops.pinned(real.numel() * real.element_size()).view(real.dtype)
        if load:
            self._ops.copy(self.flat, src, self._stream)
            self._ops.record_stream(src, self._stream)  # the caller may free it before the copy ran
            copied = self._ops.new_event()
            self._ops.record(copied, self._stream)
            # The push reads the host buffer next: wait for this copy, not the stream nor the device.
            self._ops.wait_host(copied, STAGING_TIMEOUT, f"the copy of {real.numel()} elements to the host")

    def write_back(self) -> None:
        # A plain copy, not a kernel: the result has the tensor's own dtype and needs no scale, and a DMA
        # moves every dtype and every bit pattern (a broadcast's NaN payloads) unchanged. Run under
        # `completion_context`, the Future's event follows it on the same stream.
        self._ops.copy(self._real, self.flat.view(self._real.shape), self._stream)
        self._ops.record_stream(self._real, self._stream)


@dataclass
class _Job:
    tensor: torch.Tensor
    bounds: Sequence[tuple[int, int]]
    push: Push
    done: Done
    ready: object  # the event recorded on the caller's stream at start
    prepare: Callable[[], None] | None = None
    error: BaseException | None = None
    returned: int = 0  # partitions whose sums were queued for the copy back
    pushed: int = 0
    ended: bool = False
    slots: dict[int, int] = field(default_factory=dict)  # partition -> pool slot, while in flight


class PartitionPipeline:
    """Stage CUDA tensors to the host and back one partition at a time, overlapped, in submission order.

    Args:
        device: the CUDA device of the tensors.
        slot_bytes: the largest partition, in bytes (a pool slot's size).
        slots: pinned slots (>= 2): bounds pinned memory to slots x slot_bytes and partitions in flight.
        ops: stream/event/copy operations (default torch.cuda).
        timeout: the longest a host wait (a copy's event, a free slot) may take, in seconds.

    Example: `pipe.start(grad.view(-1), [(0, n // 2), (n // 2, n)], push, done)`; `done` runs once, on the
    thread that queued the last copy back (or the one that met the error), with the side stream current.
    """

    def __init__(self, device: torch.device, slot_bytes: int, slots: int = 4, ops: CudaOps | None = None,
                 timeout: float = STAGING_TIMEOUT):  # fmt: skip
        self.device = torch.device(device)
        self._ops = ops or cuda_ops()
        self._stream = self._ops.side_stream(self.device)
        self.pool = PinnedPool(self._ops, slot_bytes, slots)
        self.timeout = timeout
        self._lock = threading.Lock()
        self._jobs: queue.Queue[_Job | Callable[[], None] | None] = queue.Queue()
        self._pending = 0  # tensors (and `after` calls) queued whose partitions are not all handed over yet
        self._thread = threading.Thread(target=self._loop, name="bps-copy-out", daemon=True)
        self._thread.start()

    def start(self, tensor: torch.Tensor, bounds: Sequence[tuple[int, int]], push: Push, done: Done, *,
              prepare: Callable[[], None] | None = None) -> None:  # fmt: skip
        """Queue `tensor` (1-D, contiguous, on `device`): each [lo, hi) of `bounds` is copied to a pinned slot,
        pushed, and its pulled sum copied back into the tensor; then `done(error or None)`. Returns at once.
        `prepare` runs first, on the staging thread with the side stream current, after the caller's stream's work
        (the device local reduce-scatter: paths.py); if it raises, the tensor fails with its error."""
        for lo, hi in bounds:
            if (hi - lo) * tensor.element_size() > self.pool.slot_bytes:
                raise ValueError(f"partition [{lo}, {hi}) of {hi - lo} x {tensor.element_size()} bytes exceeds the "
                                 f"staging slot of {self.pool.slot_bytes} bytes")  # fmt: skip
        ready = self._ops.new_event()
        self._ops.record(ready, self._ops.current_stream(self.device))
        self._ops.record_stream(tensor, self._stream)  # the caller may drop it while copies are queued
        with self._lock:
            self._pending += 1
        self._jobs.put(_Job(tensor, list(bounds), push, done, ready, prepare))

    def pending(self) -> int:
        """Tensors started (and `after` calls) whose partitions have not all been handed to `push` yet."""
        with self._lock:
            return self._pending

    def after(self, fn: Callable[[], None]) -> None:
        """Run `fn` on the staging thread once every tensor started before has handed all its partitions to `push`:
        what a caller submitting other work to the same service needs to keep one submission order."""
        with self._lock:
            self._pending += 1
        self._jobs.put(fn)

    def on_its_thread(self) -> bool:
        """Whether the caller is this pipeline's staging thread (which must never run a Future's callbacks)."""
        return threading.current_thread() is self._thread

    def close(self, timeout: float = 5.0) -> None:
        self._jobs.put(None)
        self._thread.join(timeout)

    def _loop(self) -> None:
        # The device set for the thread's life (its pinned allocations, events and copies make no context on cuda:0),
        # and the side stream current.
        with self._ops.on_stream(self.device, self._stream):
            self._serve()

    def _serve(self) -> None:
        while (job := self._jobs.get()) is not None:
            try:
                if isinstance(job, _Job):
                    self._stage_out(job)
                else:
                    job()
            except BaseException as e:  # noqa: BLE001 - the job fails with it; the loop serves the next one
                if isinstance(job, _Job):
                    self._end(job, e)
                else:
                    log.exception("torch_bps: a call queued behind the staging failed")
            finally:
                with self._lock:
                    self._pending -= 1

    def _stage_out(self, job: _Job) -> None:
        self._ops.wait_event(self._stream, job.ready)  # the copies see everything the caller's stream wrote
        if job.prepare is not None:
            with self._ops.on_stream(self.device, self._stream):
                job.prepare()
        if not job.bounds:
            self._end(job, None)
            return
        copies: deque[tuple[int, torch.Tensor, object]] = deque([self._copy_out(job, 0)])
        for i in range(len(job.bounds)):
            if job.error is not None:
                return
            if i + 1 < len(job.bounds):  # queued before partition i is pushed: its DMA runs under that push
                copies.append(self._copy_out(job, i + 1))
            index, host, copied = copies.popleft()
            self._ops.wait_host(copied, self.timeout, f"the copy of partition {index} to the host")
            with self._lock:
                if job.error is not None:
                    return
                job.pushed += 1
            job.push(index, host, lambda error, index=index, host=host: self._pulled(job, index, host, error))

    def _copy_out(self, job: _Job, index: int) -> tuple[int, torch.Tensor, object]:
        lo, hi = job.bounds[index]
        slot, buf = self.pool.acquire(self.timeout, f"partition {index} [{lo}, {hi})")
        with self._lock:
            job.slots[index] = slot
        host = buf[: (hi - lo) * job.tensor.element_size()].view(job.tensor.dtype)
        self._ops.copy(host, job.tensor[lo:hi], self._stream)
        copied = self._ops.new_event()
        self._ops.record(copied, self._stream)
        return index, host, copied

    def _pulled(self, job: _Job, index: int, host: torch.Tensor, error: BaseException | None) -> None:
        if error is not None:
            self._end(job, error)
            return
        lo, hi = job.bounds[index]
        with self._lock:
            if job.error is not None:
                return
            self._ops.copy(job.tensor[lo:hi], host, self._stream)
            # The slot's next copy is queued on the same stream, so it waits for this one: reusable now.
            self.pool.release(job.slots.pop(index))
            job.returned += 1
            last = job.returned == len(job.bounds)
        if last:
            self._end(job, None)

    def _end(self, job: _Job, error: BaseException | None) -> None:
        with self._lock:
            if job.ended:
                return
            job.ended = True
            job.error = error
            for slot in job.slots.values():  # a late reply may still land in these: never reuse them
                self.pool.drop(slot)
            job.slots.clear()
        if error is not None and not isinstance(error, BpsError):
            log.debug("torch_bps: staging of a %s tensor failed: %r", self.device, error)
        with self._ops.on_stream(self.device, self._stream):
            job.done(error)


class PinnedPool:
    """`slots` pinned buffers of `slot_bytes` each, made on first use.

    Example: `i, buf = pool.acquire(60, "partition 3"); ...; pool.release(i)`.
    """

    def __init__(self, ops: CudaOps, slot_bytes: int, slots: int):
        if slots < 2:
            raise ConfigError(f"a staging pool needs at least 2 slots (one copying while one is pushed), got {slots}")
        if slot_bytes <= 0:
            raise ConfigError(f"slot_bytes={slot_bytes} must be positive")
        self.slot_bytes, self.slots = slot_bytes, slots
        self._ops = ops
        self._buffers: list[torch.Tensor | None] = [None] * slots
        self._free = list(range(slots - 1, -1, -1))  # a stack: the most recently used slot is reused first
        self._cond = threading.Condition()
        self.made = 0  # buffers allocated so far (slots dropped after a failure make this exceed `slots`)

    def acquire(self, timeout: float, what: str) -> tuple[int, torch.Tensor]:
        """Take a free slot, waiting up to `timeout` seconds for one; returns (index, uint8 buffer)."""
        with self._cond:
            if not self._cond.wait_for(lambda: self._free, timeout):
                raise BpsTimeoutError(f"waited {timeout:.1f} s for a free pinned staging slot ({self.slots} of "
                                      f"{self.slot_bytes} bytes, all in flight) for {what}")  # fmt: skip
            index = self._free.pop()
            if self._buffers[index] is None:
                self._buffers[index] = self._ops.pinned(self.slot_bytes)
                self.made += 1
            return index, self._buffers[index]

    def release(self, index: int) -> None:
        """Give a slot back for reuse."""
        with self._cond:
            self._free.append(index)
            self._cond.notify()

    def drop(self, index: int) -> None:
        """Give a slot back without its buffer, which a late reply may still write into."""
        with self._cond:
            self._buffers[index] = None
            self._free.append(index)
            self._cond.notify()

    @property
    def in_use(self) -> int:
        with self._cond:
            return self.slots - len(self._free)
