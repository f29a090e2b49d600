"""The stream, event and copy operations the device staging uses, behind one small interface.

`CudaOps` is what pinned.py and paths.py call; `TorchCudaOps` does it with torch.cuda. A test hands the staging a
recording stand-in instead (tests/backend/test_device_staging.py), so the order of copies, events and waits
is checked on a machine with no GPU. Streams and events are opaque to the staging: only this interface
touches them.

May import: torch, torch_bps.errors.
"""

from __future__ import annotations

import contextlib
import threading
import time
from collections.abc import Sequence
from typing import Any, Protocol

import torch

from torch_bps.errors import BpsTimeoutError


class CudaOps(Protocol):
    """What staging needs from a device: streams, events, asynchronous copies, pinned host memory, and Futures that
    carry device tensors."""

    def current_stream(self, device: torch.device) -> Any: ...
    def side_stream(self, device: torch.device) -> Any: ...
    def new_stream(self, device: torch.device) -> Any: ...
    def new_event(self) -> Any: ...
    def record(self, event: Any, stream: Any) -> None: ...
    def wait_event(self, stream: Any, event: Any) -> None: ...
    def wait_host(self, event: Any, timeout: float, what: str) -> None: ...
    def copy(self, dst: torch.Tensor, src: torch.Tensor, stream: Any) -> None: ...
    def record_stream(self, tensor: torch.Tensor, stream: Any) -> None: ...
    def pinned(self, nbytes: int) -> torch.Tensor: ...
    def on_stream(self, device: torch.device, stream: Any) -> contextlib.AbstractContextManager: ...
    def future(self, devices: Sequence[torch.device]) -> torch.futures.Future: ...


class TorchCudaOps:
    """`CudaOps` over torch.cuda: one side stream per device, made on first use."""

    def __init__(self) -> None:
        self._streams: dict[torch.device, torch.cuda.Stream] = {}
        self._lock = threading.Lock()

    def current_stream(self, device: torch.device) -> torch.cuda.Stream:
        return torch.cuda.current_stream(device)

    def side_stream(self, device: torch.device) -> torch.cuda.Stream:
        with self._lock:
            if device not in self._streams:
                self._streams[device] = torch.cuda.Stream(device=device)
            return self._streams[device]

    def new_stream(self, device: torch.device) -> torch.cuda.Stream:
        return torch.cuda.Stream(device=device)

    def new_event(self) -> torch.cuda.Event:
        return torch.cuda.Event()

    def record(self, event: torch.cuda.Event, stream: torch.cuda.Stream) -> None:
        event.record(stream)

    def wait_event(self, stream: torch.cuda.Stream, event: torch.cuda.Event) -> None:
        stream.wait_event(event)

    def wait_host(self, event: torch.cuda.Event, timeout: float, what: str) -> None:
        # Polled rather than event.synchronize(): that cannot time out, and a hung kernel would hang this thread.
        deadline, pause = time.monotonic() + timeout, 1e-5
        while not event.query():
            if time.monotonic() > deadline:
                raise BpsTimeoutError(f"waited {timeout:.1f} s for the device to finish {what}")
            time.sleep(pause)
            pause = min(pause * 2, 1e-3)

    def copy(self, dst: torch.Tensor, src: torch.Tensor, stream: torch.cuda.Stream) -> None:
        # The stream's device first: a bare torch.cuda.stream() returns the thread to the device it found, cuda:0 on a
        # fresh thread, and so makes a context there for a rank on another GPU.
        with torch.cuda.device(stream.device), torch.cuda.stream(stream):
            dst.copy_(src, non_blocking=True)  # pinned host memory on one side: truly asynchronous

    def record_stream(self, tensor: torch.Tensor, stream: torch.cuda.Stream) -> None:
        tensor.record_stream(stream)

    def pinned(self, nbytes: int) -> torch.Tensor:
        return torch.empty(nbytes, dtype=torch.uint8, pin_memory=True)

    def on_stream(self, device: torch.device, stream: torch.cuda.Stream) -> contextlib.AbstractContextManager:
        stack = contextlib.ExitStack()
        stack.enter_context(torch.cuda.device(device))  # a completion thread's device is otherwise cuda:0
        stack.enter_context(torch.cuda.stream(stream))
        return stack

    def future(self, devices: Sequence[torch.device]) -> torch.futures.Future:
        # With its CUDA devices, set_result records an event on each one's current stream, and a waiter's stream
        # waits for it; without them a reader may see the tensors before the copies into them ran.
        return torch.futures.Future(devices=list(dict.fromkeys(d for d in devices if d.type == "cuda")))
