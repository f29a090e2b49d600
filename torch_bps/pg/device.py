"""CUDA tensors through host memory: pinned staging, a side copy stream, events, a copy back.

The summation service works on host memory, so a GPU tensor makes a round trip: device -> pinned host
buffer (on a copy stream that first waits for the producer's stream) -> push_pull -> copied straight from
the pinned buffer into the caller's tensor on the copy stream. The caller's stream is then made to wait for
the copy stream, so the Future (created with `devices=[...]`) records its completion event after the data is
in place.

Runs on a GPU only under `make gpu-test` (tests/gpu/); the CPU suite unit-tests `staging_kind` (the dispatch).
May import: torch.
"""

from __future__ import annotations

import threading

import torch

_streams: dict[torch.device, torch.cuda.Stream] = {}
_streams_lock = threading.Lock()


def staging_kind(device: torch.device, contiguous: bool) -> str:
    """How a tensor is staged: "in_place" (CPU, contiguous: summed in its own storage), "host_copy"
    (CPU, strided: a contiguous copy), or "device" (CUDA: pinned host buffer and copy stream)."""
    if device.type == "cuda":
        return "device"
    if device.type != "cpu":
        raise TypeError(f"tensors on {device} are not supported by the 'byteps' backend (cpu and cuda only)")
    return "in_place" if contiguous else "host_copy"


def _copy_stream(device: torch.device) -> torch.cuda.Stream:
    with _streams_lock:
        if device not in _streams:
            _streams[device] = torch.cuda.Stream(device=device)
        return _streams[device]


class DeviceStaging:
    """One CUDA tensor's flat pinned host copy (`flat`) and the way back (`write_back`)."""

    def __init__(self, real: torch.Tensor, load: bool):
        self._real = real
        self._device = real.device
        self._stream = _copy_stream(real.device)
        self.flat = torch.empty(real.numel(), dtype=real.dtype, pin_memory=True)
        if load:
            # The copy must see everything the caller's stream wrote (e.g. the backward pass's gradients).
            self._stream.wait_stream(torch.cuda.current_stream(self._device))
            with torch.cuda.stream(self._stream):
                self.flat.copy_(real.reshape(-1), non_blocking=True)
            real.record_stream(self._stream)  # the caller may free it before the copy ran
            self._stream.synchronize()  # push_pull reads the host buffer next: wait for this copy only

    def write_back(self) -> None:
        # A plain copy, not a kernel: the result has the tensor's own dtype and needs no scale, and a DMA
        # moves every dtype (int64 buffers, bools as bytes, float64) and every bit pattern (a broadcast's
        # NaN payloads) unchanged, straight from the pinned buffer into the tensor (any strides).
        with torch.cuda.device(self._device), torch.cuda.stream(self._stream):
            self._real.copy_(self.flat.view(self._real.shape), non_blocking=True)  # pinned: truly asynchronous
        # The thread completing the Future records its event on its current stream: order it after the copy.
        torch.cuda.current_stream(self._device).wait_stream(self._stream)
